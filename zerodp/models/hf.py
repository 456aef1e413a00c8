"""The Hugging Face mapping, as data read in both directions: parameter names and layouts (each family's
TABLE in its spec, zerodp/models/<family>/spec.py: zerodp name, HF name, transform) and config.json <->
the `model.*` keys of zerodp's config.

    model_config_from_hf(json.load(open("config.json")))   # {"arch": "llama", "n_layer": 32, ...}
    hf_config_from_model(meta["config"]["model"])          # the config.json of an export
    to_hf("gpt2", "transformer.h.3.attn.c_attn.weight")    # ("transformer.h.3.attn.c_attn.weight", "transpose")
    from_hf("gpt2", "h.3.attn.c_attn.weight")              # ("transformer.h.3.attn.c_attn.weight", "transpose")

Model types read: each family's MODEL_TYPES (gpt2: gpt2, a GPT2LMHeadModel or a bare GPT2Model; llama:
llama, mistral, qwen2; qwen3: qwen3; qwen3_moe: qwen3_moe). Imports neither torch nor transformers: the planner
(`zerodp plan --hf-config`) reads it too.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from zerodp.errors import UserError
from zerodp.models.arch import FAMILIES, spec_of
from zerodp.models.gpt2.spec import TRANSPOSE  # the one transform; re-exported
from zerodp.models.llama.spec import BLOCK_SIZE as LLAMA_BLOCK_SIZE  # noqa: F401

FAMILY_OF_TYPE = {kind: family for family in FAMILIES for kind in spec_of(family).MODEL_TYPES}
"""Hugging Face model_type -> the zerodp family that reads it."""
SUPPORTED = tuple(FAMILY_OF_TYPE)


def _pattern(p: str) -> re.Pattern:
    """{i} (a block) and {j} (an expert) match a number each."""
    return re.compile(re.escape(p).replace(re.escape("{i}"), r"(\d+)").replace(re.escape("{j}"), r"(\d+)"))


@functools.cache
def _compiled(family: str) -> list:
    return [(_pattern(z), _pattern(h), z, h, t) for z, h, t in spec_of(family).TABLE]


@functools.cache
def _buffers(family: str) -> list:
    return [_pattern(b) for b in spec_of(family).BUFFERS]


def _fill(pattern: str, m: re.Match) -> str:
    for key, value in zip(("{i}", "{j}"), m.groups()):
        pattern = pattern.replace(key, value)
    return pattern


def to_hf(family: str, name: str) -> tuple[str, str | None] | None:
    """(HF name, transform) of zerodp parameter `name`, or None if the table has no row for it."""
    for zp, _, _, hf, t in _compiled(family):
        if m := zp.fullmatch(name):
            return _fill(hf, m), t
    return None


def from_hf(family: str, name: str) -> tuple[str, str | None] | None:
    """(zerodp name, transform) of HF tensor `name` (GPT2Model's unprefixed names too), or None if the
    table has no row for it."""
    for candidate in (name, spec_of(family).IMPORT_PREFIX + name):
        for _, hp, zp, _, t in _compiled(family):
            if m := hp.fullmatch(candidate):
                return _fill(zp, m), t
    return None


def is_buffer(family: str, name: str) -> bool:
    """A tensor HF files may hold that is not a parameter (ignored on import)."""
    prefix = spec_of(family).IMPORT_PREFIX
    return any(b.fullmatch(c) for c in (name, prefix + name) for b in _buffers(family))


def transposed(shape: tuple, transform: str | None) -> tuple:
    return tuple(shape)[::-1] if transform == TRANSPOSE else tuple(shape)


def family_of_names(names) -> str | None:
    """The first family (gpt2, llama, qwen3) whose table names the tensors (None when none does)."""
    for family in FAMILIES:
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

    spec = spec_of(FAMILY_OF_TYPE[kind])
    eps = raw.get(spec.NORM_EPS_KEY, 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise UserError(f"{where}: {spec.NORM_EPS_KEY}={eps!r} must be a positive number")
    return spec.model_config_from_hf(raw, kind, get, where, block_size, float(eps))


def hf_config_from_model(model: dict, dtype: str = "float32", max_positions: int | None = None) -> dict:
    """The config.json of an export of the model a zerodp `model` section (a dict, as in meta.json)
    describes; UserError for a model HF's classes cannot express. `max_positions`: a llama-family
    model's max_position_embeddings (default: its block_size)."""
    from zerodp.models.arch import arch_from_section

    a = arch_from_section(model)
    common = {"vocab_size": a.vocab_size, "tie_word_embeddings": a.tied, "torch_dtype": dtype,
              "bos_token_id": None, "eos_token_id": None, "use_cache": True}
    out = a.spec.hf_config(a, common, float(model.get("dropout") or 0.0), max_positions)
    if a.n_experts:  # the balance loss's weight: a training setting the config.json keeps
        from zerodp.models.moe_spec import moe_spec

        out["router_aux_loss_coef"] = moe_spec(model.get("moe")).router_aux_loss_coef
    return out


# ---- the model a run started from ------------------------------------------------------------------

ORIGIN = "hf_origin"
"""The key under which a checkpoint (meta.json) or an export (`zerodp.hf_origin` in its metadata) records
the config.json of the Hugging Face model its weights started from."""


def origin_config(hf_config: str | None, init_from: str | None) -> dict | None:
    """The config.json (as a dict) of the Hugging Face model a run starts from: model.hf_config's, else
    the one in (or beside) model.init_from when that is a Hugging Face folder or file, or the one a zerodp
    step folder given as model.init_from records (ORIGIN: a fine-tune of a fine-tune); None for a model
    trained from scratch. An export keeps that model's context and rope settings
    (zerodp.convert.writers.write_hf), not the length the run trained at."""
    for given in (hf_config, init_from):
        if not given:
            continue
        p = Path(given)
        try:
            recorded = json.loads((p / "meta.json").read_text(encoding="utf-8")).get(ORIGIN) if p.is_dir() else None
        except (OSError, ValueError, AttributeError):
            recorded = None
        if isinstance(recorded, dict):
            return recorded
        for candidate in (p / "config.json", p.parent / "config.json") if p.suffix != ".json" else (p,):
            try:
                raw = json.loads(candidate.read_text(encoding="utf-8")) if candidate.is_file() else None
            except (OSError, ValueError):
                raw = None
            if isinstance(raw, dict) and raw.get("model_type") in SUPPORTED:
                return raw
    return None


def origin_of(meta: dict) -> dict:
    """The Hugging Face config.json a checkpoint's weights came from: its own (an HF folder's, read by
    zerodp.convert.hf) or the one it records (ORIGIN); {} for a model trained from scratch."""
    return meta.get("hf_config") or meta.get(ORIGIN) or {}
