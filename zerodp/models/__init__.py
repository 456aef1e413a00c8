"""The model zoo: one decoder description (`Arch`, zerodp/models/arch.py) and one module per family.

    model = build_model(cfg.model, seed)            # GPT (gpt2) or Llama (llama), per model.arch
    meta = build_model(cfg.model, device="meta")    # no memory: what the strategies materialise
    arch_of(cfg.model).param_shapes()               # names and shapes, without torch

A family's constructor only declares modules; it never initialises (torch's own per-module init would
draw every weight on every rank). Initial values come from `DecoderLM.initial_values(name, seed)`.

Layer: above errors only (the specs are torch-free; the modules import torch); config, convert, the
planner, strategies and the trainer import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import importlib

if TYPE_CHECKING:  # for annotations only: zerodp.config imports zerodp.models.hf, never the reverse
    import torch

    from zerodp.config import ModelConfig

from zerodp.models.arch import Arch, arch_of

# family -> (module, class). Imported on use: the planner reads zerodp.models.arch without torch.
FAMILY_MODULES = {"gpt2": ("zerodp.models.gpt2", "GPT"), "llama": ("zerodp.models.llama", "Llama")}


def __getattr__(name: str):
    for module, cls in FAMILY_MODULES.values():
        if name == cls:
            return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module 'zerodp.models' has no attribute {name!r}")


def construct(cfg: ModelConfig):
    """The module `cfg.arch` names, as its constructor leaves it: on torch's current default device
    (nothing allocated under `torch.device("meta")`; partitioned as created under `deepspeed.zero.Init`),
    its values not yet the model's initial weights."""
    module, cls = FAMILY_MODULES[arch_of(cfg).family]
    return getattr(importlib.import_module(module), cls)(cfg)


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device | None = None):
    """The model `cfg.arch` names with its initial weights for `seed` (train.seed) on `device` (default:
    torch's default device), or on the meta device without memory or values. Built on the meta device
    first: no throw-away init."""
    import torch

    device = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        model = construct(cfg)
    if device.type == "meta":
        return model
    return materialise(model, device, seed)


def materialise(model, device, seed: int, dtype=None):
    """A model built on the meta device made real on `device` (in `dtype` if given: zero1/zero2 keep
    their working copy in 16 bits), every parameter filled with its initial values for `seed`: how the
    strategies that hold the whole model (single, ddp, zero1, zero2) build it, instead of building it on
    the CPU and moving it. One parameter's fp32 values at a time exist in host memory."""
    if dtype is not None:
        model.to(dtype)  # on the meta device: no memory, no values
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def compile_blocks(model) -> int:
    """torch.compile each transformer block of `model` (or of the model a DDP wrapper or DeepSpeed engine
    holds) in place, as torchtitan does: `Module.compile` keeps every parameter's name and every hook
    the strategy registered (FSDP2's gather and reshard, DeepSpeed ZeRO-3's fetches run eagerly around
    the compiled code), so checkpoints and the strategies do not change. Returns the blocks compiled."""
    core = model
    while not hasattr(core, "blocks") and hasattr(core, "module"):
        core = core.module
    blocks = core.blocks()
    for block in blocks:
        block.compile()
    return len(blocks)


def param_count(cfg: ModelConfig) -> int:
    """Exact parameter count from the config alone (a tied head counted once)."""
    return arch_of(cfg).param_count()


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token at sequence length block_size (zerodp.models.arch.Arch.flops_per_token)."""
    return arch_of(cfg).flops_per_token()


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape (a tied head listed once), from the description alone."""
    return arch_of(cfg).param_shapes()


__all__ = ["Arch", "GPT", "Llama", "arch_of", "build_model", "compile_blocks", "construct", "materialise", "flops_per_token", "param_count", "param_shapes"]
