"""Activation checkpointing (`model.activation_checkpointing`: off | selective | full; true and false are
full and off): the options `torch.utils.checkpoint.checkpoint` runs each block with.

full recomputes a block's whole forward in the backward pass: each block keeps only its input, for one
more forward of compute. selective (torchtitan's per-op policy) keeps the outputs of the matmuls and of
attention and recomputes the element-wise work between them (norms, rotary, activation, residual adds):
the FLOP-heavy ops run once, and the tensors recomputed are the cheap ones. docs/memory_model.md counts
what each keeps. Under train.compile the checkpoint wraps the compiled block, whose ops the policy does
not see: selective then recomputes the whole block, as full does (docs/strategies.md, "Compilation")."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from zerodp.models.chunking import checkpointing_mode

_aten = torch.ops.aten
SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(_aten, name)
)
"""The ops whose outputs selective checkpointing keeps: matmuls (nn.Linear dispatches to mm or addmm) and
SDPA's kernels (their output and log-sum-exp)."""


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    flex = getattr(torch._higher_order_ops, "flex_attention", None)
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS or (flex is not None and op is flex) \
        else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_options(mode: bool | str) -> dict | None:
    """The keyword arguments (beyond use_reentrant=False) of `checkpoint` for each block under `mode`, or
    None when blocks run without checkpointing (off)."""
    mode = checkpointing_mode(mode)
    if mode == "off":
        return None
    if mode == "full":
        return {}
    return {"context_fn": partial(create_selective_checkpoint_contexts, _policy)}
