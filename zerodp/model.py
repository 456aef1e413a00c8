"""A GPT-2-style decoder in one file.

With GPT-2's dimensions (12 layers, 12 heads, 768 wide, vocab 50257, context 1024, biases, tied
embeddings) it has exactly GPT-2's 124,439,808 parameters. The model never knows which strategy runs
it: strategies wrap it from outside (DDP, DeepSpeed engine, fully_shard per `model.blocks()`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerodp.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return F.dropout(self.c_proj(y), drop, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return F.dropout(x, self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        if self.transformer.wte.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.cfg.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weight
                nn.init.ones_(p)

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks: the unit of activation checkpointing and of FSDP sharding."""
        return list(self.transformer.h)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return the mean cross-entropy over all tokens if targets are given, else the logits."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for block in self.transformer.h:
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, top_k: int = 50) -> torch.Tensor:
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :].float() / temperature  # (B, V)
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


def param_count(cfg: ModelConfig) -> int:
    """Exact parameter count from the config alone (tied embeddings counted once)."""
    h, V, T, L = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    b = 1 if cfg.bias else 0
    ln = h + b * h
    block = 2 * ln + (h * 3 * h + b * 3 * h) + (h * h + b * h) + (h * 4 * h + b * 4 * h) + (4 * h * h + b * h)
    return V * h + T * h + L * block + ln


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token: 6 per non-embedding parameter plus attention (PaLM appendix B)."""
    non_embedding = param_count(cfg) - cfg.vocab_size * cfg.n_embd - cfg.block_size * cfg.n_embd
    lm_head = cfg.vocab_size * cfg.n_embd
    attention = cfg.n_layer * cfg.block_size * cfg.n_embd  # QK^T and AV per token, forward
    return 6 * (non_embedding + lm_head) + 12 * attention


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, from a model built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = GPT(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}
