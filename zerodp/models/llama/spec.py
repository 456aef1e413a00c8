"""The Llama layout as data (`model.arch: llama`: Llama 2/3/3.1, Mistral, Qwen2), torch-free: parameter
names and shapes, the Hugging Face name table, config.json in both directions, the planner's presets.
The module is zerodp/models/llama/model.py.

Rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention (`n_kv_head`), q/k/v biases iff
`qkv_bias` (Qwen2), tied or untied head. Names and layouts are Hugging Face's, so the table is the
identity. The relatives the planner counts but zerodp does not build (zerodp.models.arch.PLANNER_FAMILIES:
gemma, gemma2, phi3, mixtral, qwen2_moe) share this layout, and their shapes are here too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from zerodp.errors import UserError

if TYPE_CHECKING:
    from zerodp.models.arch import Arch

MODEL = "Llama"
"""The class in zerodp/models/llama/model.py."""
MODEL_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_BIAS = DEFAULT_TIED = False
LEARNED_POSITIONS = False
"""Rotary positions: no table; the block size is the length trained at, not a property of the weights."""
EMBEDDING = "model.embed_tokens.weight"
BLOCK_PREFIX = "model.layers"

BLOCK_SIZE = 4096
"""block_size given to a model imported without one. Its max_position_embeddings is how far RoPE may
reach (131072 for Llama 3.1), not a length to train at; 4096 is Llama 2's training context. A
model.block_size set in the config wins (a RoPE model has no weight that depends on it)."""


def default_ffn(n_embd: int) -> int:
    """Llama's own rule: 2/3 of 4h rounded up to a multiple of 256."""
    return 256 * math.ceil(int(8 * n_embd / 3) / 256)


