"""The learning-rate schedules, by name (optim.schedule): each a function (cfg, step) -> lr.

Every schedule warms up linearly to optim.lr over optim.warmup_steps steps and reaches optim.min_lr
`decay_steps` steps later (optim.decay_steps, default train.max_steps - warmup_steps), where it stays:

- cosine: half a cosine from lr down to min_lr (GPT-2's and Llama's recipe; the default);
- linear: a straight line from lr down to min_lr;
- wsd, warmup-stable-decay (MiniCPM; torchtitan's `warmup_stable_decay`): lr held constant, then a
  decay to min_lr over the last optim.decay_fraction of the warmup_steps + decay_steps steps (never
  before the warmup ends), linear or 1-sqrt (lr - (lr - min_lr) * sqrt(progress): most of the fall
  comes early in the decay). The stable phase is what lets a run be extended, or a branch decayed
  from any checkpoint of it.

A schedule is a pure function of the config and the step index, like the batches: a run resumed at
another world size or under another strategy continues on the same curve (and at another
train.max_steps too, where optim.decay_steps is set). The trainer's loop sets the lr of step k to
`lr_at(cfg, k)` before the optimizer step; the planner does not read the schedule.

A new schedule is a function here and its name in zerodp.config's SCHEDULES (which validation
reads; this module imports no torch and asserts it has a function for every name there).

Layer: optim (above config).
"""

from __future__ import annotations

import math
from typing import Callable

from zerodp.config import SCHEDULES, Config


def lr_at(cfg: Config, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based) under cfg.optim.schedule."""
    return REGISTRY[cfg.optim.schedule](cfg, step)


def lr_scale(cfg: Config) -> float:
    """optim.scale_lr_with_batch's factor on lr and min_lr: global_batch_size / base_batch_size, or 1."""
    o = cfg.optim
    return cfg.train.global_batch_size / o.base_batch_size if o.scale_lr_with_batch else 1.0


def cosine(cfg: Config, step: int) -> float:
    """Linear warmup, then half a cosine from lr to min_lr over decay_steps."""
    lr, min_lr = _peak_and_floor(cfg)
    if step < cfg.optim.warmup_steps:
        return _warmup(cfg, step, lr)
    progress = _decay_progress(step, cfg.optim.warmup_steps, _decay_steps(cfg))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def linear(cfg: Config, step: int) -> float:
    """Linear warmup, then a straight line from lr to min_lr over decay_steps."""
    lr, min_lr = _peak_and_floor(cfg)
    if step < cfg.optim.warmup_steps:
        return _warmup(cfg, step, lr)
    progress = _decay_progress(step, cfg.optim.warmup_steps, _decay_steps(cfg))
    return min_lr + (1.0 - progress) * (lr - min_lr)


def wsd(cfg: Config, step: int) -> float:
    """Linear warmup, lr held, then the decay over the last decay_fraction of the steps (linear or 1-sqrt)."""
    o = cfg.optim
    lr, min_lr = _peak_and_floor(cfg)
    if step < o.warmup_steps:
        return _warmup(cfg, step, lr)
    start, length = wsd_decay(cfg)
    if step < start:
        return lr
    progress = _decay_progress(step, start, length)
    fall = progress if o.decay_shape == "linear" else math.sqrt(progress)
    return min_lr + (1.0 - fall) * (lr - min_lr)


def wsd_decay(cfg: Config) -> tuple[int, int]:
    """(first step, steps) of wsd's decay: the last round(decay_fraction x total) of the schedule's total
    warmup_steps + decay_steps steps, at least one, starting no earlier than the warmup's end."""
    o = cfg.optim
    total = o.warmup_steps + _decay_steps(cfg)
    start = max(o.warmup_steps, total - max(1, round(o.decay_fraction * total)))
    return start, total - start


REGISTRY: dict[str, Callable[[Config, int], float]] = {"cosine": cosine, "linear": linear, "wsd": wsd}
"""optim.schedule -> its function."""
assert tuple(REGISTRY) == SCHEDULES, f"zerodp.config.SCHEDULES {SCHEDULES} and the schedules {tuple(REGISTRY)} differ"


def _peak_and_floor(cfg: Config) -> tuple[float, float]:
    scale = lr_scale(cfg)
    return cfg.optim.lr * scale, cfg.optim.min_lr * scale


def _warmup(cfg: Config, step: int, lr: float) -> float:
    return lr * (step + 1) / cfg.optim.warmup_steps


def _decay_steps(cfg: Config) -> int:
    o = cfg.optim
    return o.decay_steps if o.decay_steps is not None else max(1, cfg.train.max_steps - o.warmup_steps)


def _decay_progress(step: int, start: int, length: int) -> float:
    """How far step is into a decay of `length` steps from `start`: 0 at its first step, 1 from its end on."""
    return min(1.0, (step - start) / length)
