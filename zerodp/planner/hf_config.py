"""A Hugging Face config.json, read offline into the `Arch` transformers would build from it.

`zerodp plan --hf-config` reads the model types zerodp trains (each family's MODEL_TYPES: gpt2; llama,
mistral and qwen2; qwen3), through the family's own `planner_arch` (zerodp/models/<family>/spec.py),
and five it only plans (gemma, gemma2, phi3, and the mixtures of experts mixtral and qwen2_moe; see
zerodp/models/arch.py), read here. A key the file leaves out takes the default transformers'
configuration class gives it, so the count is the one `from_config` builds (tests/unit/test_planner_hf.py
builds each under torch.device("meta") and compares every name and shape). Imports neither torch nor
transformers.

zerodp.models.hf.model_config_from_hf maps the trainable types to a `model:` section, refusing what
zerodp cannot train exactly (Llama's attention_bias/mlp_bias, other activations, a sliding window
shorter than the context, YaRN rope) and capping the context at 4096; the planner must still count
those, so it reads them here, and tests/unit/test_planner_hf.py pins that both give the same shapes
wherever the trainable mapping accepts a config.
"""

from __future__ import annotations

from pathlib import Path

from zerodp.errors import UserError
from zerodp.models.arch import Arch, spec_of
from zerodp.models.hf import FAMILY_OF_TYPE, REQUIRED, config_int, read_hf_config as _read
from zerodp.models.llama.spec import planner_arch as llama_layout

PLANNER_ONLY = ("gemma", "gemma2", "phi3", "mixtral", "qwen2_moe")
SUPPORTED = (*FAMILY_OF_TYPE, *PLANNER_ONLY)

# transformers' defaults (models/*/configuration_*.py) for the keys that change a shape, where they are
# not llama's (num_key_value_heads = num_attention_heads, head_dim = hidden_size / num_attention_heads,
# untied head, no biases): a key the file omits takes these; one it sets to null falls back to llama's.
# The trainable families' are in their specs (PLANNER_DEFAULTS).
_DEFAULTS = {
    "gemma": {"num_key_value_heads": 16, "head_dim": 256, "tie_word_embeddings": True},
    "gemma2": {"num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True},
    "mixtral": {"num_key_value_heads": 8, "num_experts_per_tok": 2},  # num_local_experts: 8, below
    "qwen2_moe": {"num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True},
}


def read_hf_config(path: str) -> tuple[dict, Path]:
    """(the parsed config.json, its path) of a model folder or a config.json; UserError if unreadable."""
    return _read(path, what="--hf-config")


def arch_from_hf(raw: dict, where: str = "--hf-config") -> Arch:
    """The Arch of the model a config.json describes (see SUPPORTED). `where` begins error messages."""
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"{where}: model_type {kind!r} is not supported; the planner reads "
                        f"{', '.join(SUPPORTED)} configs (for others use --params with --layers/--hidden)")
    family = FAMILY_OF_TYPE.get(kind)
    defaults = spec_of(family).PLANNER_DEFAULTS if family else _DEFAULTS
    given = {**defaults.get(kind, {}), **raw}

    def get(key: str, *alts: str, default=REQUIRED) -> int:
        return config_int(given, key, *alts, default=default, where=where, kind=kind)

    if family:
        return spec_of(family).planner_arch(given, kind, get)
    moe: dict = {}
    if kind == "mixtral":
        moe = dict(n_experts=get("num_local_experts", "num_experts", default=8),  # num_experts: transformers' alias
                   experts_per_token=get("num_experts_per_tok"), expert_ffn=get("intermediate_size"))
    elif kind == "qwen2_moe":
        layers = get("num_hidden_layers")
        step, dense = get("decoder_sparse_step"), set(given.get("mlp_only_layers") or ())
        moe = dict(n_experts=get("num_experts"), experts_per_token=get("num_experts_per_tok"),
                   expert_ffn=get("moe_intermediate_size"), shared_expert_ffn=get("shared_expert_intermediate_size"),
                   dense_layers=tuple(i for i in range(layers) if i in dense or (i + 1) % step))
    if moe and moe["experts_per_token"] > moe["n_experts"]:
        raise UserError(f"{where}: num_experts_per_tok={moe['experts_per_token']} exceeds the "
                        f"{moe['n_experts']} experts")
    return llama_layout(given, kind, get, family=kind, **moe)
