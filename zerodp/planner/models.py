"""Model shapes and exact parameter counts: zerodp's GPT, GPT-2 presets, Llama/Mistral config.json.

Everything here is arithmetic on a few integers; no model is built and torch is never imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zerodp.errors import UserError
from zerodp.planner.units import lookup


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a decoder-only transformer."""

    name: str
    params: int
    """Trainable parameters, a tied embedding counted once."""
    n_layer: int
    hidden: int
    n_head: int
    vocab_size: int
    ffn_hidden: int
    """Width of the MLP's inner layer: 4*hidden for GPT-2, intermediate_size for Llama."""
    kv_dim: int
    """Width of K (and of V): kv_heads * head_dim; equals hidden without grouped-query attention."""
    context: int
    """Longest sequence the model accepts (block_size, n_positions, max_position_embeddings)."""
    largest_unit_params: int
    """Biggest group of parameters ZeRO-3/FSDP gathers at once: one block, or the embeddings."""
    mlp: str = "gelu"
    """'gelu' (GPT-2: fc, GELU, proj) or 'swiglu' (Llama: gate, up, down)."""
    dropout: bool = False
    """Dropout active in training: its 1-byte masks are kept for backward."""
    fused_attention: bool = True
    """SDPA/flash attention: the s x s score matrices are never stored."""
    shape_assumed: bool = False
    """Layer dimensions were guessed from the parameter count alone."""


def _gpt2_counts(n_layer: int, n_embd: int, vocab_size: int, n_positions: int, bias: bool = True,
                 ffn: Optional[int] = None) -> tuple[int, int, int]:
    """(total, per block, embeddings) for GPT-2's architecture with the lm_head tied to wte."""
    h, f, b = n_embd, ffn or 4 * n_embd, int(bias)
    norm = h * (1 + b)  # LayerNorm weight, + bias
    block = (norm + h * 3 * h + b * 3 * h + h * h + b * h   # ln_1, attn.c_attn, attn.c_proj
             + norm + h * f + b * f + f * h + b * h)          # ln_2, mlp.c_fc, mlp.c_proj
    embeddings = vocab_size * h + n_positions * h             # wte (also the lm_head), wpe
    return embeddings + n_layer * block + norm, block, embeddings  # + ln_f


def gpt_param_count(model_cfg) -> int:
    """Exact parameter count of zerodp's model for a `zerodp.config.ModelConfig` (either family)."""
    from zerodp.models.arch import arch_of

    return arch_of(model_cfg).param_count()


def gpt2_spec(name: str, n_layer: int, n_head: int, n_embd: int, vocab_size: int = 50257,
              n_positions: int = 1024, bias: bool = True, dropout: bool = False,
              ffn: Optional[int] = None) -> ModelSpec:
    """A GPT-2-architecture model (zerodp's own GPT is one)."""
    total, block, emb = _gpt2_counts(n_layer, n_embd, vocab_size, n_positions, bias, ffn)
    return ModelSpec(name, total, n_layer, n_embd, n_head, vocab_size, ffn or 4 * n_embd, n_embd,
                     n_positions, max(block, emb), "gelu", dropout)


def spec_from_model_config(model_cfg, name: str = "zerodp model") -> ModelSpec:
    """The ModelSpec of zerodp's model described by a `ModelConfig` section (either family)."""
    from zerodp.models.arch import arch_of

    a = arch_of(model_cfg)
    if a.family == "gpt2":
        return gpt2_spec(name, a.n_layer, a.n_head, a.n_embd, a.vocab_size, a.block_size, a.bias,
                         model_cfg.dropout > 0, ffn=a.ffn)
    return llama_spec(name, a.n_embd, a.n_layer, a.n_head, a.n_kv_head, a.ffn, a.vocab_size, a.block_size,
                      tied=a.tied, head_dim=a.head_dim, qkv_bias=a.qkv_bias)


def llama_spec(name: str, hidden: int, n_layer: int, n_head: int, kv_heads: int, ffn: int, vocab_size: int,
               context: int, tied: bool = False, head_dim: Optional[int] = None,
               attention_bias: bool = False, mlp_bias: bool = False, qkv_bias: bool = False) -> ModelSpec:
    """A Llama/Mistral-style decoder: RMSNorm, GQA attention, SwiGLU MLP, no position embedding."""
    hd = head_dim or hidden // n_head
    q, kv = n_head * hd, kv_heads * hd
    attn = hidden * q + 2 * hidden * kv + q * hidden  # q, k, v, o projections
    if attention_bias:
        attn += q + 2 * kv + hidden
    elif qkv_bias:  # Qwen2: biases on q, k, v only
        attn += q + 2 * kv
    mlp = 3 * hidden * ffn + (2 * ffn + hidden if mlp_bias else 0)  # gate, up, down
    block = attn + mlp + 2 * hidden  # + input and post-attention RMSNorm weights
    embed = vocab_size * hidden
    total = embed + n_layer * block + hidden + (0 if tied else vocab_size * hidden)  # final norm, lm_head
    return ModelSpec(name, total, n_layer, hidden, n_head, vocab_size, ffn, kv, context,
                     max(block, embed), "swiglu")


