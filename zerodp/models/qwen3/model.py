"""Qwen3's module (`model.arch: qwen3`; spec.py beside it): zerodp's Llama whose attention normalises
each head's q and k with an RMSNorm of head_dim (`q_norm`, `k_norm`, as Hugging Face's Qwen3Attention)
before the rotary embedding. Names and layouts are Hugging Face's."""

from __future__ import annotations

import torch

from zerodp.models.llama.model import Attention, Llama, RMSNorm


class Qwen3Attention(Attention):
    def __init__(self, a, dropout: float):
        super().__init__(a, dropout)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # over hd, per head: (B, T, nh, hd), (B, T, nkv, hd)


class Qwen3(Llama):
    ATTENTION = Qwen3Attention
