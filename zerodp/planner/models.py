"""What the planner knows about a model (`ModelSpec`), derived from the same description the model is
built from: `zerodp.models.arch.Arch`, whose `param_shapes()` is the one parameter count. Sources: a
zerodp config (`spec_from_model_config`), a Hugging Face config.json (`spec_from_hf_config`, parsed by
zerodp/planner/hf_config.py), a preset (`PRESETS`: the families' specs' and the planner-only ones), or
a bare parameter count (`spec_from_params`).

Everything here is arithmetic on a few integers; no model is built and torch is never imported.
"""

from __future__ import annotations

import math
from typing import Optional

from zerodp.errors import UserError
from zerodp.models import FAMILY_PACKAGES
from zerodp.models.arch import Arch, arch_of, spec_of
from zerodp.models.gpt2.spec import gpt2_arch
from zerodp.models.llama.spec import llama_arch
from zerodp.models.lora_spec import lora_spec
from zerodp.planner.hf_config import arch_from_hf, read_hf_config
from zerodp.planner.lora import with_lora
from zerodp.planner.types import ModelSpec
from zerodp.planner.units import lookup


def spec_from_arch(a: Arch, name: str, dropout: bool = False) -> ModelSpec:
    """The ModelSpec of an architecture: counts from `a.param_shapes()`, activations from its widths."""
    moe_ffn = a.experts_per_token * a.expert_ffn + a.shared_expert_ffn
    return ModelSpec(
        name, a.param_count(), a.n_layer, a.n_embd, a.n_head, a.vocab_size,
        moe_ffn if a.n_experts and len(a.dense_layers) < a.n_layer else a.ffn, a.n_kv_head * a.head_dim,
        a.block_size, max(a.largest_block_params(), a.embedding_params()),
        "gelu" if a.family == "gpt2" else "swiglu", dropout, not dropout, active_params=a.active_param_count(),
        q_dim=a.n_head * a.head_dim, norms_per_block=4 if a.family == "gemma2" else 2,
        qk_norm=any(name.endswith("q_norm.weight") for name in a.block_shapes()), arch=a,
        largest_param=max(math.prod(s) for s in a.param_shapes().values()),
        largest_block_params=a.largest_block_params())


def gpt_param_count(model_cfg) -> int:
    """Exact parameter count of zerodp's model for a `zerodp.config.ModelConfig` (either family)."""
    return arch_of(model_cfg).param_count()


def spec_from_model_config(model_cfg, name: str = "zerodp model") -> ModelSpec:
    """The ModelSpec of zerodp's model described by a `ModelConfig` section (either family), with its
    adapters frozen and trainable apart when `model.lora` is set (`zerodp.planner.lora.with_lora`)."""
    model = spec_from_arch(arch_of(model_cfg), name, model_cfg.dropout > 0)
    spec = lora_spec(getattr(model_cfg, "lora", None))
    return with_lora(model, spec) if spec is not None else model


def gpt2_spec(name: str, n_layer: int, n_head: int, n_embd: int, vocab_size: int = 50257,
              n_positions: int = 1024, bias: bool = True, dropout: bool = False,
              ffn: Optional[int] = None) -> ModelSpec:
    """A GPT-2-architecture model with its head tied to the token embedding."""
    return spec_from_arch(gpt2_arch(n_layer, n_head, n_embd, vocab_size, n_positions, bias, ffn), name, dropout)


def llama_spec(name: str, hidden: int, n_layer: int, n_head: int, kv_heads: int, ffn: int, vocab_size: int,
               context: int, tied: bool = False, head_dim: Optional[int] = None, qkv_bias: bool = False) -> ModelSpec:
    """A Llama/Mistral/Qwen2-style decoder: RMSNorm, GQA attention, SwiGLU MLP, no position embedding."""
    return spec_from_arch(llama_arch(hidden, n_layer, n_head, kv_heads, ffn, vocab_size, context, tied, head_dim,
                                     qkv_bias=qkv_bias), name)


