"""Strategy registry. Backends are imported lazily: `single` and `ddp` never import deepspeed.

Layer: above config, models, optim, convert (resharding on load) and distributed; the trainer
imports it, and nothing below.
"""

from __future__ import annotations

import importlib

from zerodp.errors import UserError
from zerodp.strategies.base import RunContext, Strategy

# name -> (module, class, constructor kwargs)
_REGISTRY = {
    "single": ("zerodp.strategies.single", "SingleStrategy", {}),
    "ddp": ("zerodp.strategies.ddp", "DDPStrategy", {}),
    "zero1": ("zerodp.strategies.zero", "ZeroStrategy", {"stage": 1}),
    "zero2": ("zerodp.strategies.zero", "ZeroStrategy", {"stage": 2}),
    "zero3": ("zerodp.strategies.zero", "ZeroStrategy", {"stage": 3}),
    "fsdp": ("zerodp.strategies.fsdp", "FSDPStrategy", {}),
}


def make_strategy(name: str) -> Strategy:
    if name not in _REGISTRY:
        raise UserError(f"strategy {name!r} is not available; choose one of {' | '.join(_REGISTRY)}")
    module, cls, kwargs = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


def check_config(cfg, world_size: int, grad_accum_steps: int) -> None:
    """The configured strategy's own checks of its settings that need no process group (for
    `--dry-run`; setup runs the same checks). An optional ability: a strategy without one has none."""
    check = getattr(make_strategy(cfg.strategy.name), "check_config", None)
    if check is not None:
        check(cfg, world_size, grad_accum_steps)


__all__ = ["RunContext", "Strategy", "check_config", "make_strategy"]
