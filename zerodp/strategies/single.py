"""One process, no communication: the reference every other strategy must match."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from zerodp.optim import adamw_kwargs, param_groups
from zerodp.strategies.base import RunContext
from zerodp.strategies.common import (FullState, autocast_context, load_full_replicated, load_replicated,
                                      optimizer_state_tensors, save_replicated, set_lr, tensor_bytes)


class SingleStrategy:
    name = "single"

    def setup(self, model: nn.Module, ctx: RunContext) -> None:
        self.ctx = ctx
        self.model = model.to(ctx.device)
        self.optimizer = torch.optim.AdamW(param_groups(model, ctx.cfg), **adamw_kwargs(ctx.cfg))
        # fp16 needs dynamic loss scaling; bf16 and fp32 do not (scaler disabled = identity).
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.cfg.train.precision == "fp16")

    def micro_step(self, is_last: bool):
        return contextlib.nullcontext()

    def autocast(self):
        return autocast_context(self.ctx.cfg.train.precision, self.ctx.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self.ctx.grad_accum_steps).backward()

    def step(self, lr: float) -> float:
        set_lr(self.optimizer, lr)
        self.scaler.unscale_(self.optimizer)
        clip = self.ctx.cfg.optim.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def state_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {
            "params": tensor_bytes(params),
            "grads": tensor_bytes(p.grad for p in params),
            "optim": tensor_bytes(optimizer_state_tensors(self.optimizer)),
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float() for n, p in self.model.named_parameters()}

    def save(self, ckpt_dir: Path) -> None:
        save_replicated(self.model, self.optimizer, ckpt_dir, {"scaler": self.scaler.state_dict()})

    def load(self, ckpt_dir: Path) -> None:
        extra = load_replicated(self.model, self.optimizer, ckpt_dir)
        if extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])

    def load_full(self, state: FullState) -> None:
        load_full_replicated(self.model, self.optimizer, state)
