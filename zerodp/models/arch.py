"""An architecture as data: every parameter's name and shape, the parameter count and the FLOPs per
token, derived from one description (`Arch`). Which names and shapes a family has is its spec's
(zerodp/models/<family>/spec.py, found through zerodp.models.FAMILY_PACKAGES); the model code builds
exactly these parameters (a test pins it), the planner counts them, and the Hugging Face mapping
(zerodp/models/hf.py) names them.

Imports neither torch nor deepspeed: the planner reads it instantly.

The families zerodp builds and trains (`FAMILIES`) are the registered ones: gpt2, llama (Llama 2/3,
Mistral, Qwen2), qwen3 and qwen3_moe (its experts: n_experts, experts_per_token, expert_ffn,
norm_topk_prob, dense_layers, from model.moe). Five more the planner counts but zerodp does not build
(`PLANNER_FAMILIES`; `arch_of` refuses them), each with the names and shapes transformers gives its parameters
(tests/unit/test_planner_hf.py compares); all five have llama's layout and llama's spec describes them:
- `gemma`: llama's layout (its GeGLU and (1 + w) norms change no shape); head_dim is free (256).
- `gemma2`: gemma plus two more norms per block (pre_feedforward_layernorm, post_feedforward_layernorm).
- `phi3`: llama with q, k, v fused into one qkv_proj and gate, up into one gate_up_proj (same counts).
- `mixtral`: llama whose MLP is `n_experts` SwiGLU experts of width `expert_ffn`, a router picking
  `experts_per_token` of them per token.
- `qwen2_moe`: mixtral's experts plus a shared expert (width `shared_expert_ffn`) with a sigmoid gate,
  q/k/v biases; layers in `dense_layers` keep a dense MLP of width `ffn`.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

from zerodp.errors import ConfigError
from zerodp.models import FAMILY_PACKAGES

FAMILIES = tuple(FAMILY_PACKAGES)
"""Families zerodp builds and trains: `model.arch`."""
PLANNER_FAMILIES = ("gemma", "gemma2", "phi3", "mixtral", "qwen2_moe")
"""Families only described here, for the planner (`zerodp plan --hf-config`): counted, never built."""


def spec_of(family: str):
    """The torch-free spec module of `family` (a planner-only relative: llama's)."""
    return importlib.import_module(FAMILY_PACKAGES.get(family, FAMILY_PACKAGES["llama"]) + ".spec")


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
    norm_topk_prob: bool = False
    """MoE models: the k chosen experts' router probabilities renormalised to sum 1."""

    def __post_init__(self):
        if self.family not in FAMILIES + PLANNER_FAMILIES:
            raise ValueError(f"Arch family {self.family!r} is not one of {', '.join(FAMILIES + PLANNER_FAMILIES)}")
        if self.n_experts and not 0 < self.experts_per_token <= self.n_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in 1..n_experts={self.n_experts}")

    # -- names and shapes: the family's spec (zerodp/models/<family>/spec.py) ---------------------------

    @property
    def spec(self):
        """The family's torch-free spec module (the planner's relatives read llama's)."""
        return spec_of(self.family)

    @property
    def embedding(self) -> str:
        return self.spec.EMBEDDING

    @property
    def block_prefix(self) -> str:
        return self.spec.BLOCK_PREFIX

    def tied_weights(self) -> dict[str, str]:
        """alias -> stored name, for weights shared by two modules (the tied head)."""
        return {"lm_head.weight": self.embedding} if self.tied else {}

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s MLP is a mixture of experts."""
        return self.n_experts > 0 and layer not in self.dense_layers

    def block_shapes(self, layer: int = 0) -> dict[str, tuple[int, ...]]:
        """Block `layer`'s parameters, by their names inside the block (only MoE models' blocks differ)."""
        return self.spec.block_shapes(self, layer)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trainable parameter's name and shape, a tied head listed once (under the embedding)."""
        return self.spec.param_shapes(self)

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
        return (self.vocab_size + (self.block_size if self.spec.LEARNED_POSITIONS else 0)) * self.n_embd

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6 per parameter that multiplies (all the token's active parameters
        but the position table and an untied token embedding, which are lookups; a tied one is also the
        head) plus attention's QK^T and AV, 12 * L * s * (n_head * head_dim) (PaLM, appendix B)."""
        s = seq_len or self.block_size
        lookups = (self.block_size * self.n_embd if self.spec.LEARNED_POSITIONS else 0) \
            + (0 if self.tied else self.vocab_size * self.n_embd)
        return 6 * (self.active_param_count() - lookups) + 12 * self.n_layer * s * self.n_head * self.head_dim


def default_ffn(family: str, n_embd: int) -> int:
    """The MLP width a family has when intermediate_size is not given (gpt2: 4h; llama: Llama's rule)."""
    return spec_of(family).default_ffn(n_embd)


def arch_of(model_cfg) -> Arch:
    """The Arch of a `zerodp.config.ModelConfig` section (keys left null take the family's default,
    as `zerodp.config.resolve_model` fills them)."""
    m = model_cfg
    family = getattr(m, "arch", "gpt2")
    if family not in FAMILIES:
        known = f"; {family} is known to the planner only (zerodp plan --hf-config)" \
            if family in PLANNER_FAMILIES else ""
        raise ConfigError(f"model.arch={family!r}: zerodp builds and trains {', '.join(FAMILIES)}{known}")
    spec = spec_of(family)
    moe = {}
    if getattr(spec, "MOE", False):  # a mixture of experts: model.moe (zerodp.models.moe_spec)
        from zerodp.models.moe_spec import moe_spec

        moe = spec._moe_fields(moe_spec(getattr(m, "moe", None)), m.n_layer,
                               m.intermediate_size or spec.default_ffn(m.n_embd))
    return Arch(family=family, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head,
                n_kv_head=m.n_kv_head or m.n_head, head_dim=m.head_dim or m.n_embd // m.n_head,
                ffn=m.intermediate_size or spec.default_ffn(m.n_embd), vocab_size=m.vocab_size,
                block_size=m.block_size, bias=spec.DEFAULT_BIAS if m.bias is None else bool(m.bias),
                qkv_bias=m.qkv_bias, tied=spec.DEFAULT_TIED if m.tie_embeddings is None else bool(m.tie_embeddings),
                norm_eps=m.norm_eps, rope_theta=m.rope_theta, rope_scaling=dict(m.rope_scaling or {}), **moe)


# ModelConfig's defaults for the keys a model section may lack (checkpoints saved before a key existed);
# tests/unit/test_model.py pins that they equal zerodp.config.ModelConfig's.
SECTION_DEFAULTS = {"arch": "gpt2", "n_kv_head": None, "head_dim": None, "intermediate_size": None, "bias": None,
                    "qkv_bias": False, "tie_embeddings": None, "norm_eps": 1e-5, "rope_theta": 10000.0,
                    "rope_scaling": {}, "dropout": 0.0, "block_size": 128, "moe": {}}


def arch_from_section(model: dict) -> Arch:
    """The Arch of a model section as a checkpoint records it (a dict, as in meta.json)."""
    from types import SimpleNamespace

    return arch_of(SimpleNamespace(**{**SECTION_DEFAULTS, **model}))