# Published shapes (the models' config.json files). Counts are pinned in tests/test_planner.py.
PRESETS = {
    "gpt2": lambda: gpt2_spec("gpt2", 12, 12, 768),
    "gpt2-medium": lambda: gpt2_spec("gpt2-medium", 24, 16, 1024),
    "gpt2-large": lambda: gpt2_spec("gpt2-large", 36, 20, 1280),
    "gpt2-xl": lambda: gpt2_spec("gpt2-xl", 48, 25, 1600),
    "llama2-7b": lambda: llama_spec("llama2-7b", 4096, 32, 32, 32, 11008, 32000, 4096),
    "llama2-13b": lambda: llama_spec("llama2-13b", 5120, 40, 40, 40, 13824, 32000, 4096),
    "llama2-70b": lambda: llama_spec("llama2-70b", 8192, 80, 64, 8, 28672, 32000, 4096),
    "llama3-8b": lambda: llama_spec("llama3-8b", 4096, 32, 32, 8, 14336, 128256, 8192),
    "llama3-70b": lambda: llama_spec("llama3-70b", 8192, 80, 64, 8, 28672, 128256, 8192),
    "llama3.2-1b": lambda: llama_spec("llama3.2-1b", 2048, 16, 32, 8, 8192, 128256, 131072, tied=True),
    "llama3.2-3b": lambda: llama_spec("llama3.2-3b", 3072, 28, 24, 8, 8192, 128256, 131072, tied=True),
    "mistral-7b": lambda: llama_spec("mistral-7b", 4096, 32, 32, 8, 14336, 32000, 32768),
}


def preset(name: str) -> ModelSpec:
    """The built-in model called `name` (case-insensitive); UserError naming the known ones."""
    return lookup(PRESETS, name, "model", "or describe it with --hf-config config.json or --params 7e9")()


_SUPPORTED_HF = ("gpt2", "llama", "mistral", "qwen2")


def spec_from_hf_config(path: str) -> ModelSpec:
    """The ModelSpec of a Hugging Face model (gpt2, llama, mistral, qwen2), read offline from its
    config.json, or from a model folder's config.json."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"--hf-config {p}: the folder has no config.json; pass a Hugging Face model folder "
                            f"or its config.json")
        p = p / "config.json"
    elif not p.is_file():
        raise UserError(f"--hf-config {p}: file not found; pass the model's folder or its config.json")
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise UserError(f"--hf-config {p}: not valid JSON{where}; pass the model's config.json") from None
    if not isinstance(raw, dict):
        raise UserError(f"--hf-config {p}: expected a JSON object with model_type, hidden_size, ...")
    kind = raw.get("model_type")
    if kind not in _SUPPORTED_HF:
        raise UserError(f"--hf-config {p}: model_type {kind!r} is not supported; the planner reads "
                        f"{', '.join(_SUPPORTED_HF)} configs (for others use --params with --layers/--hidden)")

    def get(key, default=None, *alts):
        for k in (key, *alts):
            if raw.get(k) is not None:
                value = raw[k]
                break
        else:
            if default is None:
                raise UserError(f"--hf-config {p}: {kind} config lacks {key!r}; is it the model's config.json?")
            value = default
        if not isinstance(value, (int, bool)) or value <= 0:
            raise UserError(f"--hf-config {p}: {key}={value!r} must be a positive integer")
        return value

    name = raw.get("_name_or_path") or p.parent.name or kind
    if kind == "gpt2":
        h = get("n_embd")
        return gpt2_spec(name, get("n_layer"), get("n_head"), h, get("vocab_size"),
                         get("n_positions", None, "n_ctx"), ffn=raw.get("n_inner") or 4 * h)
    h, heads = get("hidden_size"), get("num_attention_heads")
    return llama_spec(
        name, h, get("num_hidden_layers"), heads, get("num_key_value_heads", heads),
        get("intermediate_size"), get("vocab_size"), get("max_position_embeddings", 4096),
        tied=bool(raw.get("tie_word_embeddings", False)), head_dim=raw.get("head_dim") or None,
        attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        qkv_bias=kind == "qwen2",
    )


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
                     max(block, vocab * hidden), "gelu", shape_assumed=assumed)
