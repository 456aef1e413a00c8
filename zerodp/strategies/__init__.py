"""Strategy registry. Backends are imported lazily: `single` and `ddp` never import deepspeed."""

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


__all__ = ["RunContext", "Strategy", "make_strategy"]
