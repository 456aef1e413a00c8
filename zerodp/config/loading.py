"""Loading a config: strict YAML, `section.key=value` overrides, the Hugging Face config.json merge
(model.hf_config), a `zerodp prepare` folder's vocabulary, the model keys' family defaults, and what the
user set apart from what was resolved (`--dry-run`). Torch-free."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from zerodp.config.checks import _one_of
from zerodp.config.schema import _SECTIONS, ARCHS, Config, ModelConfig, _field_types, _section_types
from zerodp.errors import ConfigError, UserError


def _coerce(where: str, key: str, value: Any, typ: Any) -> Any:
    """Check `value` against the declared type `typ`; return it converted where lossless."""
    origin = typing.get_origin(typ)
    if origin is typing.Union and set(typing.get_args(typ)) == {int, str}:  # a count, or 'auto'
        if value == "auto":
            return value
        try:
            return _coerce(where, key, value, int)
        except ConfigError:
            raise ConfigError(f"{key} in {where} must be an integer or auto, got {value!r}") from None
    if origin is typing.Union and set(typing.get_args(typ)) == {bool, str}:  # a switch, or a named mode
        if isinstance(value, (bool, str)):
            return value
        raise ConfigError(f"{key} in {where} must be true, false or a mode's name, got {value!r}")
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(typ) if a is not type(None)]
        return _coerce(where, key, value, inner)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} in {where} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:  # YAML reads 1e6 as a string; accept it when it is a whole number
                f = float(value)
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
        raise ConfigError(f"{key} in {where} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads 3e-4 (no dot) as a string
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} in {where} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} in {where} must be a string, got {value!r}")
    if typ is list:
        if value is None:
            return []
        if isinstance(value, list):
            return _numbers(value)
        raise ConfigError(f"{key} in {where} must be a list, got {value!r}")
    if typ is dict:
        if value is None:  # an empty YAML section (`deepspeed:`)
            return {}
        if isinstance(value, dict):
            return _numbers(value)
        raise ConfigError(f"{key} in {where} must be a mapping, got {value!r}")
    raise AssertionError(f"unhandled config type {typ}")


def _numbers(value: Any) -> Any:
    """Recursively turn number-like strings (YAML 1.1 reads 1e6 and 3e-4 as strings) into numbers in a
    free-form mapping. Only plain decimal forms: 'inf', 'nan' or '1_000' stay strings."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if not isinstance(value, str) or not _NUMBER.fullmatch(value):
        return value
    number = float(value)
    return int(number) if number.is_integer() and "." not in value else number


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _unknown(key: str, valid, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown key {key!r} in {where}{hint}")


def from_dict(raw: dict, where: str = "config") -> Config:
    """Build a validated-type Config from nested dicts, rejecting unknown keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of sections (model:, train:, ...), got {type(raw).__name__}")
    sections = _section_types()
    built = {}
    for name, body in raw.items():
        if name not in sections:
            raise _unknown(str(name), sections, where)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f"section {name!r} in {where} must be a mapping of keys, got {body!r}")
        cls = sections[name]
        types = _field_types(cls)
        kwargs = {}
        for key, value in body.items():
            if key not in types:
                raise _unknown(f"{name}.{key}", [f"{name}.{k}" for k in types], where)
            kwargs[key] = _coerce(where, f"{name}.{key}", value, types[key])
        built[name] = cls(**kwargs)
    return Config(**built)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse `section.key=value` (value read as YAML, so 3e-4, true, null work)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. train.max_steps=50)")
    path, value = text.split("=", 1)
    section, key = path.split(".", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return section, key, parsed


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or start from defaults when path is None), apply overrides, validate."""
    raw, where = _read(path, overrides)
    cfg = from_dict(raw, where)
    given = {k for k, v in (raw.get("model") or {}).items() if v is not None}
    if cfg.model.hf_config:
        apply_hf_config(cfg.model, given, where)
    elif "vocab_size" not in given:
        take_prepared_vocab(cfg)
    return resolve_model(cfg).validate()


def _read(path: str | os.PathLike | None, overrides: list[str]) -> tuple[dict, str]:
    """The sections the YAML at `path` holds with `overrides` applied, as nested dicts (nothing checked
    beyond the YAML and the overrides' form), and what errors call it: 'configs/tiny.yaml (with overrides)'."""
    raw: dict = {}
    where = "defaults"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found; pass a path such as configs/tiny.yaml")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"{p} is not UTF-8 text; save the config as UTF-8 YAML") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "invalid YAML"
            raise ConfigError(f"YAML syntax error in {p}{at}: {problem}; fix the file's indentation/quoting") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p} must be a mapping of sections (model:, train:, ...)")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        body = raw.setdefault(section, {})
        if not isinstance(body, dict):
            body = raw[section] = {}
        if (section, key.partition(".")[0]) in NESTED and "." in key:
            _set_nested(body, key.split("."), value, section)
        else:
            body[key] = value
    return raw, where if not overrides else f"{where} (with overrides)"


def user_settings(path: str | os.PathLike | None, overrides: list[str] = ()) -> dict[str, Any]:
    """`section.key` -> value, typed as the schema reads it, for every key the YAML at `path` or an override
    sets (a strategy.deepspeed.* override as strategy.deepspeed), before anything is filled in: what the
    user wrote, as opposed to what load_config resolves (model.arch's defaults, model.hf_config)."""
    raw, where = _read(path, overrides)
    typed = from_dict(raw, where)
    return {f"{section}.{key}": getattr(getattr(typed, section), key)
            for section, body in raw.items() if isinstance(body, dict) for key in body}


