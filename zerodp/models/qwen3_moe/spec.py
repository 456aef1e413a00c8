"""Qwen3-MoE as data (`model.arch: qwen3_moe`), torch-free: Qwen3's layout (zerodp/models/qwen3/spec.py)
whose sparse blocks hold a router `mlp.gate.weight` (E, C) and E SwiGLU experts stacked in two tensors,
`mlp.experts.gate_up_proj` (E, 2I, C) and `mlp.experts.down_proj` (E, C, I) (transformers' names in
memory); the blocks `model.moe` leaves dense have Llama's MLP. The settings are `model.moe`'s
(zerodp.models.moe_spec). The module is zerodp/models/qwen3_moe/model.py.

Hugging Face files hold each expert apart (`mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`):
EXPERTS says how a stacked tensor is cut into them, and zerodp.convert.experts reads it both ways (HF
folders in, `--to hf` out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodp.errors import UserError
from zerodp.models.llama import spec as llama
from zerodp.models.qwen3 import spec as qwen3

if TYPE_CHECKING:
    from zerodp.models.arch import Arch

MODEL = "Qwen3Moe"
"""The class in zerodp/models/qwen3_moe/model.py."""
MODEL_TYPES = ("qwen3_moe",)
DEFAULT_BIAS = DEFAULT_TIED = LEARNED_POSITIONS = False
EMBEDDING, BLOCK_PREFIX, default_ffn = llama.EMBEDDING, llama.BLOCK_PREFIX, llama.default_ffn
MOE = True
"""model.moe describes its experts (zerodp.models.arch.arch_of reads it)."""

block_shapes = qwen3.block_shapes  # llama's shapes know experts (Arch.is_moe_layer), qwen3's adds q/k norms
param_shapes = llama.param_shapes

NOT_ADAPTED = ("mlp.gate",)
"""Modules with a 2-D weight that low-rank adapters leave alone: the router (transformers' is no nn.Linear,
so PEFT's all-linear skips it too). The stacked experts are 3-D: never a target."""
UNADAPTED = ("mlp.gate", "mlp.experts", "experts", "gate", "gate_up_proj", "experts.gate_up_proj",
             "experts.down_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""model.lora.targets that name the router or the stacked experts: refused in one line that says what takes an
adapter (peft 0.21 can adapt the experts as `target_parameters`, in a layout of its own zerodp neither
trains nor writes)."""
PEFT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
"""Adapter module names peft (0.21, transformers 5) reads on a Qwen3-MoE model as the stacked experts'
parameters: a dense block's MLP adapters cannot be exported for PEFT (zerodp.convert.peft)."""

EXPERTS = {
    "mlp.experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
    "mlp.experts.down_proj": ("down_proj.weight",),
}
"""A stacked expert tensor (its name in a block) -> the per-expert tensors of a Hugging Face file
(`<block>.mlp.experts.{j}.<part>`), concatenated along their first dimension in this order: expert j's
slice of gate_up_proj (2I, C) is its gate_proj (I, C) over its up_proj (I, C); of down_proj (C, I), its
down_proj."""

TABLE = (*qwen3.TABLE, *((n, n, None) for n in (
    "model.layers.{i}.mlp.gate.weight",
    "model.layers.{i}.mlp.experts.gate_up_proj", "model.layers.{i}.mlp.experts.down_proj",
    # a file's tensors: what the stacked ones are written as (EXPERTS, zerodp.convert.experts)
    "model.layers.{i}.mlp.experts.{j}.gate_proj.weight", "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
    "model.layers.{i}.mlp.experts.{j}.down_proj.weight")))
IMPORT_PREFIX, BUFFERS, NORM_EPS_KEY = llama.IMPORT_PREFIX, llama.BUFFERS, llama.NORM_EPS_KEY


def moe_from_hf(raw: dict, get) -> dict:
    """model.moe's keys from a qwen3_moe config.json (transformers writes num_experts as num_local_experts)."""
    return {"num_experts": get("num_experts", "num_local_experts", default=128),
            "num_experts_per_tok": get("num_experts_per_tok", default=8),
            "moe_intermediate_size": get("moe_intermediate_size", default=768),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "decoder_sparse_step": get("decoder_sparse_step", default=1),
            "mlp_only_layers": list(raw.get("mlp_only_layers") or []),
            "router_aux_loss_coef": float(raw.get("router_aux_loss_coef", 0.001))}


def model_config_from_hf(raw: dict, kind: str, get, where: str, block_size: int | None, eps: float) -> dict:
    """The `model.*` keys of a qwen3_moe config.json: qwen3's, and the experts in `moe`."""
    return {**qwen3.model_config_from_hf(raw, kind, get, where, block_size, eps), "arch": "qwen3_moe",
            "moe": moe_from_hf(raw, get)}


def hf_config(a: Arch, common: dict, dropout: float, max_positions: int | None) -> dict:
    """The config.json of an export (Qwen3MoeForCausalLM)."""
    if a.qkv_bias:
        raise UserError("a qwen3_moe model with model.qkv_bias=true has no Hugging Face equivalent (Qwen3's "
                        "attention_bias puts a bias on o_proj too); export it with --to safetensors instead")
    return {**qwen3.hf_config(a, common, dropout, max_positions), "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"], "num_experts": a.n_experts,
            "num_experts_per_tok": a.experts_per_token, "moe_intermediate_size": a.expert_ffn,
            "norm_topk_prob": a.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": list(a.dense_layers),
            "output_router_logits": False}


PLANNER_DEFAULTS = {"qwen3_moe": {"num_key_value_heads": 4, "head_dim": qwen3.HEAD_DIM}}
"""Qwen3MoeConfig's defaults where they are not llama's."""


def planner_arch(given: dict, kind: str, get) -> Arch:
    """The Arch transformers builds from a qwen3_moe config.json: every expert counted, the dense blocks
    (mlp_only_layers, decoder_sparse_step) with an MLP of intermediate_size."""
    from zerodp.models.moe_spec import moe_spec

    moe = moe_spec({k: v for k, v in moe_from_hf(given, get).items()})
    return llama.planner_arch(given, kind, get, family="qwen3_moe", **_moe_fields(moe, get("num_hidden_layers")))


def _moe_fields(moe, n_layer: int, ffn: int | None = None) -> dict:
    """The Arch fields of a MoeSpec."""
    return {"n_experts": moe.num_experts, "experts_per_token": moe.num_experts_per_tok,
            "expert_ffn": moe.moe_intermediate_size or ffn, "norm_topk_prob": moe.norm_topk_prob,
            "dense_layers": moe.dense_layers(n_layer)}


def _preset(hidden: int, n_layer: int, heads: int, ffn: int, expert_ffn: int):
    from zerodp.models.moe_spec import MoeSpec

    moe = MoeSpec(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=expert_ffn, norm_topk_prob=True)
    return llama.llama_arch(hidden, n_layer, heads, 4, ffn, 151936, 40960, head_dim=128, family="qwen3_moe",
                            **_moe_fields(moe, n_layer))


# Published shapes (the models' config.json files).
PRESETS = {
    "qwen3-30b-a3b": lambda: _preset(2048, 48, 32, 6144, 768),
    "qwen3-235b-a22b": lambda: _preset(4096, 94, 64, 12288, 1536),
}
