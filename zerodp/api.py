"""A small Python API for notebooks and evaluation scripts.

    import zerodp
    model = zerodp.load_model("runs/llama-tiny")      # any checkpoint zerodp reads; eval mode
    logits = model(idx)                                # (B, T, vocab)

A LoRA run and a PEFT adapter folder open as `zerodp eval`, `generate` and `convert` open them: the base
their record names with the adapters beside it (zerodp.convert.lora_source.open_model).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerodp.errors import CheckpointError


def model_config_of(source):
    """The `ModelConfig` a checkpoint records: zerodp's meta.json (or the `zerodp.config` metadata of
    its safetensors exports), or a Hugging Face folder's config.json."""
    from zerodp.config import ModelConfig, from_dict, resolve_model

    model = (source.meta.get("config") or {}).get("model")
    if not model:
        hf = _hf_config_file(Path(source.path))
        if hf is not None:
            import json

            from zerodp.models.hf import model_config_from_hf

            model = model_config_from_hf(json.loads(hf.read_text()))
    if not model:
        raise CheckpointError(f"{source.path} records no model config (neither zerodp's meta.json nor a Hugging Face "
                              f"config.json beside it); pass config=ModelConfig(...) describing the model")
    keys = {f for f in ModelConfig.__dataclass_fields__}
    cfg = from_dict({"model": {k: v for k, v in model.items() if k in keys}}, f"{source.path}'s model config")
    return resolve_model(cfg).validate().model


def _hf_config_file(path: Path) -> Path | None:
    for folder in (path, path.parent):
        if (folder / "config.json").is_file():
            return folder / "config.json"
    return None


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               config=None) -> torch.nn.Module:
    """The model stored at `path`, in eval mode: a run folder, a step folder, a DeepSpeed or DCP folder,
    zerodp safetensors, a Hugging Face folder, or a LoRA run or PEFT adapter folder (its base with the
    adapters). Built on the meta device and filled tensor by tensor
    (never two copies of the weights); `dtype` casts it (default: fp32, as checkpoints store it).
    `config` (a `zerodp.config.ModelConfig`) describes the model where the checkpoint records none.
    `model(idx)` returns logits of shape (B, T, vocab); `model.generate(idx, n)` samples."""
    from zerodp.convert.lora_source import open_model

    with open_model(path) as source:
        return model_from_source(source, device, dtype, config)


def model_from_source(source, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                      config=None) -> torch.nn.Module:
    """`load_model` for a checkpoint already open (a zerodp.convert CheckpointSource)."""
    from zerodp.convert.full_state import FullState
    from zerodp.models import build_model

    cfg = config if config is not None else model_config_of(source)
    model = build_model(cfg, device="meta")
    model.to_empty(device=device)
    model.tie_weights()
    state = FullState(source, with_optimizer=False)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    problem = state.mismatch(shapes)
    if problem:
        raise CheckpointError(f"{source.path} does not hold the model its config describes: {problem}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state.get(name, "param", p.shape))
    if dtype is not None:
        model.to(dtype)
    return model.eval()
