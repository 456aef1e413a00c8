"""GPT-2 as data (`model.arch: gpt2`), torch-free: parameter names and shapes, the Hugging Face name
table, config.json in both directions, the planner's presets. The module is zerodp/models/gpt2/model.py.

Learned positions, LayerNorm, GELU MLP (4h), one fused c_attn, biases iff `bias`, tied head. With GPT-2's
dimensions (12 layers, 12 heads, 768 wide, vocab 50257, context 1024) it has GPT-2's 124,439,808
parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodp.errors import UserError

if TYPE_CHECKING:
    from zerodp.models.arch import Arch

MODEL = "GPT"
"""The class in zerodp/models/gpt2/model.py."""
MODEL_TYPES = ("gpt2",)
"""Hugging Face model_type values this family reads (GPT2LMHeadModel, or a bare GPT2Model)."""
DEFAULT_BIAS = DEFAULT_TIED = True
LEARNED_POSITIONS = True
"""A position table of block_size rows: the block size is a property of the weights."""
EMBEDDING = "transformer.wte.weight"
BLOCK_PREFIX = "transformer.h"


def default_ffn(n_embd: int) -> int:
    return 4 * n_embd


def block_shapes(a: Arch, layer: int) -> dict[str, tuple[int, ...]]:
    h, f = a.n_embd, a.ffn
    out = {"ln_1.weight": (h,), "attn.c_attn.weight": (3 * h, h), "attn.c_proj.weight": (h, h),
           "ln_2.weight": (h,), "mlp.c_fc.weight": (f, h), "mlp.c_proj.weight": (h, f)}
    if a.bias:
        out.update({"ln_1.bias": (h,), "attn.c_attn.bias": (3 * h,), "attn.c_proj.bias": (h,),
                    "ln_2.bias": (h,), "mlp.c_fc.bias": (f,), "mlp.c_proj.bias": (h,)})
    return dict(sorted(out.items()))


def param_shapes(a: Arch) -> dict[str, tuple[int, ...]]:
    h = a.n_embd
    out = {EMBEDDING: (a.vocab_size, h), "transformer.wpe.weight": (a.block_size, h)}
    for i in range(a.n_layer):
        out.update({f"{BLOCK_PREFIX}.{i}.{k}": s for k, s in block_shapes(a, i).items()})
    out["transformer.ln_f.weight"] = (h,)
    if a.bias:
        out["transformer.ln_f.bias"] = (h,)
    if not a.tied:
        out["lm_head.weight"] = (a.vocab_size, h)
    return out


# ---- Hugging Face names: (zerodp name, HF name, transform); `{i}` is a block's index ----------------

TRANSPOSE = "transpose"
"""HF's GPT-2 Conv1D keeps a weight as (in, out), torch's nn.Linear as (out, in). Its own inverse."""


def _same(*names: str, transform: str | None = None) -> tuple:
    return tuple((n, n, transform) for n in names)


TABLE = (
    *_same("transformer.wte.weight", "transformer.wpe.weight",
           "transformer.h.{i}.ln_1.weight", "transformer.h.{i}.ln_1.bias",
           "transformer.h.{i}.attn.c_attn.bias", "transformer.h.{i}.attn.c_proj.bias",
           "transformer.h.{i}.ln_2.weight", "transformer.h.{i}.ln_2.bias",
           "transformer.h.{i}.mlp.c_fc.bias", "transformer.h.{i}.mlp.c_proj.bias",
           "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"),
    *_same("transformer.h.{i}.attn.c_attn.weight", "transformer.h.{i}.attn.c_proj.weight",
           "transformer.h.{i}.mlp.c_fc.weight", "transformer.h.{i}.mlp.c_proj.weight", transform=TRANSPOSE),
)
IMPORT_PREFIX = "transformer."
"""The prefix a bare GPT2Model (no LM head) lacks: read on import only."""
BUFFERS = ("transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias")
"""Tensors in HF files that are not parameters (the causal-mask buffers): ignored on import."""


# ---- config.json <-> model.* keys ------------------------------------------------------------------

NORM_EPS_KEY = "layer_norm_epsilon"


def model_config_from_hf(raw: dict, kind: str, get, where: str, block_size: int | None, eps: float) -> dict:
    """The `model.*` keys of a GPT-2 config.json (see zerodp.models.hf.model_config_from_hf); the file's
    n_positions is the block size whatever `block_size` says: the position table's size."""
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"{where}: activation_function {act!r} is not supported; "
                        f"zerodp's gpt2 computes GELU's tanh approximation (gelu_new)")
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
        raise UserError(f"{where}: scale_attn_by_inverse_layer_idx/scale_attn_weights differ from GPT-2's; "
                        f"zerodp's gpt2 scales attention by 1/sqrt(head_dim) in every layer")
    h, heads = get("n_embd"), get("n_head")
    return {"arch": "gpt2", "n_layer": get("n_layer"), "n_head": heads, "n_kv_head": heads, "head_dim": None,
            "n_embd": h, "intermediate_size": get("n_inner", default=4 * h),
            "vocab_size": get("vocab_size"), "block_size": get("n_positions", "n_ctx"), "bias": True,
            "qkv_bias": False, "tie_embeddings": bool(raw.get("tie_word_embeddings", True)), "norm_eps": eps}


