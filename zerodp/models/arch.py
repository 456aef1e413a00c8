"""An architecture as data: every parameter's name and shape, the parameter count and the FLOPs per
token, derived from one description (`Arch`). The model code builds exactly these parameters (a test
pins it), the planner counts them, and the Hugging Face mapping (zerodp/models/hf.py) names them.

Imports neither torch nor deepspeed: the planner reads it instantly.

Two families:
- `gpt2`: learned positions, LayerNorm, GELU MLP (4h), one fused c_attn, biases iff `bias`, tied head.
- `llama` (Llama 2/3, Mistral, Qwen2): rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention
  (`n_kv_head`), q/k/v biases iff `qkv_bias` (Qwen2), tied or untied head. Names are Hugging Face's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FAMILIES = ("gpt2", "llama")


@dataclass(frozen=True)
class Arch:
    family: str
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn: int
    """Width of the MLP's inner layer."""
    vocab_size: int
    block_size: int
    """Context length: the learned position table's size (gpt2), the longest sequence trained (llama)."""
    bias: bool
    """gpt2: biases in every Linear and LayerNorm."""
    qkv_bias: bool
    """llama family: biases on the q, k and v projections (Qwen2)."""
    tied: bool
    """The output head shares the token embedding's weight."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)

    # -- names and shapes ----------------------------------------------------------------------------

    @property
    def embedding(self) -> str:
        return "transformer.wte.weight" if self.family == "gpt2" else "model.embed_tokens.weight"

    @property
    def block_prefix(self) -> str:
        return "transformer.h" if self.family == "gpt2" else "model.layers"

    def tied_weights(self) -> dict[str, str]:
        """alias -> stored name, for weights shared by two modules (the tied head)."""
        return {"lm_head.weight": self.embedding} if self.tied else {}

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """One block's parameters, by their names inside the block."""
        h, f, q, kv = self.n_embd, self.ffn, self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        if self.family == "gpt2":
            out = {"ln_1.weight": (h,), "attn.c_attn.weight": (3 * h, h), "attn.c_proj.weight": (h, h),
                   "ln_2.weight": (h,), "mlp.c_fc.weight": (f, h), "mlp.c_proj.weight": (h, f)}
            if self.bias:
                out.update({"ln_1.bias": (h,), "attn.c_attn.bias": (3 * h,), "attn.c_proj.bias": (h,),
                            "ln_2.bias": (h,), "mlp.c_fc.bias": (f,), "mlp.c_proj.bias": (h,)})
            return dict(sorted(out.items()))
        out = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
               "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
               "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h),
               "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
        if self.qkv_bias:
            out.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
        return dict(sorted(out.items()))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainable parameter's name and shape, a tied head listed once (under the embedding)."""
        h = self.n_embd
        out = {self.embedding: (self.vocab_size, h)}
        if self.family == "gpt2":
            out["transformer.wpe.weight"] = (self.block_size, h)
        for i in range(self.n_layer):
            out.update({f"{self.block_prefix}.{i}.{k}": s for k, s in self.block_shapes().items()})
        if self.family == "gpt2":
            out["transformer.ln_f.weight"] = (h,)
            if self.bias:
                out["transformer.ln_f.bias"] = (h,)
        else:
            out["model.norm.weight"] = (h,)
        if not self.tied:
            out["lm_head.weight"] = (self.vocab_size, h)
        return out

    # -- counts ----------------------------------------------------------------------------------------

    def param_count(self) -> int:
        """Trainable parameters, a tied head counted once."""
        return sum(math.prod(s) for s in self.param_shapes().values())

    def block_params(self) -> int:
        return sum(math.prod(s) for s in self.block_shapes().values())

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6 per parameter that multiplies (all of them but the position table
        and an untied token embedding, which are lookups; a tied one is also the head) plus attention's
        QK^T and AV, 12 * L * s * (n_head * head_dim) (PaLM, appendix B)."""
        s = seq_len or self.block_size
        lookups = (self.block_size * self.n_embd if self.family == "gpt2" else 0) \
            + (0 if self.tied else self.vocab_size * self.n_embd)
        return 6 * (self.param_count() - lookups) + 12 * self.n_layer * s * self.n_head * self.head_dim


def default_ffn(family: str, n_embd: int) -> int:
    """gpt2: 4h. llama: Llama's own rule, 2/3 of 4h rounded up to a multiple of 256."""
    if family == "gpt2":
        return 4 * n_embd
    return 256 * math.ceil(int(8 * n_embd / 3) / 256)


def arch_of(model_cfg) -> Arch:
    """The Arch of a `zerodp.config.ModelConfig` section (keys left null take the family's default,
    as `zerodp.config.resolve_model` fills them)."""
    m = model_cfg
    family = getattr(m, "arch", "gpt2")
    gpt2 = family == "gpt2"
    return Arch(family=family, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head,
                n_kv_head=m.n_kv_head or m.n_head, head_dim=m.head_dim or m.n_embd // m.n_head,
                ffn=m.intermediate_size or default_ffn(family, m.n_embd), vocab_size=m.vocab_size,
                block_size=m.block_size, bias=gpt2 if m.bias is None else bool(m.bias), qkv_bias=m.qkv_bias,
                tied=gpt2 if m.tie_embeddings is None else bool(m.tie_embeddings), norm_eps=m.norm_eps,
                rope_theta=m.rope_theta, rope_scaling=dict(m.rope_scaling or {}))
