"""An architecture as data: every parameter's name and shape, the parameter count and the FLOPs per
token, derived from one description (`Arch`). The model code builds exactly these parameters (a test
pins it), the planner counts them, and the Hugging Face mapping (zerodp/models/hf.py) names them.

Imports neither torch nor deepspeed: the planner reads it instantly.

Two families zerodp builds and trains (`FAMILIES`):
- `gpt2`: learned positions, LayerNorm, GELU MLP (4h), one fused c_attn, biases iff `bias`, tied head.
- `llama` (Llama 2/3, Mistral, Qwen2): rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention
  (`n_kv_head`), q/k/v biases iff `qkv_bias` (Qwen2), tied or untied head. Names are Hugging Face's.

Five more the planner counts but zerodp does not build (`PLANNER_FAMILIES`; `arch_of` refuses them),
each with the names and shapes transformers gives its parameters (tests/test_planner_hf.py compares):
- `gemma`: llama's layout (its GeGLU and (1 + w) norms change no shape); head_dim is free (256).
- `gemma2`: gemma plus two more norms per block (pre_feedforward_layernorm, post_feedforward_layernorm).
- `phi3`: llama with q, k, v fused into one qkv_proj and gate, up into one gate_up_proj (same counts).
- `mixtral`: llama whose MLP is `n_experts` SwiGLU experts of width `expert_ffn`, a router picking
  `experts_per_token` of them per token.
- `qwen2_moe`: mixtral's experts plus a shared expert (width `shared_expert_ffn`) with a sigmoid gate,
  q/k/v biases; layers in `dense_layers` keep a dense MLP of width `ffn`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerodp.errors import ConfigError

FAMILIES = ("gpt2", "llama")
"""Families zerodp builds (zerodp.models.FAMILY_MODULES) and trains: `model.arch`."""
PLANNER_FAMILIES = ("gemma", "gemma2", "phi3", "mixtral", "qwen2_moe")
"""Families only described here, for the planner (`zerodp plan --hf-config`): counted, never built."""


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
    o_bias: bool = False
    """llama family: a bias on o_proj too (Hugging Face's attention_bias sets it with qkv_bias)."""
    mlp_bias: bool = False
    """llama family: biases on gate_proj, up_proj and down_proj (Hugging Face's mlp_bias)."""
    n_experts: int = 0
    """Mixture of experts (mixtral, qwen2_moe): experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = 0
    """Experts the router picks for each token (num_experts_per_tok)."""
    expert_ffn: int = 0
    """Width of one expert's inner layer."""
    shared_expert_ffn: int = 0
    """qwen2_moe: width of the shared expert every token also passes through (with a 1-wide gate)."""
    dense_layers: tuple[int, ...] = ()
    """MoE models: the layers whose MLP is dense (width `ffn`) rather than experts."""

    def __post_init__(self):
        if self.family not in FAMILIES + PLANNER_FAMILIES:
            raise ValueError(f"Arch family {self.family!r} is not one of {', '.join(FAMILIES + PLANNER_FAMILIES)}")
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in 1..n_experts={self.n_experts}")

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

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s MLP is a mixture of experts."""
        return self.n_experts > 0 and layer not in self.dense_layers

    def block_shapes(self, layer: int = 0) -> dict[str, tuple[int, ...]]:
        """Block `layer`'s parameters, by their names inside the block (only MoE models' blocks differ)."""
        h, f, q, kv = self.n_embd, self.ffn, self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        if self.family == "gpt2":
            out = {"ln_1.weight": (h,), "attn.c_attn.weight": (3 * h, h), "attn.c_proj.weight": (h, h),
                   "ln_2.weight": (h,), "mlp.c_fc.weight": (f, h), "mlp.c_proj.weight": (h, f)}
            if self.bias:
                out.update({"ln_1.bias": (h,), "attn.c_attn.bias": (3 * h,), "attn.c_proj.bias": (h,),
                            "ln_2.bias": (h,), "mlp.c_fc.bias": (f,), "mlp.c_proj.bias": (h,)})
            return dict(sorted(out.items()))
        out = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
               "self_attn.o_proj.weight": (h, q)}
        if self.family == "gemma2":  # sandwich norms around the MLP as well
            out.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
        if self.family == "phi3":  # fused projections: the same parameters under two names instead of five
            out.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * f, h),
                        "mlp.down_proj.weight": (h, f)})
            return dict(sorted(out.items()))
        out.update({"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                    "self_attn.v_proj.weight": (kv, h)})
        if self.qkv_bias:
            out.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
        if self.o_bias:
            out["self_attn.o_proj.bias"] = (h,)
        if self.is_moe_layer(layer):
            e, fe, fs = self.n_experts, self.expert_ffn, self.shared_expert_ffn
            out.update({"mlp.gate.weight": (e, h),  # the router
                        "mlp.experts.gate_up_proj": (e, 2 * fe, h), "mlp.experts.down_proj": (e, h, fe)})
            if fs:
                out.update({"mlp.shared_expert.gate_proj.weight": (fs, h), "mlp.shared_expert.up_proj.weight": (fs, h),
                            "mlp.shared_expert.down_proj.weight": (h, fs), "mlp.shared_expert_gate.weight": (1, h)})
            return dict(sorted(out.items()))
        out.update({"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
        if self.mlp_bias:
            out.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (h,)})
        return dict(sorted(out.items()))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainable parameter's name and shape, a tied head listed once (under the embedding)."""
        h = self.n_embd
        out = {self.embedding: (self.vocab_size, h)}
        if self.family == "gpt2":
            out["transformer.wpe.weight"] = (self.block_size, h)
        for i in range(self.n_layer):
            out.update({f"{self.block_prefix}.{i}.{k}": s for k, s in self.block_shapes(i).items()})
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
        """Trainable parameters, a tied head counted once: what memory holds (every expert included)."""
        return sum(math.prod(s) for s in self.param_shapes().values())

    def active_param_count(self) -> int:
        """Parameters one token computes with: a mixture of experts counts `experts_per_token` of its
        `n_experts` experts (the router and a shared expert always); `param_count()` for a dense model."""
        total = 0
        for name, shape in self.param_shapes().items():
            n = math.prod(shape)
            if ".mlp.experts." in name:  # (n_experts, ...): one slice per expert
                n = n // self.n_experts * self.experts_per_token
            total += n
        return total

    def block_params(self, layer: int = 0) -> int:
        return sum(math.prod(s) for s in self.block_shapes(layer).values())

    def largest_block_params(self) -> int:
        """The biggest block's parameter count (MoE models may mix dense and expert blocks)."""
        layers = range(self.n_layer) if self.n_experts else range(min(1, self.n_layer))
        return max((self.block_params(i) for i in layers), default=0)

    def embedding_params(self) -> int:
        """The input embeddings: the token table, and gpt2's position table."""
        return (self.vocab_size + (self.block_size if self.family == "gpt2" else 0)) * self.n_embd

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6 per parameter that multiplies (all the token's active parameters
        but the position table and an untied token embedding, which are lookups; a tied one is also the
        head) plus attention's QK^T and AV, 12 * L * s * (n_head * head_dim) (PaLM, appendix B)."""
        s = seq_len or self.block_size
        lookups = (self.block_size * self.n_embd if self.family == "gpt2" else 0) \
            + (0 if self.tied else self.vocab_size * self.n_embd)
        return 6 * (self.active_param_count() - lookups) + 12 * self.n_layer * s * self.n_head * self.head_dim


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
    if family not in FAMILIES:
        known = f"; {family} is known to the planner only (zerodp plan --hf-config)" \
            if family in PLANNER_FAMILIES else ""
        raise ConfigError(f"model.arch={family!r}: zerodp builds and trains {' and '.join(FAMILIES)}{known}")
    gpt2 = family == "gpt2"
    return Arch(family=family, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head,
                n_kv_head=m.n_kv_head or m.n_head, head_dim=m.head_dim or m.n_embd // m.n_head,
                ffn=m.intermediate_size or default_ffn(family, m.n_embd), vocab_size=m.vocab_size,
                block_size=m.block_size, bias=gpt2 if m.bias is None else bool(m.bias), qkv_bias=m.qkv_bias,
                tied=gpt2 if m.tie_embeddings is None else bool(m.tie_embeddings), norm_eps=m.norm_eps,
                rope_theta=m.rope_theta, rope_scaling=dict(m.rope_scaling or {}))


# ModelConfig's defaults for the keys a model section may lack (checkpoints saved before a key existed);
# tests/test_model.py pins that they equal zerodp.config.ModelConfig's.
SECTION_DEFAULTS = {"arch": "gpt2", "n_kv_head": None, "head_dim": None, "intermediate_size": None, "bias": None,
                    "qkv_bias": False, "tie_embeddings": None, "norm_eps": 1e-5, "rope_theta": 10000.0,
                    "rope_scaling": {}, "dropout": 0.0, "block_size": 128}


def arch_from_section(model: dict) -> Arch:
    """The Arch of a model section as a checkpoint records it (a dict, as in meta.json)."""
    from types import SimpleNamespace

    return arch_of(SimpleNamespace(**{**SECTION_DEFAULTS, **model}))
