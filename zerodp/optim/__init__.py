"""AdamW parameter groups and the learning-rate schedules (zerodp.optim.schedules), shared by every strategy.

Weight decay applies to matrices (Linear weights) only. Biases and LayerNorm parameters are never
decayed, and neither is the token/position embedding: decaying it pulls rare tokens' rows towards zero,
and GPT-2's tied embedding doubles as the output layer (the choice of nanoGPT's successors and Llama
recipes alike). With tied embeddings the shared tensor appears once.

Layer: above config; strategies import it. Torch appears in annotations only, so that the schedules
import without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodp.config import Config
from zerodp.optim.schedules import lr_at

if TYPE_CHECKING:
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
