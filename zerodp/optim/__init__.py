"""AdamW parameter groups and the learning-rate schedules (zerodp.optim.schedules), shared by every strategy.

Weight decay applies to matrices (Linear weights) only. Biases and LayerNorm parameters are never
decayed, and neither is the token/position embedding: decaying it pulls rare tokens' rows towards zero,
and GPT-2's tied embedding doubles as the output layer (the choice of nanoGPT's successors and Llama
recipes alike). With tied embeddings the shared tensor appears once.

On CUDA AdamW runs torch's fused kernel (`fused_adamw`): one kernel per parameter group and dtype for
the whole update, instead of the foreach path's several passes over the parameters and moments; on the
CPU (and for parameters offloaded to host memory) the default foreach/for-loop path. The fused step
keeps `state["step"]` on the parameter's device (`adam_step` builds it where AdamW would) and takes
GradScaler's found-inf flag into the kernel, so an fp16 step that overflowed is skipped without a host
sync.

Layer: above config; strategies import it. Torch is imported inside the functions that build tensors, so
that the schedules import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodp.config import Config
from zerodp.optim.schedules import lr_at

if TYPE_CHECKING:
    import torch
    from torch import nn


def param_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """Two AdamW groups: decayed matrices and everything else, each in a stable (name) order."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # named_parameters() yields a tied tensor once
        if not p.requires_grad:
            continue
        is_embedding = name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
        shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 parameter's own data is empty: its shape is ds_shape
        (decay if len(shape) >= 2 and not is_embedding else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": cfg.optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def adamw_kwargs(cfg: Config) -> dict:
    """AdamW hyper-parameters (lr is set by the loop at every step)."""
    o = cfg.optim
    return {"lr": lr_at(cfg, 0), "betas": (o.beta1, o.beta2), "eps": o.eps}


def fused_adamw(device_type: str) -> bool:
    """Whether AdamW over parameters on a `device_type` device uses torch's fused kernel: on CUDA only.
    torch also has a fused CPU kernel; zerodp keeps the CPU on the default path it is tested against."""
    return device_type == "cuda"


def adamw(groups: list[dict], cfg: Config, device_type: str) -> torch.optim.AdamW:
    """torch's AdamW over `groups` (param_groups) with the run's hyper-parameters, fused where the
    parameters are CUDA tensors (`device_type`: where they live, the host for offloaded ones)."""
    import torch

    return torch.optim.AdamW(groups, **adamw_kwargs(cfg), fused=fused_adamw(device_type))


def adam_step(optimizer: torch.optim.Optimizer, param: torch.Tensor, step: float) -> torch.Tensor:
    """AdamW's state["step"] for `param`, placed as AdamW itself places it (torch/optim/adam.py: a float32
    0-d tensor on the CPU, on the parameter's device when its group is fused or capturable): for
    optimizer state written directly on load."""
    import torch

    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if on_device else "cpu")
