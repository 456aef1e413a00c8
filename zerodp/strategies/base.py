"""The strategy interface: the whole surface the training loop uses.

A strategy decides where parameters, gradients and optimizer state live and how gradients are
reduced; it never changes the gradient. The loop calls, per optimizer step:

    for i in range(grad_accum_steps):
        with strategy.micro_step(is_last=i == grad_accum_steps - 1):   # no_sync / boundary
            with strategy.autocast():
                loss = strategy.model(x, y)                                # micro-batch mean
            strategy.backward(loss)                                        # scales by 1/grad_accum
    grad_norm = strategy.step(lr)                                          # clip, step, zero grads

Each backend lives in its own file and implements this Protocol; none inherits from another.
Shared helpers are plain functions in `zerodp/strategies/common.py`.

Optional abilities, looked up with getattr where they are used (a strategy without one needs none):
    check_config(cfg, world_size, grad_accum_steps)   refuse bad settings without a process group
                                                       (`zerodp train --dry-run`; setup checks the same)
    resume_at(step)                                   an engine that counts steps itself (DeepSpeed)
                                                       continues from zerodp's step after a resume
    local_grad_sq() -> Tensor | None                  after the backward passes, before step(): the mean
                                                       over the step's micro batches of this rank's own
                                                       micro-batch gradient norm squared, taken before any
                                                       reduction and unscaled (0-d, on ctx.device; None
                                                       when not measured): the small batch of the gradient
                                                       noise scale (docs/grad_noise.md)
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from zerodp.config import Config

if TYPE_CHECKING:
    from zerodp.strategies.common import FullState


@dataclass
class RunContext:
    """What a strategy needs to know about the job it runs in."""

    cfg: Config
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    grad_accum_steps: int
    local_world_size: int = 1
    """Ranks on this node (the shard group of FSDP's hybrid sharding by default)."""


class Strategy(Protocol):
    name: str
    layout: str
    """What `save` writes: "canonical" (full fp32 tensors by name, any topology reads it), "deepspeed"
    or "dcp"; recorded in meta.json."""
    gathers_in_forward: bool
    """True where the forward pass all-gathers sharded parameters (zero3, fsdp): then every rank's
    forward lasts as long as the slowest rank's, and stragglers are found with a device probe."""
    model: nn.Module
    """The module the loop calls: `loss = strategy.model(x, y)`; wrapped (DDP, engine, FSDP) as needed."""

    def setup(self, model: nn.Module, ctx: RunContext) -> None:
        """`model` is on the meta device (no storage): materialise only what this rank keeps, on its
        device, filled from `model.initial_values(name, ctx.cfg.train.seed, start, stop)` for the
        elements it holds (frozen parameters, a LoRA run's base, in train.precision's dtype:
        zerodp.strategies.common.hold_frozen); wrap it; build AdamW over `zerodp.optim.param_groups(model, cfg)`."""

    def micro_step(self, is_last: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward and backward; gradients are reduced only when is_last."""

    def autocast(self) -> AbstractContextManager:
        """Context for the forward pass (mixed precision where the strategy computes in 16 bits)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch mean loss, scaled by 1/grad_accum_steps (and the loss scale)."""

    def step(self, lr: float) -> torch.Tensor | float:
        """Set lr, clip to optim.grad_clip, take the optimizer step, zero the gradients.

        Returns the global gradient L2 norm before clipping (identical on every rank): a 0-d tensor on
        ctx.device (wherever the gradients live: the loop stacks it with the loss and local_grad_sq,
        which are there too), so the step never waits for the device (DeepSpeed's ZeRO and BF16
        optimizers keep theirs as a tensor too); a float only where the engine holds a Python number
        (DeepSpeed's inf after a skipped step, nan where it computed none)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, counted from live tensors: keys 'params' (a LoRA run's frozen base
        in the dtype it is held in), 'grads' (the trained parameters'), 'optim'."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full fp32 model weights (by the model's own parameter names) on every rank."""

    def save(self, ckpt_dir: Path) -> None:
        """Collective: write this rank's model and optimizer state files into ckpt_dir."""

    def load(self, ckpt_dir: Path) -> None:
        """Collective: restore model and optimizer state saved by `save` at the same world size."""

    def load_full(self, state: "FullState") -> None:
        """Start from full fp32 tensors by parameter name, as read from any checkpoint by zerodp.convert:
        what makes checkpoints move between strategies and world sizes. Every rank keeps only its own
        part. Copies every parameter the state holds, frozen or not (a LoRA run's base, cast to the dtype
        it is held in); with LoRA a parameter the state lacks keeps its value (its checkpoints hold no
        base, a base model's weights no adapters: zerodp.strategies.common.loaded_params); AdamW moments
        and step, when `state.with_optimizer`, for the trained parameters only."""
