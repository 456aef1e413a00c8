"""torch DistributedDataParallel: every rank holds everything; gradients are all-reduced.

Gradient accumulation uses DDP's `no_sync()` on all but the last micro batch, so gradients cross the
network once per optimizer step. Mixed precision is autocast over fp32 parameters: the fp32 weights are
the master weights, gradients are fp32 and reduced in fp32. With model.lora the frozen base is held in
train.precision's dtype (2 bytes a parameter in bf16/fp16: nothing updates it, so it needs no master
copy); DDP reduces the adapters' gradients only, AdamW keeps their moments only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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


class DDPStrategy:
    name = "ddp"
    layout = "canonical"
    gathers_in_forward = False

    def setup(self, model: nn.Module, ctx: RunContext) -> None:
        self.ctx = ctx
        hold_frozen(model, ctx.cfg.train.precision)  # LoRA's frozen base in 16 bits under bf16/fp16
        self.module = materialise(model, ctx.device, ctx.cfg.train.seed)
        self.model = DistributedDataParallel(
            self.module,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            bucket_cap_mb=ctx.cfg.strategy.bucket_size_mb,
            gradient_as_bucket_view=True,  # grads live in the buckets: no second full-size copy
        )
        if ctx.cfg.train.measure_comm:
            # The reducer's own all-reduces run in C++, out of zerodp.telemetry.comm's sight; the hook issues the
            # same ones from Python, so they are counted.
            self.model.register_comm_hook(None, _mean_allreduce)
        self.optimizer = adamw(param_groups(self.module, ctx.cfg), ctx.cfg, ctx.device.type)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.cfg.train.precision == "fp16")
        # Parameter hooks, not the comm hook: a bucket holds the micro batches' sum under no_sync, and the
        # hooks see each micro batch's gradient, the small batch every strategy measures (docs/grad_noise.md).
        self.local_norms = local_grad_norms(ctx, self.module.parameters())

    def micro_step(self, is_last: bool):
        # no_sync must cover forward and backward: DDP decides in forward whether to reduce.
        return contextlib.nullcontext() if is_last else self.model.no_sync()

    def autocast(self):
        return autocast_context(self.ctx.cfg.train.precision, self.ctx.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self.ctx.grad_accum_steps).backward()

    def local_grad_sq(self) -> torch.Tensor | None:
        """This step's mean over micro batches of the rank's own gradient norm squared (before the
        reduction; zerodp.telemetry.grad_noise), or None when not measured. Call before step()."""
        return self.local_norms.take(self.ctx.grad_accum_steps, grad_scale(self.scaler)) if self.local_norms else None

    def step(self, lr: float) -> torch.Tensor:
        return replicated_step(self.module, self.optimizer, self.scaler, lr, self.ctx.cfg.optim.grad_clip)

    def state_bytes(self) -> dict[str, int]:
        return replicated_state_bytes(self.module, self.optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float() for n, p in self.module.named_parameters()}

    def save(self, ckpt_dir: Path) -> None:
        # Replicas are identical: rank 0 writes the one copy.
        if dist.get_rank() == 0:
            save_replicated(self.module, self.optimizer, ckpt_dir, {"scaler": self.scaler.state_dict()})

    def snapshot(self, ckpt_dir: Path, buffers) -> Callable[[], None]:
        """A background save's host copy of what `save` writes (rank 0's), and the function writing it."""
        if dist.get_rank() != 0:
            return lambda: None
        state = replicated_state(self.module, self.optimizer, {"scaler": self.scaler.state_dict()}, buffers.copy)
        return lambda: write_replicated(ckpt_dir, state)

    def load(self, ckpt_dir: Path) -> None:
        extra = load_replicated(self.module, self.optimizer, ckpt_dir)
        if extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])

    def load_full(self, state: FullState) -> None:
        load_full_replicated(self.module, self.optimizer, state)


def _mean_allreduce(process_group, bucket):  # unannotated: DDP rejects the string annotations of this module
    """What DDP's reducer does without a hook, issued from Python: scale the bucket (a dist.GradBucket)
    by 1/N (the reducer multiplies each new gradient by 1/N as it copies it into the bucket, and
    zero_grad(set_to_none=True) makes every step's gradient new), then sum it over the ranks: the same
    bits (tests/distributed/test_equivalence.py). torch's stock allreduce_hook divides by N instead, which at N = 3
    differs in the last bit."""
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer().mul_(1.0 / group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
