"""The config's checks that other layers share: the batch split (`zerodp train`, `zerodp plan --config`
and `strategy: auto`), the ZeRO++ refusal (validation and the ZeRO strategy), and the one-line errors
the schema's validation raises. Torch-free."""

from __future__ import annotations

import difflib
import typing

from zerodp.errors import ConfigError
from zerodp.strategies.catalog import CATALOG

if typing.TYPE_CHECKING:
    from zerodp.config.schema import StrategyConfig


def zeropp_settings(s: StrategyConfig) -> list[str]:
    """The ZeRO++ settings `s` turns on, as `strategy.key=value` (empty when none is)."""
    on = [f"strategy.hpz_partition_size={s.hpz_partition_size}"] if s.hpz_partition_size != 1 else []
    return on + [f"strategy.{key}=true" for key in ("quantized_weights", "quantized_gradients") if getattr(s, key)]


def zeropp_refusal(s: StrategyConfig, name: str) -> str | None:
    """Why strategy `name` cannot run the ZeRO++ settings of `s` (DeepSpeed has them for ZeRO-3 only),
    or None. `validate` asks, and zerodp.strategies.zero again for its stage. auto is refused too: the
    planner never chooses ZeRO++ (its quantisation changes the numerics), so the settings would be
    ignored whenever it chose another strategy."""
    on = zeropp_settings(s)
    if not on or (name in CATALOG and CATALOG[name].zeropp):
        return None
    which = "strategy.name=auto never chooses it" if name == "auto" else f"not {name}'s"
    return (f"{', '.join(on)}: ZeRO++ is DeepSpeed ZeRO-3's, {which}; set strategy.name=zero3 "
            f"or remove {'the settings' if len(on) > 1 else 'the setting'}")


def batch_split(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Gradient accumulation steps that make `global_batch_size` sequences out of micro batches of
    `micro_batch_size` on `world_size` ranks or, when they do not divide it, a ConfigError naming the
    world sizes that would. The one split `zerodp train`, `zerodp plan --config` and `strategy: auto` use."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        ok = [w for w in range(1, 65) if global_batch_size % (micro_batch_size * w) == 0]
        where = f", or run on one of {ok[:8]} processes" if ok else " (no process count up to 64 divides it)"
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} is not divisible by "
            f"train.micro_batch_size={micro_batch_size} x world_size={world_size} = {per_step}; "
            f"change micro_batch_size or global_batch_size{where}"
        )
    return global_batch_size // per_step


def _positive(key: str, value, hint: str = "") -> None:
    if not value > 0:
        raise ConfigError(f"{key}={value} must be positive" + (f" ({hint})" if hint else ""))


def _non_negative(key: str, value, hint: str = "") -> None:
    if value < 0:
        raise ConfigError(f"{key}={value} must not be negative" + (f" ({hint})" if hint else ""))


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        # FSDP, Zero3: the same name in another case first, then a near spelling
        same = [a for a in allowed if str(a).lower() == str(value).lower()]
        close = same or difflib.get_close_matches(str(value), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {' | '.join(allowed)}{hint}")


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))
