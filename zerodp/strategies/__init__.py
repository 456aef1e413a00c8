"""Strategy registry: builds the strategies of the catalog (zerodp/strategies/catalog.py). Backends are
imported lazily: `single` and `ddp` never import deepspeed, and importing this package or the catalog
imports no torch (the interface, `RunContext` and `Strategy`, is loaded when first named).

Layer: above config, models, optim, convert (resharding on load) and distributed; the trainer
imports it, and nothing below but the catalog, which sits beside config.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from zerodp.errors import UserError
from zerodp.strategies.catalog import CATALOG

if TYPE_CHECKING:
    from zerodp.strategies.base import RunContext, Strategy


def make_strategy(name: str) -> Strategy:
    if name not in CATALOG:
        raise UserError(f"strategy {name!r} is not available; choose one of {' | '.join(CATALOG)}")
    spec = CATALOG[name]
    module, cls = spec.implementation.split(":")
    return getattr(importlib.import_module(module), cls)(**dict(spec.init))


def check_config(cfg, world_size: int, grad_accum_steps: int) -> None:
    """The configured strategy's own checks of its settings that need no process group (for
    `--dry-run`; setup runs the same checks). An optional ability: a strategy without one has none."""
    check = getattr(make_strategy(cfg.strategy.name), "check_config", None)
    if check is not None:
        check(cfg, world_size, grad_accum_steps)


def __getattr__(name: str):
    if name in ("RunContext", "Strategy"):  # the interface imports torch: only when it is asked for
        from zerodp.strategies import base
        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CATALOG", "RunContext", "Strategy", "check_config", "make_strategy"]
