"""One process, no communication: the reference every other strategy must match."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from zerodp.models import materialise
from zerodp.optim import adamw, param_groups
from zerodp.strategies.base import RunContext
from zerodp.strategies.common import (
    FullState,
    autocast_context,
    grad_scale,
    hold_frozen,
    load_full_replicated,
    load_replicated,
    local_grad_norms,
    replicated_state,
    replicated_state_bytes,
    replicated_step,
    save_replicated,
    write_replicated,
)


class SingleStrategy:
    name = "single"
    layout = "canonical"
    gathers_in_forward = False

    def setup(self, model: nn.Module, ctx: RunContext) -> None:
        self.ctx = ctx
        hold_frozen(model, ctx.cfg.train.precision)  # LoRA's frozen base in 16 bits under bf16/fp16
        self.model = materialise(model, ctx.device, ctx.cfg.train.seed)
        self.optimizer = adamw(param_groups(self.model, ctx.cfg), ctx.cfg, ctx.device.type)
        # fp16 needs dynamic loss scaling; bf16 and fp32 do not (scaler disabled = identity).
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.cfg.train.precision == "fp16")
        self.local_norms = local_grad_norms(ctx, self.model.parameters())  # one process: micro batch vs global

    def micro_step(self, is_last: bool):
        return contextlib.nullcontext()

    def autocast(self):
        return autocast_context(self.ctx.cfg.train.precision, self.ctx.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self.ctx.grad_accum_steps).backward()

    def local_grad_sq(self) -> torch.Tensor | None:
        """This step's mean over micro batches of the rank's own gradient norm squared (before the
        reduction; zerodp.telemetry.grad_noise), or None when not measured. Call before step()."""
        return self.local_norms.take(self.ctx.grad_accum_steps, grad_scale(self.scaler)) if self.local_norms else None

    def step(self, lr: float) -> torch.Tensor:
        return replicated_step(self.model, self.optimizer, self.scaler, lr, self.ctx.cfg.optim.grad_clip)

    def state_bytes(self) -> dict[str, int]:
        return replicated_state_bytes(self.model, self.optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float() for n, p in self.model.named_parameters()}

    def save(self, ckpt_dir: Path) -> None:
        save_replicated(self.model, self.optimizer, ckpt_dir, {"scaler": self.scaler.state_dict()})

    def snapshot(self, ckpt_dir: Path, buffers) -> Callable[[], None]:
        """A background save's host copy of what `save` writes, and the function writing it."""
        state = replicated_state(self.model, self.optimizer, {"scaler": self.scaler.state_dict()}, buffers.copy)
        return lambda: write_replicated(ckpt_dir, state)

    def load(self, ckpt_dir: Path) -> None:
        extra = load_replicated(self.model, self.optimizer, ckpt_dir)
        if extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])

    def load_full(self, state: FullState) -> None:
        load_full_replicated(self.model, self.optimizer, state)