def block_shapes(a: Arch, layer: int) -> dict[str, tuple[int, ...]]:
    h, f, q, kv = a.n_embd, a.ffn, a.n_head * a.head_dim, a.n_kv_head * a.head_dim
    out = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
           "self_attn.o_proj.weight": (h, q)}
    if a.family == "gemma2":  # sandwich norms around the MLP as well
        out.update({"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    if a.family == "phi3":  # fused projections: the same parameters under two names instead of five
        out.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h), "mlp.gate_up_proj.weight": (2 * f, h),
                    "mlp.down_proj.weight": (h, f)})
        return dict(sorted(out.items()))
    out.update({"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                "self_attn.v_proj.weight": (kv, h)})
    if a.qkv_bias:
        out.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if a.o_bias:
        out["self_attn.o_proj.bias"] = (h,)
    if a.is_moe_layer(layer):
        e, fe, fs = a.n_experts, a.expert_ffn, a.shared_expert_ffn
        out.update({"mlp.gate.weight": (e, h),  # the router
                    "mlp.experts.gate_up_proj": (e, 2 * fe, h), "mlp.experts.down_proj": (e, h, fe)})
        if fs:
            out.update({"mlp.shared_expert.gate_proj.weight": (fs, h), "mlp.shared_expert.up_proj.weight": (fs, h),
                        "mlp.shared_expert.down_proj.weight": (h, fs), "mlp.shared_expert_gate.weight": (1, h)})
        return dict(sorted(out.items()))
    out.update({"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
    if a.mlp_bias:
        out.update({"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (h,)})
    return dict(sorted(out.items()))


def param_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    h = a.n_embd
    out = {EMBEDDING: (a.vocab_size, h)}
    for i in range(a.n_layer):
        out.update({f"{BLOCK_PREFIX}.{i}.{k}": s for k, s in a.block_shapes(i).items()})
    out["model.norm.weight"] = (h,)
    if not a.tied:
        out["lm_head.weight"] = (a.vocab_size, h)
    return out


# ---- Hugging Face names: zerodp's are HF's -------------------------------------------------------

TABLE = tuple((n, n, None) for n in (
    "model.embed_tokens.weight",
    "model.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.bias",
    "model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.bias",
    "model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.bias",
    "model.layers.{i}.self_attn.o_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight",
    "model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight",
    "model.norm.weight", "lm_head.weight",
))
IMPORT_PREFIX = ""
BUFFERS = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)
"""Old Llama files' rotary frequencies: not parameters, ignored on import."""


# ---- config.json <-> model.* keys ------------------------------------------------------------------

NORM_EPS_KEY = "rms_norm_eps"


def model_config_from_hf(raw: dict, kind: str, get, where: str, block_size: int | None, eps: float,
                         default_head_dim: int | None = None) -> dict:
    """The `model.*` keys of a llama, mistral or qwen2 config.json (zerodp.models.hf.model_config_from_hf):
    refuses Llama's attention_bias/mlp_bias, another activation, a sliding window shorter than the
    context and rope scalings other than llama3 and linear. Without `block_size`,
    min(max_position_embeddings, BLOCK_SIZE). `default_head_dim`: the head width a file without
    head_dim has (None: hidden_size / num_attention_heads)."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act {act!r} is not supported; "
                        f"zerodp's llama family computes SwiGLU with SiLU")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UserError(f"{where}: {key}=true is not supported; zerodp's llama family has biases only on q, "
                            f"k and v (Qwen2); use a model without them")
    h, heads = get("hidden_size"), get("num_attention_heads")
    kv = get("num_key_value_heads", default=heads)
    if heads % kv:
        raise UserError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    longest = get("max_position_embeddings", default=BLOCK_SIZE)
    block = block_size or min(longest, BLOCK_SIZE)
    window = raw.get("sliding_window") if kind == "mistral" or raw.get("use_sliding_window") else None
    if window is not None and window < block:
        raise UserError(f"{where}: sliding_window={window} is shorter than block_size={block}; zerodp attends "
                        f"over the whole block, so tokens more than {window} apart would see each other, which "
                        f"this model never did; set model.block_size <= {window}")
    theta, scaling = rope(raw, where)
    return {"arch": "llama", "n_layer": get("num_hidden_layers"), "n_head": heads, "n_kv_head": kv,
            "head_dim": get("head_dim", default=default_head_dim or h // heads), "n_embd": h,
            "intermediate_size": get("intermediate_size"), "vocab_size": get("vocab_size"), "block_size": block,
            "bias": False, "qkv_bias": kind == "qwen2", "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "norm_eps": eps, "rope_theta": theta, "rope_scaling": scaling}


def rope(raw: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, rope_scaling as zerodp keeps it: {} for none) from either transformers 4's keys
    (rope_theta, rope_scaling) or 5's (rope_parameters)."""
    params = raw.get("rope_parameters") or {}
    scaling = dict(raw.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, {}
    if kind not in ("llama3", "linear"):
        raise UserError(f"{where}: rope scaling {kind!r} is not supported; zerodp computes llama3 and linear")
    scaling.pop("type", None)
    return theta, {"rope_type": kind, **{k: v for k, v in scaling.items() if k != "rope_type"}}


def hf_config(a: Arch, common: dict, dropout: float, max_positions: int | None) -> dict:
    """The config.json of an export: LlamaForCausalLM, or Qwen2ForCausalLM with q/k/v biases."""
    qwen = a.qkv_bias  # Qwen2 is Llama with q/k/v biases
    out = {"model_type": "qwen2" if qwen else "llama",
           "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], **rotary_config(a, dropout,
                                                                                               max_positions), **common}
    if qwen:
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out


def rotary_config(a: Arch, dropout: float, max_positions: int | None) -> dict:
    """The config.json keys every model of this layout has."""
    return {"num_hidden_layers": a.n_layer, "num_attention_heads": a.n_head, "num_key_value_heads": a.n_kv_head,
            "head_dim": a.head_dim, "hidden_size": a.n_embd, "intermediate_size": a.ffn,
            "max_position_embeddings": max_positions or a.block_size, "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta, "rope_scaling": dict(a.rope_scaling) or None, "hidden_act": "silu",
            "attention_dropout": dropout}


# ---- the planner ---------------------------------------------------------------------------------

PLANNER_DEFAULTS = {"mistral": {"num_key_value_heads": 8}, "qwen2": {"num_key_value_heads": 32}}
"""transformers' defaults for the shape keys a config.json may omit, where they are not llama's
(num_key_value_heads = num_attention_heads, head_dim = hidden / heads, untied, no biases)."""


def planner_arch(given: dict, kind: str, get, family: str = "llama", **extra) -> Arch:
    """The Arch transformers builds from a config.json of this layout (`given`: the file over
    PLANNER_DEFAULTS): Llama's attention_bias and mlp_bias counted, as are Qwen2's q/k/v biases."""
    from zerodp.models.arch import Arch

    h, heads = get("hidden_size"), get("num_attention_heads")
    attention_bias = kind in ("llama", "gemma", "gemma2", "qwen3") and bool(given.get("attention_bias", False))
    return Arch(
        family, n_layer=get("num_hidden_layers"), n_embd=h, n_head=heads,
        n_kv_head=get("num_key_value_heads", default=heads), head_dim=get("head_dim", default=h // heads),
        ffn=get("intermediate_size"), vocab_size=get("vocab_size"),
        block_size=get("max_position_embeddings", default=4096), bias=False,
        qkv_bias=attention_bias or kind == "qwen2" or (kind == "qwen2_moe" and bool(given["qkv_bias"])),
        tied=bool(given.get("tie_word_embeddings", False)), o_bias=attention_bias,
        mlp_bias=kind == "llama" and bool(given.get("mlp_bias", False)), **extra)


def llama_arch(hidden: int, n_layer: int, n_head: int, kv_heads: int, ffn: int, vocab_size: int, context: int,
               tied: bool = False, head_dim: int | None = None, family: str = "llama", **extra) -> Arch:
    """A decoder of this layout; `family` and `extra` (Arch fields: qkv_bias, n_experts, ...) for its
    relatives."""
    from zerodp.models.arch import Arch

    return Arch(family, n_layer, hidden, n_head, kv_heads, head_dim or hidden // n_head, ffn, vocab_size, context,
                False, extra.pop("qkv_bias", False), tied, **extra)


# Published shapes (the models' config.json files); counts pinned in tests/unit/test_planner.py, and
# tests/unit/test_planner_hf.py checks each against what transformers builds from the same numbers.
PRESETS = {
    "llama2-7b": lambda: llama_arch(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama2-13b": lambda: llama_arch(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama2-70b": lambda: llama_arch(8192, 80, 64, 8, 28672, 32000, 4096),
    "llama3-8b": lambda: llama_arch(4096, 32, 32, 8, 14336, 128256, 8192),
    "llama3-70b": lambda: llama_arch(8192, 80, 64, 8, 28672, 128256, 8192),
    "llama3.2-1b": lambda: llama_arch(2048, 16, 32, 8, 8192, 128256, 131072, tied=True),
    "llama3.2-3b": lambda: llama_arch(3072, 28, 24, 8, 8192, 128256, 131072, tied=True),
    "mistral-7b": lambda: llama_arch(4096, 32, 32, 8, 14336, 32000, 32768),
    "qwen2.5-7b": lambda: llama_arch(3584, 28, 28, 4, 18944, 152064, 32768, qkv_bias=True),
}