def hf_config(a: Arch, common: dict, dropout: float, max_positions: int | None) -> dict:
    """The config.json of an export (GPT2LMHeadModel)."""
    if not a.bias:
        raise UserError("a gpt2 model with model.bias=false has no Hugging Face equivalent (GPT2LMHeadModel "
                        "always has biases); export it with --to safetensors instead")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": a.n_layer,
            "n_head": a.n_head, "n_embd": a.n_embd, "n_inner": a.ffn, "n_positions": a.block_size,
            "n_ctx": a.block_size, "layer_norm_epsilon": a.norm_eps, "activation_function": "gelu_new",
            "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout, **common}


# ---- the planner ---------------------------------------------------------------------------------

PLANNER_DEFAULTS = {"gpt2": {"tie_word_embeddings": True}}
"""transformers' defaults for the shape keys a config.json may omit (GPT2Config)."""


def planner_arch(given: dict, kind: str, get) -> Arch:
    """The Arch transformers builds from a GPT-2 config.json (`given`: the file over PLANNER_DEFAULTS)."""
    from zerodp.models.arch import Arch

    h, heads = get("n_embd"), get("n_head")
    return Arch("gpt2", n_layer=get("n_layer"), n_embd=h, n_head=heads, n_kv_head=heads, head_dim=h // heads,
                ffn=get("n_inner", default=4 * h), vocab_size=get("vocab_size"),
                block_size=get("n_positions", "n_ctx"), bias=True, qkv_bias=False,
                tied=bool(given.get("tie_word_embeddings", False)))


def gpt2_arch(n_layer: int, n_head: int, n_embd: int, vocab_size: int = 50257, n_positions: int = 1024,
              bias: bool = True, ffn: int | None = None, tied: bool = True) -> Arch:
    """GPT-2's architecture (zerodp's GPT is one)."""
    from zerodp.models.arch import Arch

    return Arch("gpt2", n_layer, n_embd, n_head, n_head, n_embd // n_head, ffn or default_ffn(n_embd),
                vocab_size, n_positions, bias, False, tied)


# Published shapes (the models' config.json files); counts pinned in tests/unit/test_planner.py.
PRESETS = {
    "gpt2": lambda: gpt2_arch(12, 12, 768),
    "gpt2-medium": lambda: gpt2_arch(24, 16, 1024),
    "gpt2-large": lambda: gpt2_arch(36, 20, 1280),
    "gpt2-xl": lambda: gpt2_arch(48, 25, 1600),
}
