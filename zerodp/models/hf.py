"""The Hugging Face mapping, as data read in both directions: parameter names and layouts (one table per
family: zerodp name, HF name, transform) and config.json <-> the `model.*` keys of zerodp's config.

    model_config_from_hf(json.load(open("config.json")))   # {"arch": "llama", "n_layer": 32, ...}
    hf_config_from_model(meta["config"]["model"])          # the config.json of an export
    to_hf("gpt2", "transformer.h.3.attn.c_attn.weight")    # ("transformer.h.3.attn.c_attn.weight", "transpose")
    from_hf("gpt2", "h.3.attn.c_attn.weight")              # ("transformer.h.3.attn.c_attn.weight", "transpose")

Model types read: gpt2 (GPT2LMHeadModel, or a bare GPT2Model) and llama, mistral, qwen2 (zerodp's llama
family). Imports neither torch nor transformers: the planner (`zerodp plan --hf-config`) reads it too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from zerodp.errors import UserError

SUPPORTED = ("gpt2", "llama", "mistral", "qwen2")
TRANSPOSE = "transpose"
"""HF's GPT-2 Conv1D keeps a weight as (in, out), torch's nn.Linear as (out, in). Its own inverse."""

LLAMA_BLOCK_SIZE = 4096
"""block_size given to a llama-family model imported without one. Its max_position_embeddings is how far
RoPE may reach (131072 for Llama 3.1), not a length to train at; 4096 is Llama 2's training context.
A model.block_size set in the config wins (a RoPE model has no weight that depends on it)."""


def _same(*names: str, transform: str | None = None) -> tuple:
    return tuple((n, n, transform) for n in names)


# (zerodp name, Hugging Face name, transform); `{i}` is a block's index. Every parameter zerodp's models
# have is listed (tests/test_hf.py pins that against Arch.param_shapes()); the tied head is absent
# from a tied export, as in HF's own files.
TABLES: dict[str, tuple[tuple[str, str, str | None], ...]] = {
    "gpt2": (
        *_same("transformer.wte.weight", "transformer.wpe.weight",
               "transformer.h.{i}.ln_1.weight", "transformer.h.{i}.ln_1.bias",
               "transformer.h.{i}.attn.c_attn.bias", "transformer.h.{i}.attn.c_proj.bias",
               "transformer.h.{i}.ln_2.weight", "transformer.h.{i}.ln_2.bias",
               "transformer.h.{i}.mlp.c_fc.bias", "transformer.h.{i}.mlp.c_proj.bias",
               "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"),
        *_same("transformer.h.{i}.attn.c_attn.weight", "transformer.h.{i}.attn.c_proj.weight",
               "transformer.h.{i}.mlp.c_fc.weight", "transformer.h.{i}.mlp.c_proj.weight", transform=TRANSPOSE),
    ),
    "llama": _same(  # zerodp's llama family uses HF's names and layouts
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
    ),
}

# Read on import only: the prefix a bare GPT2Model (no LM head) lacks, and tensors in HF files that are
# not parameters (GPT-2's causal-mask buffers, old Llama files' rotary frequencies).
IMPORT_PREFIX = {"gpt2": "transformer.", "llama": ""}
BUFFERS = {"gpt2": ("transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias"),
           "llama": ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)}


def _pattern(p: str) -> re.Pattern:
    return re.compile(re.escape(p).replace(re.escape("{i}"), r"(\d+)"))


_COMPILED = {fam: [(_pattern(z), _pattern(h), z, h, t) for z, h, t in rows] for fam, rows in TABLES.items()}
_BUFFERS = {fam: [_pattern(b) for b in rows] for fam, rows in BUFFERS.items()}


def _fill(pattern: str, m: re.Match) -> str:
    return pattern.replace("{i}", m.group(1)) if m.groups() else pattern


def to_hf(family: str, name: str) -> tuple[str, str | None] | None:
    """(HF name, transform) of zerodp parameter `name`, or None if the table has no row for it."""
    for zp, _, _, hf, t in _COMPILED[family]:
        if m := zp.fullmatch(name):
            return _fill(hf, m), t
    return None


def from_hf(family: str, name: str) -> tuple[str, str | None] | None:
    """(zerodp name, transform) of HF tensor `name` (GPT2Model's unprefixed names too), or None if the
    table has no row for it."""
    for candidate in (name, IMPORT_PREFIX[family] + name):
        for _, hp, zp, _, t in _COMPILED[family]:
            if m := hp.fullmatch(candidate):
                return _fill(zp, m), t
    return None


def is_buffer(family: str, name: str) -> bool:
    """A tensor HF files may hold that is not a parameter (ignored on import)."""
    return any(b.fullmatch(c) for c in (name, IMPORT_PREFIX[family] + name) for b in _BUFFERS[family])


def transposed(shape: tuple, transform: str | None) -> tuple:
    return tuple(shape)[::-1] if transform == TRANSPOSE else tuple(shape)


def family_of_names(names) -> str | None:
    """gpt2 or llama, by which table names the tensors (None when neither does)."""
    for family in TABLES:
        if any(from_hf(family, n) for n in names):
            return family
    return None


def guess_layout(shapes: dict[str, tuple]) -> str:
    """"hf" or "zerodp" for weights that do not say which they are: a GPT-2 whose fused c_attn is
    (h, 3h) (HF's Conv1D) or whose names lack `transformer.` (GPT2Model) is HF's; anything else reads
    the same either way (llama's table is the identity) and is taken as zerodp's."""
    for name, shape in shapes.items():
        if re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.c_attn\.weight", name):
            if not name.startswith("transformer.") or (len(shape) == 2 and shape[1] == 3 * shape[0]):
                return "hf"
    return "zerodp"


# ---- config.json <-> model.* keys ------------------------------------------------------------------


def read_hf_config(path: str | Path, what: str = "model.hf_config") -> tuple[dict, Path]:
    """The JSON object of a config.json, or of the config.json in folder `path`; UserError otherwise."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"{what} {p}: the folder has no config.json; pass a Hugging Face model folder or its "
                            f"config.json")
        p = p / "config.json"
    elif not p.is_file():
        raise UserError(f"{what} {p}: file not found; pass a Hugging Face model folder or its config.json")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        at = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise UserError(f"{what} {p}: not valid JSON{at}; pass the model's config.json") from None
    if not isinstance(raw, dict):
        raise UserError(f"{what} {p}: expected a JSON object with model_type, hidden_size, ...")
    return raw, p


REQUIRED = object()


def config_int(raw: dict, key: str, *alts: str, default=REQUIRED, where: str, kind: str) -> int:
    """A positive integer from a config.json: the first of `key`/`alts` set, else `default`; UserError
    when it is required and absent, or not a positive integer. The planner reads its families with it too."""
    for k in (key, *alts):
        if raw.get(k) is not None:
            value = raw[k]
            break
    else:
        if default is REQUIRED:
            raise UserError(f"{where}: the {kind} config lacks {key!r}; is it the model's config.json?")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{where}: {key}={value!r} must be a positive integer")
    return value


def model_config_from_hf(raw: dict, where: str = "config.json", block_size: int | None = None) -> dict:
    """The `model.*` keys (arch and every dimension) of a Hugging Face config.json's object, or a
    one-line UserError for what zerodp cannot run exactly (another model_type, biases it lacks, another
    activation, a sliding window shorter than the context, an unsupported rope scaling).

    `block_size`: the sequence length to train at, if the caller has one (a llama-family model's is
    free; a gpt2's is its position table's size, so the file's n_positions is returned regardless).
    Without one, a llama-family model gets min(max_position_embeddings, LLAMA_BLOCK_SIZE)."""
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"{where}: model_type {kind!r} is not supported; zerodp reads {', '.join(SUPPORTED)}")

    def get(key: str, *alts: str, default=REQUIRED):
        return config_int(raw, key, *alts, default=default, where=where, kind=kind)

    def refuse(what: str, why: str) -> UserError:
        return UserError(f"{where}: {what}; {why}")

    eps_key = "layer_norm_epsilon" if kind == "gpt2" else "rms_norm_eps"
    eps = raw.get(eps_key, 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise UserError(f"{where}: {eps_key}={eps!r} must be a positive number")
    tied = raw.get("tie_word_embeddings", kind == "gpt2")  # each family's own default
    if kind == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise refuse(f"activation_function {act!r} is not supported",
                         "zerodp's gpt2 computes GELU's tanh approximation (gelu_new)")
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
            raise refuse("scale_attn_by_inverse_layer_idx/scale_attn_weights differ from GPT-2's",
                         "zerodp's gpt2 scales attention by 1/sqrt(head_dim) in every layer")
        h, heads = get("n_embd"), get("n_head")
        return {"arch": "gpt2", "n_layer": get("n_layer"), "n_head": heads, "n_kv_head": heads, "head_dim": None,
                "n_embd": h, "intermediate_size": get("n_inner", default=4 * h),
                "vocab_size": get("vocab_size"), "block_size": get("n_positions", "n_ctx"), "bias": True,
                "qkv_bias": False, "tie_embeddings": bool(tied), "norm_eps": float(eps)}
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise refuse(f"hidden_act {act!r} is not supported", "zerodp's llama family computes SwiGLU with SiLU")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise refuse(f"{key}=true is not supported",
                         "zerodp's llama family has biases only on q, k and v (Qwen2); use a model without them")
    h, heads = get("hidden_size"), get("num_attention_heads")
    kv = get("num_key_value_heads", default=heads)
    if heads % kv:
        raise UserError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    longest = get("max_position_embeddings", default=LLAMA_BLOCK_SIZE)
    block = block_size or min(longest, LLAMA_BLOCK_SIZE)
    window = raw.get("sliding_window") if kind == "mistral" or raw.get("use_sliding_window") else None
    if window is not None and window < block:
        raise refuse(f"sliding_window={window} is shorter than block_size={block}",
                     f"zerodp attends over the whole block, so tokens more than {window} apart would see each "
                     f"other, which this model never did; set model.block_size <= {window}")
    theta, scaling = _rope(raw, where)
    return {"arch": "llama", "n_layer": get("num_hidden_layers"), "n_head": heads, "n_kv_head": kv,
            "head_dim": get("head_dim", default=h // heads), "n_embd": h,
            "intermediate_size": get("intermediate_size"), "vocab_size": get("vocab_size"), "block_size": block,
            "bias": False, "qkv_bias": kind == "qwen2", "tie_embeddings": bool(tied), "norm_eps": float(eps),
            "rope_theta": theta, "rope_scaling": scaling}


def _rope(raw: dict, where: str) -> tuple[float, dict]:
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


def hf_config_from_model(model: dict, dtype: str = "float32", max_positions: int | None = None) -> dict:
    """The config.json of an export of the model a zerodp `model` section (a dict, as in meta.json)
    describes; UserError for a model HF's classes cannot express. `max_positions`: a llama-family
    model's max_position_embeddings (default: its block_size)."""
    from zerodp.models.arch import arch_from_section

    a = arch_from_section(model)
    common = {"vocab_size": a.vocab_size, "tie_word_embeddings": a.tied, "torch_dtype": dtype,
              "bos_token_id": None, "eos_token_id": None, "use_cache": True}
    dropout = float(model.get("dropout") or 0.0)
    if a.family == "gpt2":
        if not a.bias:
            raise UserError("a gpt2 model with model.bias=false has no Hugging Face equivalent (GPT2LMHeadModel "
                            "always has biases); export it with --to safetensors instead")
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": a.n_layer,
                "n_head": a.n_head, "n_embd": a.n_embd, "n_inner": a.ffn, "n_positions": a.block_size,
                "n_ctx": a.block_size, "layer_norm_epsilon": a.norm_eps, "activation_function": "gelu_new",
                "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout, **common}
    qwen = a.qkv_bias  # Qwen2 is Llama with q/k/v biases
    out = {"model_type": "qwen2" if qwen else "llama",
           "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
           "num_hidden_layers": a.n_layer, "num_attention_heads": a.n_head, "num_key_value_heads": a.n_kv_head,
           "head_dim": a.head_dim, "hidden_size": a.n_embd, "intermediate_size": a.ffn,
           "max_position_embeddings": max_positions or a.block_size, "rms_norm_eps": a.norm_eps,
           "rope_theta": a.rope_theta, "rope_scaling": dict(a.rope_scaling) or None, "hidden_act": "silu",
           "attention_dropout": dropout, **common}
    if qwen:
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out
