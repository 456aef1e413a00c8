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
            f"integrity:   {'ok: every file present and intact' if problem is None else 'DAMAGED: ' + problem}",
        ]
    return lines, problem is None
