"""The model zoo: one decoder description (`Arch`, zerodp/models/arch.py) and one module per family.

    model = build_model(cfg.model)          # GPT (gpt2) or Llama (llama), per model.arch
    arch_of(cfg.model).param_shapes()       # names and shapes, without torch
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import importlib

if TYPE_CHECKING:  # for annotations only: zerodp.config imports zerodp.models.hf, never the reverse
    from zerodp.config import ModelConfig

from zerodp.models.arch import Arch, arch_of

# family -> (module, class). Imported on use: the planner reads zerodp.models.arch without torch.
FAMILY_MODULES = {"gpt2": ("zerodp.models.gpt2", "GPT"), "llama": ("zerodp.models.llama", "Llama")}


def __getattr__(name: str):
    for module, cls in FAMILY_MODULES.values():
        if name == cls:
            return getattr(importlib.import_module(module), cls)
    raise AttributeError(f"module 'zerodp.models' has no attribute {name!r}")


def build_model(cfg: ModelConfig):
    """The model `cfg.arch` names, initialised (or uninitialised, under `torch.device("meta")`)."""
    module, cls = FAMILY_MODULES[arch_of(cfg).family]
    return getattr(importlib.import_module(module), cls)(cfg)


def param_count(cfg: ModelConfig) -> int:
    """Exact parameter count from the config alone (a tied head counted once)."""
    return arch_of(cfg).param_count()


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token at sequence length block_size (zerodp.models.arch.Arch.flops_per_token)."""
    return arch_of(cfg).flops_per_token()


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape (a tied head listed once), from the description alone."""
    return arch_of(cfg).param_shapes()


__all__ = ["Arch", "GPT", "Llama", "arch_of", "build_model", "flops_per_token", "param_count", "param_shapes"]
