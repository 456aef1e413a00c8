"""GPT-2's module (`model.arch: gpt2`; spec.py beside it): learned positions, LayerNorm, GELU MLP, fused
c_attn, tied head.

With GPT-2's dimensions (12 layers, 12 heads, 768 wide, vocab 50257, context 1024, biases, tied
embeddings) it has exactly GPT-2's 124,439,808 parameters. The model never knows which strategy runs
it: strategies wrap it from outside (DDP, DeepSpeed engine, fully_shard per `model.blocks()`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # for annotations only: zerodp.config imports zerodp.models.hf, never the reverse
    from zerodp.config import ModelConfig

from zerodp.models.arch import arch_of
from zerodp.models.common import DecoderLM, LayerKV, attend
from zerodp.models.docmask import attend_documents
from zerodp.models.dropout import KeyedDropout
from zerodp.models.loss import LMHead


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = arch_of(cfg)
        self.n_head = a.n_head
        self.c_attn = nn.Linear(a.n_embd, 3 * a.n_embd, bias=a.bias)
        self.c_proj = nn.Linear(a.n_embd, a.n_embd, bias=a.bias)
        self.attn_dropout = KeyedDropout(cfg.dropout)   # on the attention probabilities
        self.resid_dropout = KeyedDropout(cfg.dropout)  # on the output projection

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None, mask=None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.attn_dropout.active():
            y = self.attn_dropout.attend(q, k, v, mask)  # (B, nh, T, hs)
        else:
            y = attend(q, k, v, kv) if mask is None else attend_documents(q, k, v, mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = arch_of(cfg)
        self.c_fc = nn.Linear(a.n_embd, a.ffn, bias=a.bias)
        self.c_proj = nn.Linear(a.ffn, a.n_embd, bias=a.bias)
        self.drop = KeyedDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        a = arch_of(cfg)
        self.ln_1 = nn.LayerNorm(a.n_embd, eps=a.norm_eps, bias=a.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(a.n_embd, eps=a.norm_eps, bias=a.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None, mask=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv, mask)
        return x + self.mlp(self.ln_2(x))


class GPT(DecoderLM):
    RESIDUAL_PROJECTIONS = ("c_proj.weight",)  # attn.c_proj and mlp.c_proj

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.arch = a = arch_of(cfg)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(a.vocab_size, a.n_embd),
                wpe=nn.Embedding(a.block_size, a.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(a.n_layer)),
                ln_f=nn.LayerNorm(a.n_embd, eps=a.norm_eps, bias=a.bias),
            )
        )
        self.lm_head = LMHead(a.n_embd, a.vocab_size, cfg.loss_chunks)
        if a.tied:
            self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks: the unit of activation checkpointing and of FSDP sharding."""
        return list(self.transformer.h)

    def embed(self, idx: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embeddings; positions start..start+T-1, or `positions` (B, T) (documents)."""
        pos = torch.arange(start, start + idx.shape[1], device=idx.device) if positions is None else positions
        return self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)

    def run_block(self, block: nn.Module, x: torch.Tensor, kv: LayerKV | None = None, mask=None) -> torch.Tensor:
        if mask is not None:  # a document mask (zerodp.models.docmask), never with a cache
            return block(x, None, mask)
        return block(x) if kv is None else block(x, kv)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (B, T, V), or with `targets` the summed cross-entropy (zerodp.models.loss)."""
        return self.lm_head(self.transformer.ln_f(x), targets)