# Published shapes: each family's PRESETS (zerodp/models/<family>/spec.py), then the planner-only
# relatives of llama's layout. Counts are pinned in tests/unit/test_planner.py, and tests/unit/test_planner_hf.py
# checks each against what transformers builds from the same numbers.
_PRESET_ARCHS = {
    **{name: make for family in FAMILY_PACKAGES for name, make in spec_of(family).PRESETS.items()},
    "gemma-7b": lambda: llama_arch(3072, 28, 16, 16, 24576, 256000, 8192, tied=True, head_dim=256, family="gemma"),
    "gemma2-9b": lambda: llama_arch(3584, 42, 16, 8, 14336, 256000, 8192, tied=True, head_dim=256, family="gemma2"),
    "phi3-mini": lambda: llama_arch(3072, 32, 32, 32, 8192, 32064, 4096, family="phi3"),
    "mixtral-8x7b": lambda: llama_arch(4096, 32, 32, 8, 14336, 32000, 32768, family="mixtral", n_experts=8,
                                       experts_per_token=2, expert_ffn=14336),
    "qwen1.5-moe-a2.7b": lambda: llama_arch(2048, 24, 16, 16, 5632, 151936, 8192, family="qwen2_moe", qkv_bias=True,
                                            n_experts=60, experts_per_token=4, expert_ffn=1408,
                                            shared_expert_ffn=5632),
}
PRESETS = {name: (lambda name=name, make=make: spec_from_arch(make(), name)) for name, make in _PRESET_ARCHS.items()}


def preset(name: str) -> ModelSpec:
    """The built-in model called `name` (case-insensitive); UserError naming the known ones."""
    return lookup(PRESETS, name, "model", "or describe it with --hf-config config.json or --params 7e9")()


def spec_from_hf_config(path: str) -> ModelSpec:
    """The ModelSpec of a Hugging Face model (see zerodp.planner.hf_config.SUPPORTED), read offline from
    its config.json, or from a model folder's config.json."""
    raw, p = read_hf_config(path)
    arch = arch_from_hf(raw, f"--hf-config {p}")
    return spec_from_arch(arch, raw.get("_name_or_path") or p.parent.name or raw["model_type"])


def spec_from_params(params: int, layers: Optional[int] = None, hidden: Optional[int] = None,
                     heads: Optional[int] = None, vocab: Optional[int] = None, context: int = 4096) -> ModelSpec:
    """A GPT-style shape with `params` parameters. Missing dims are guessed from P ~ 12*L*h^2 with
    hidden/layers ~ 128 (the ratio of Llama-2-7B and GPT-3 175B), so activations can be estimated."""
    for flag, v in (("--layers", layers), ("--hidden", hidden), ("--heads", heads), ("--vocab", vocab)):
        if v is not None and v <= 0:
            raise UserError(f"{flag} {v} must be a positive integer")
    assumed = layers is None or hidden is None
    vocab = vocab or 32000
    if hidden is None and layers is None:
        hidden = max(128, round((params * 128 / 12) ** (1 / 3) / 128) * 128)
    elif hidden is None:
        hidden = max(128, round((params / (12 * layers)) ** 0.5 / 128) * 128)
    if layers is None:
        layers = max(1, round((params - vocab * hidden) / (12 * hidden * hidden)))
    # default heads: as many as keep head_dim >= 64 and divide hidden
    heads = heads or max(d for d in range(1, hidden + 1) if hidden % d == 0 and hidden // d >= min(64, hidden))
    if hidden % heads:
        raise UserError(f"--hidden {hidden} is not divisible by --heads {heads}; pick heads dividing hidden")
    block = 12 * hidden * hidden
    return ModelSpec(f"{params:,} params", params, layers, hidden, heads, vocab, 4 * hidden, hidden, context,
                     max(block, vocab * hidden), "gelu", shape_assumed=assumed,
                     largest_param=max(vocab * hidden, 4 * hidden * hidden), largest_block_params=block)
