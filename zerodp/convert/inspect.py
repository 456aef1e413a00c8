"""`zerodp inspect`: what a checkpoint is, and whether every file is present and intact."""

from __future__ import annotations

from collections import Counter

from zerodp.convert import open_checkpoint
from zerodp.errors import CheckpointError


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return ""


def _model_line(src) -> str:
    """The model an HF folder's config.json describes, in a few words (or why zerodp cannot run it)."""
    if src.meta.get("hf_config_error"):
        return f"not runnable by zerodp: {src.meta['hf_config_error']}"
    m = src.meta["config"]["model"]
    return (f"{src.meta['hf_config']['model_type']}, {m['n_layer']} layers, {m['n_embd']} wide, {m['n_head']} heads "
            f"({m['n_kv_head']} kv), vocab {m['vocab_size']}, {'tied' if m['tie_embeddings'] else 'untied'} head")


def _lora_words(path, src) -> str:
    """For a LoRA run's checkpoint or a PEFT folder: its adapters' settings and where their base is."""
    import json
    from pathlib import Path

    from zerodp.convert.lora_source import recorded_lora
    from zerodp.convert.peft import ADAPTER_CONFIG, is_peft_folder

    if is_peft_folder(path):
        try:
            c = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
            return (f" (PEFT {c.get('peft_type')} adapter: r {c.get('r')}, alpha {c.get('lora_alpha')}, targets "
                    f"{c.get('target_modules')}, base {c.get('base_model_name_or_path') or 'not named'})")
        except (ValueError, OSError, AttributeError):
            return " (PEFT adapter: adapter_config.json unreadable)"
    rec = recorded_lora(src.meta)
    if rec is None:
        return ""
    base = rec["base"].get("init_from") or f"the initial weights of seed {rec['base'].get('seed')}"
    return (f" (LoRA adapters alone: rank {rec['rank']}, alpha {rec['alpha']:g}, targets {list(rec['targets'])}; "
            f"base {base})")


def _base_problem(src) -> tuple[str | None, str | None]:
    """(the `base:` line, what is wrong with the base) of a LoRA run's checkpoint: its base model is there
    and holds the weights its adapters were trained on (lora_base: the recorded sha256); (None, None)
    for any other checkpoint."""
    from pathlib import Path

    from zerodp.convert.lora_base import base_sha256, cache_dir
    from zerodp.convert.lora_source import recorded_lora

    rec = recorded_lora(src.meta)
    if rec is None or not rec["base"].get("sha256"):
        return None, None
    base, recorded = rec["base"], rec["base"]["sha256"]
    init_from, seed = base.get("init_from"), int(base.get("seed") or 0)
    what = f"{init_from} (model.init_from)" if init_from else f"the initial weights of seed {seed}"
    if init_from and not Path(init_from).exists():
        problem = f"its base model {init_from} (model.init_from) is not here: the adapters have no model to run on"
        return f"base:        {what}: NOT HERE", problem
    found = base_sha256(init_from, (src.meta.get("config") or {}).get("model") or {}, seed, cache_dir())
    if found != recorded:
        problem = (f"the weights at {init_from} changed since its adapters were trained on them (sha256 {found[:12]} "
                   f"there, {recorded[:12]} recorded)" if init_from else
                   f"its base, {what}, is not the one recorded (sha256 {found[:12]}, {recorded[:12]} recorded)")
        return f"base:        {what}: CHANGED (sha256 {found[:12]}, {recorded[:12]} recorded)", problem
    return f"base:        {what}: the weights its adapters were trained on (sha256 {found[:12]})", None


def inspect_checkpoint(path) -> tuple[list[str], bool]:
    """The report's lines and whether the checkpoint is intact (opening failures become a report too)."""
    try:
        src = open_checkpoint(path)
    except CheckpointError as e:
        return [f"path:        {path}", f"integrity:   DAMAGED: {e}"], False
    with src:
        names = src.param_names()
        infos = [src.info(n) for n in names]
        numel = sum(i.numel for i in infos)
        dtypes = Counter(str(i.dtype).replace("torch.", "") for i in infos)
        files = src.files()
        size = sum(f.stat().st_size for f in files if f.is_file())
        problem = src.verify(deep=True)
        base_line, base_problem = _base_problem(src)
        kind = src.format + (f" ({src.layout} layout)" if hasattr(src, "layout") else "")
        if src.meta.get("hf_config"):
            kind += f" (Hugging Face model folder: {_model_line(src)})"
        kind += _lora_words(path, src)
        lines = [
            f"path:        {src.path}",
            f"format:      {kind}",
            f"strategy:    {src.meta.get('strategy', '-')}",
            f"world size:  {src.meta.get('world_size', '-')}",
            f"step:        {src.meta.get('step') if src.meta.get('step') is not None else '-'}",
            f"parameters:  {numel:,} in {len(names)} tensors",
            f"dtypes:      {', '.join(f'{d} ({c})' for d, c in sorted(dtypes.items()))}",
            f"tied:        {', '.join(f'{a} -> {s}' for a, s in src.tied().items()) or '-'}",
            f"optimizer:   {'exp_avg, exp_avg_sq, step' if 'exp_avg' in src.kinds() else 'none (weights only)'}",
            f"files:       {len(files)}, {_human(size)}",
        ]
        if base_line:
            lines.append(base_line)
        if problem is not None:
            lines.append(f"integrity:   DAMAGED: {problem}")
        elif base_problem is not None:
            lines.append(f"integrity:   every file present and intact, but {base_problem}")
        else:
            lines.append("integrity:   ok: every file present and intact")
    return lines, problem is None and base_problem is None
