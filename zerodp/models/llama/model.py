"""The Llama family's module (`model.arch: llama`: Llama 2/3, Mistral, Qwen2; spec.py beside it):
rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, optional q/k/v biases (Qwen2), tied or
untied head.

Parameter names and layouts are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, nn.Linear
(out, in), rotary embedding in the rotate-half convention), so HF weights load as they are. The rotary
frequencies are computed in the forward pass, not kept as a buffer: nothing to shard, save or
materialise."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # for annotations only: zerodp.config imports zerodp.models.hf, never the reverse
    from zerodp.config import ModelConfig

from zerodp.errors import ConfigError
from zerodp.models.arch import Arch, arch_of
from zerodp.models.common import DecoderLM, LayerKV, attend
from zerodp.models.docmask import attend_documents
from zerodp.models.dropout import KeyedDropout
from zerodp.models.loss import LMHead


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(a: Arch, device: torch.device) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) of the rotary embedding, with Llama 3.1's or linear scaling."""
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, device=device, dtype=torch.float32) / a.head_dim))
    s = a.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":  # transformers' _compute_llama3_parameters
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"model.rope_scaling rope_type {kind!r} is not supported; zerodp reads llama3 and linear")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def native_gqa(q: torch.Tensor) -> bool:
    """Whether SDPA takes the kv heads as they are (`enable_gqa=True`, no copy of k and v per query
    head) for queries like `q`: on the CPU (its flash kernel groups heads itself) and for 16-bit CUDA
    tensors, where the flash kernel does. torch's SDPA documents grouped-query support on CUDA for the
    flash and math kernels only, so fp32 CUDA queries (no flash kernel) would fall to the math kernel:
    there k and v are repeated instead, which keeps the memory-efficient kernel."""
    return q.device.type != "cuda" or q.dtype in (torch.float16, torch.bfloat16)


class Attention(nn.Module):
    def __init__(self, a: Arch, dropout: float):
        super().__init__()
        self.a = a
        self.attn_dropout = KeyedDropout(dropout)   # on the attention probabilities
        self.resid_dropout = KeyedDropout(dropout)  # on the output projection
        q, kv = a.n_head * a.head_dim, a.n_kv_head * a.head_dim
        self.q_proj = nn.Linear(a.n_embd, q, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.n_embd, kv, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.n_embd, kv, bias=a.qkv_bias)
        self.o_proj = nn.Linear(q, a.n_embd, bias=False)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, T, nh, hd) and k (B, T, nkv, hd) before the rotary embedding: as they are here (Qwen3
        normalises each head)."""
        return q, k

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None,
                mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        a = self.a
        q, k = self.norm_heads(self.q_proj(x).view(B, T, a.n_head, a.head_dim),
                               self.k_proj(x).view(B, T, a.n_kv_head, a.head_dim))
        q, k = q.transpose(1, 2), k.transpose(1, 2)                              # (B, nh, T, hd), (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, a.n_kv_head, a.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q = (q * cos + rotate_half(q) * sin).to(v.dtype)
        k = (k * cos + rotate_half(k) * sin).to(v.dtype)
        gqa = a.n_kv_head != a.n_head  # each kv head serves n_head / n_kv_head consecutive query heads
        if self.attn_dropout.active():  # grouped heads repeated, the probabilities computed and dropped
            y = self.attn_dropout.attend(q, k, v, mask)  # (B, nh, T, hd)
        elif mask is not None:  # a document mask (zerodp.models.docmask): it handles grouped heads itself
            y = attend_documents(q, k, v, mask, gqa)  # (B, nh, T, hd)
        else:
            if gqa and not native_gqa(q):
                k = k.repeat_interleave(a.n_head // a.n_kv_head, dim=1)  # (B, nh, T, hd)
                v = v.repeat_interleave(a.n_head // a.n_kv_head, dim=1)
            y = attend(q, k, v, kv, enable_gqa=gqa and native_gqa(q))  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, a.n_head * a.head_dim)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, a: Arch, dropout: float):
        super().__init__()
        self.drop = KeyedDropout(dropout)
        self.gate_proj = nn.Linear(a.n_embd, a.ffn, bias=False)
        self.up_proj = nn.Linear(a.n_embd, a.ffn, bias=False)
        self.down_proj = nn.Linear(a.ffn, a.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))  # SwiGLU


class Block(nn.Module):
    def __init__(self, a: Arch, dropout: float, attention: type[Attention] = Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(a.n_embd, a.norm_eps)
        self.self_attn = attention(a, dropout)
        self.post_attention_layernorm = RMSNorm(a.n_embd, a.norm_eps)
        self.mlp = MLP(a, dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None,
                mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(DecoderLM):
    RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight")
    ATTENTION: type[Attention] = Attention
    """The attention module of every block (a relative such as Qwen3 adds to it)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.arch = a = arch_of(cfg)
        rope_frequencies(a, torch.device("cpu"))  # an unsupported rope_scaling fails here, not at step 1
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(a.vocab_size, a.n_embd)
        self.model.layers = nn.ModuleList(Block(a, cfg.dropout, self.ATTENTION) for _ in range(a.n_layer))
        self.model.norm = RMSNorm(a.n_embd, a.norm_eps)
        self.lm_head = LMHead(a.n_embd, a.vocab_size, cfg.loss_chunks)
        if a.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: tuple | None = None

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks: the unit of activation checkpointing and of FSDP sharding."""
        return list(self.model.layers)

    def embed(self, idx: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings; the rotary cos and sin for positions start..start+T-1 (T, hd), or for
        `positions` (B, T) (documents: (B, 1, T, hd), broadcast over the heads)."""
        T = idx.shape[1]
        inv = rope_frequencies(self.arch, idx.device)
        if positions is None:
            positions = torch.arange(start, start + T, device=idx.device, dtype=torch.float32)
            freqs = torch.outer(positions, inv)  # (T, hd/2)
        else:
            freqs = (positions.to(torch.float32)[..., None] * inv)[:, None]  # (B, 1, T, hd/2): outer's products
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd) or (B, 1, T, hd)
        self._rope = (emb.cos(), emb.sin())
        return self.model.embed_tokens(idx)  # (B, T, C)

    def run_block(self, block: nn.Module, x: torch.Tensor, kv: LayerKV | None = None, mask=None) -> torch.Tensor:
        cos, sin = self._rope
        if mask is not None:  # a document mask (zerodp.models.docmask), never with a cache
            return block(x, cos, sin, None, mask)
        return block(x, cos, sin) if kv is None else block(x, cos, sin, kv)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (B, T, V), or with `targets` the summed cross-entropy (zerodp.models.loss)."""
        return self.lm_head(self.model.norm(x), targets)