def take_prepared_vocab(cfg: Config) -> Config:
    """model.vocab_size from meta.json when data.source is a `zerodp prepare` folder (the caller knows the
    config leaves the key unset), said on stderr by rank 0 (every rank loads the config). The resolved
    config, config.yaml and a checkpoint's meta.json then record the number, so a resume of the same
    command finds the same model. Returns cfg, changed in place."""
    from zerodp.config.sources import prepared_meta, primary_source

    source = primary_source(cfg.data)
    if source == "builtin":
        return cfg
    vocab = (prepared_meta(source) or {}).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return cfg  # not a prepare folder, or a damaged meta.json that loading the data reports
    cfg.model.vocab_size = vocab
    if os.environ.get("RANK", "0") == "0":
        print(f"zerodp: model.vocab_size={vocab} taken from {Path(source) / 'meta.json'} (the tokenizer's "
              f"vocabulary; the config leaves model.vocab_size unset)", file=sys.stderr, flush=True)
    return cfg


def apply_hf_config(m: ModelConfig, given: set[str], where: str = "the config") -> ModelConfig:
    """Set arch and every dimension from the Hugging Face config.json `m.hf_config` names (before
    resolve_model). A key in `given` (set in the YAML or an override) must agree with the file, else a
    ConfigError names both values; a llama-family model's block_size is the exception: the length to
    train at, not a property of the weights (zerodp.models.hf.model_config_from_hf). Returns m."""
    from zerodp.models.hf import model_config_from_hf, read_hf_config

    if m.init_from and not Path(m.hf_config).exists() and Path(m.hf_config) in (Path(m.init_from),
                                                                               Path(m.init_from) / "config.json"):
        raise ConfigError(f"the base model {m.init_from} (model.init_from and model.hf_config) is not here; run where "
                          f"it is, or copy it to that path")
    try:
        raw, path = read_hf_config(m.hf_config)
        derived = model_config_from_hf(raw, str(path), m.block_size if "block_size" in given else None)
    except UserError as e:
        raise ConfigError(str(e)) from None
    for key, value in derived.items():
        if value is None:
            continue
        if key not in given:
            setattr(m, key, value)
        elif key == "moe":  # the experts are the file's; the balance settings may be the user's
            setattr(m, key, {**value, **_agreeing(m.moe, value, path)})
        elif getattr(m, key) != value:
            raise ConfigError(f"model.{key}={getattr(m, key)!r} in {where} contradicts model.hf_config {path}, which "
                              f"gives {key}={value!r}; remove model.{key} or set it to {value!r}")
    return m


def _agreeing(given: dict, derived: dict, path) -> dict:
    """model.moe's keys `given` by the user, each equal to the file's where the file sets it."""
    for key, value in (given or {}).items():
        if key in derived and key not in ("balance", "router_aux_loss_coef") and derived[key] != value:
            raise ConfigError(f"model.moe.{key}={value!r} contradicts model.hf_config {path}, which gives "
                              f"{key}={derived[key]!r}; remove model.moe.{key} or set it to {derived[key]!r}")
    return dict(given or {})


def resolve_model(cfg: Config) -> Config:
    """Fill the model keys left null with their architecture's defaults, so that the resolved config
    (config.yaml, a checkpoint's meta.json) records every dimension. Returns cfg, changed in place."""
    m = cfg.model
    _one_of("model.arch", m.arch, ARCHS)
    if m.bias is None:
        m.bias = m.arch == "gpt2"
    if m.tie_embeddings is None:
        m.tie_embeddings = m.arch == "gpt2"
    if m.n_kv_head is None:
        m.n_kv_head = m.n_head
    return cfg


NESTED = {("strategy", "deepspeed"), ("model", "lora"), ("model", "moe"), ("model", "rope_scaling")}
"""The mappings an override reaches into: strategy.deepspeed.a.b=1, model.lora.rank=16."""


def _set_nested(d: dict, keys: list[str], value: Any, section: str = "strategy") -> None:
    """d[k0][k1]...[kn] = value for an override such as strategy.deepspeed.a.b=value, creating mappings."""
    for i, k in enumerate(keys[:-1]):
        if d.get(k) is None:
            d[k] = {}
        if not isinstance(d[k], dict):
            path = ".".join([section, *keys[: i + 1]])
            raise ConfigError(f"{path} is {d[k]!r}, not a mapping, so {section}.{'.'.join(keys)} cannot be set "
                              f"inside it; remove one of the two settings")
        d = d[k]
    d[keys[-1]] = value


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def set_and_resolved(given: dict[str, Any], cfg: Config) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """What `--dry-run` lists, each as (section.key, value) in the schema's order: the keys `given` (from
    user_settings) sets to something other than their default, with the value given; and the keys where
    `cfg`, the config to run, holds something the user did not set: neither the value given nor, for a key
    not given, the default (model.arch's defaults for keys left null, model.hf_config's dimensions, the
    planner's choices for strategy.name and train.micro_batch_size auto)."""
    defaults, mine, resolved = Config(), [], []
    for section in _SECTIONS:
        for f in dataclasses.fields(getattr(defaults, section)):
            key, default = f"{section}.{f.name}", getattr(getattr(defaults, section), f.name)
            wrote, value = given.get(key, default), getattr(getattr(cfg, section), f.name)
            if key in given and wrote != default:
                mine.append((key, wrote))
            if value != wrote:
                resolved.append((key, value))
    return mine, resolved
