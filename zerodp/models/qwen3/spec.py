"""Qwen3 as data (`model.arch: qwen3`), torch-free: the Llama layout (zerodp/models/llama/spec.py) plus
an RMSNorm over each head's q and k (`q_norm`, `k_norm`, one weight of head_dim each per block), before
the rotary embedding. head_dim is free of the width (Qwen3's is 128 at every size); tied or untied head.
The module is zerodp/models/qwen3/model.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodp.errors import UserError
from zerodp.models.llama import spec as llama

if TYPE_CHECKING:
    from zerodp.models.arch import Arch

MODEL = "Qwen3"
"""The class in zerodp/models/qwen3/model.py."""
MODEL_TYPES = ("qwen3",)
DEFAULT_BIAS = DEFAULT_TIED = LEARNED_POSITIONS = False
EMBEDDING, BLOCK_PREFIX, default_ffn = llama.EMBEDDING, llama.BLOCK_PREFIX, llama.default_ffn
HEAD_DIM = 128
"""Qwen3Config's head_dim: what a config.json without one means."""


def block_shapes(a: Arch, layer: int) -> dict[str, tuple[int, ...]]:
    out = llama.block_shapes(a, layer)
    out.update({"self_attn.q_norm.weight": (a.head_dim,), "self_attn.k_norm.weight": (a.head_dim,)})
    return dict(sorted(out.items()))


param_shapes = llama.param_shapes  # reads a.block_shapes, which is this family's

TABLE = (*llama.TABLE, *((n, n, None) for n in ("model.layers.{i}.self_attn.q_norm.weight",
                                                   "model.layers.{i}.self_attn.k_norm.weight")))
IMPORT_PREFIX, BUFFERS, NORM_EPS_KEY = llama.IMPORT_PREFIX, llama.BUFFERS, llama.NORM_EPS_KEY


def model_config_from_hf(raw: dict, kind: str, get, where: str, block_size: int | None, eps: float) -> dict:
    """The `model.*` keys of a qwen3 config.json: llama's reading, head_dim 128 when the file has none."""
    return {**llama.model_config_from_hf(raw, kind, get, where, block_size, eps, default_head_dim=HEAD_DIM),
            "arch": "qwen3", "qkv_bias": False}


def hf_config(a: Arch, common: dict, dropout: float, max_positions: int | None) -> dict:
    """The config.json of an export (Qwen3ForCausalLM)."""
    if a.qkv_bias:
        raise UserError("a qwen3 model with model.qkv_bias=true has no Hugging Face equivalent (Qwen3's "
                        "attention_bias puts a bias on o_proj too); export it with --to safetensors instead")
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            **llama.rotary_config(a, dropout, max_positions), "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, **common}


PLANNER_DEFAULTS = {"qwen3": {"num_key_value_heads": 32, "head_dim": HEAD_DIM}}
"""Qwen3Config's defaults where they are not llama's."""


def planner_arch(given: dict, kind: str, get) -> Arch:
    """The Arch transformers builds from a qwen3 config.json (attention_bias: q, k, v and o biases)."""
    return llama.planner_arch(given, kind, get, family="qwen3")


# Published shapes (the models' config.json files); tests/unit/test_planner_hf.py compares with transformers.
PRESETS = {
    "qwen3-0.6b": lambda: llama.llama_arch(1024, 28, 16, 8, 3072, 151936, 40960, tied=True, head_dim=128,
                                           family="qwen3"),
    "qwen3-8b": lambda: llama.llama_arch(4096, 36, 32, 8, 12288, 151936, 40960, head_dim=128, family="qwen3"),
}
