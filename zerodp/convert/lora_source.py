"""A LoRA model as one checkpoint source: the frozen base's weights with the adapters beside them, or
merged into them (W + alpha / r B A), whatever holds the adapters (a LoRA run's checkpoint, which keeps
the adapters alone, or a PEFT adapter folder) and wherever the base comes from.

    with open_model(path) as source:          # any checkpoint; a LoRA one (or a PEFT folder) with its base
        model = zerodp.api.model_from_source(source)
    with open_model(ckpt, merged=True) as merged:
        write_hf(merged, "exports/merged")     # the full model, in Hugging Face's layout

The base of a LoRA run is what its checkpoint records (meta.json's `lora.base`, else the run's config):
`model.init_from`'s weights, read through zerodp.convert (any format), or, without one, the model's
initial values for train.seed (DecoderLM.initial_values: a pure function of seed and name). The base
of a PEFT folder is its adapter_config.json's base_model_name_or_path, a folder zerodp reads. Tensors
are fp32, in zerodp's names and layouts, read one at a time (the adapters, small, are read at open).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from zerodp.convert.source import CheckpointSource, TensorInfo
from zerodp.errors import CheckpointError, UserError
from zerodp.models.lora_spec import LoraSpec, adapter_shapes, is_adapter, lora_spec


def recorded_lora(meta: dict) -> dict | None:
    """The LoRA settings a checkpoint records, with its base ({"init_from", "seed"}): meta.json's `lora`
    (rank, alpha, dropout, targets, init_from, base), else its config's model.lora; None for a checkpoint
    of a model without adapters."""
    config = meta.get("config") or {}
    rec = meta.get("lora")
    if not rec:
        section = (config.get("model") or {}).get("lora")
        if not section:
            return None
        rec = lora_spec(section).to_dict()
    base = dict(rec.get("base") or {})
    base.setdefault("init_from", (config.get("model") or {}).get("init_from"))
    base.setdefault("seed", (config.get("train") or {}).get("seed", 0))
    return {**rec, "base": base}


def spec_of_record(rec: dict) -> LoraSpec:
    return lora_spec({k: rec[k] for k in ("rank", "alpha", "dropout", "targets") if k in rec})


class _Base:
    """The base model's weights by zerodp's names: read from a checkpoint (`init_from`), or the initial
    values for `seed`."""

    def __init__(self, model_cfg, init_from: str | None, seed: int):
        from zerodp.models import build_model
        from zerodp.models.arch import arch_of

        self.arch = arch_of(model_cfg)
        self.shapes = self.arch.param_shapes()
        self.source = self.state = None
        self.what = f"{init_from}" if init_from else f"the initial weights of seed {seed}"
        if init_from:
            from zerodp.convert import open_checkpoint
            from zerodp.convert.full_state import FullState

            if not Path(init_from).exists():
                raise UserError(f"the base model {init_from} (the run's model.init_from) is not here; run where it "
                                f"is, or copy it to that path")
            self.source = open_checkpoint(init_from)
            self.state = FullState(self.source, with_optimizer=False)
            problem = self.state.mismatch(self.shapes)
            if problem:
                self.source.close()
                raise CheckpointError(f"the base model {init_from} is not the model the adapters were trained on "
                                      f"({problem})")
        else:  # built on the meta device: each tensor's values are computed when asked for
            self.model, self.seed = build_model(model_cfg, device="meta"), seed

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if self.state is not None:
            return self.state.get(name, "param", shape)
        return self.model.initial_values(name, self.seed).view(shape)

    def files(self) -> list[Path]:
        return list(self.source.files()) if self.source is not None else []

    def confirm(self) -> None:
        if self.source is not None:
            self.source.confirm()

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


class LoraSource(CheckpointSource):
    """The base's parameters and, unmerged, the adapters beside them (what a LoRA model's
    `named_parameters` holds), or, merged, the base's with each adapted weight W + alpha / r B A
    (a plain model). `meta`: the adapters' checkpoint's, its model section without `lora` when merged."""

    def __init__(self, path: Path, meta: dict, model: dict, spec: LoraSpec, adapters: dict, base: _Base,
                 merged: bool, inner: CheckpointSource | None = None):
        self.path, self.spec, self.adapters, self.base = path, spec, adapters, base
        self.merged, self.inner = merged, inner
        self.format = inner.format if inner is not None else "peft"
        want = adapter_shapes(base.arch, spec)
        have = {n: tuple(t.shape) for n, t in adapters.items()}
        if have != {n: tuple(s) for n, s in want.items()}:
            wrong = sorted(set(have) ^ set(want)) or sorted(n for n in have if have[n] != tuple(want[n]))
            raise CheckpointError(f"{path} does not hold the adapters its LoRA settings describe (rank {spec.rank}, "
                                  f"targets {list(spec.targets)}): e.g. {wrong[0]}")
        config = copy.deepcopy(meta.get("config") or {})
        plain = {k: v for k, v in model.items() if k != "lora"}
        config["model"] = plain if merged else {**plain, "lora": spec.to_dict()}
        self.meta = {**meta, "config": config, "names": "zerodp", "tied": base.arch.tied_weights()}
        self._names = list(base.shapes) + ([] if merged else list(adapters))

    def param_names(self) -> list[str]:
        return list(self._names)

    def info(self, name: str) -> TensorInfo:
        shape = self.adapters[name].shape if is_adapter(name) else self.base.shapes[name]
        return TensorInfo(tuple(shape), torch.float32)

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        if kind != "param":
            raise KeyError(f"{self.path} has no {kind} for {name}: a LoRA model's weights only")
        if is_adapter(name):
            return self.adapters[name]
        w = self.base.get(name)
        module = name.removesuffix(".weight")
        if self.merged and f"{module}.lora_A.weight" in self.adapters:
            from zerodp.models.lora import merge_adapters

            pair = {f"{module}.lora_{x}.weight": self.adapters[f"{module}.lora_{x}.weight"] for x in "AB"}
            w = merge_adapters({name: w}, pair, self.spec.scaling)[name]
        return w

    def has(self, name: str, kind: str) -> bool:
        return kind == "param"

    def describe(self) -> dict:
        inner = self.inner.describe() if self.inner is not None else {"format": "peft", "path": str(self.path)}
        return {**inner, "lora": {**self.spec.to_dict(), "merged": self.merged}, "base": self.base.what}

    def files(self) -> list[Path]:
        return (list(self.inner.files()) if self.inner is not None else []) + self.base.files()

    def parts(self) -> list:
        """What this source reads, by part: the adapters' checkpoint (or PEFT folder) and the base's."""
        adapters = self.inner if self.inner is not None else _Folder(self.path)
        return [adapters] + ([self.base.source] if self.base.source is not None else [])

    def will_read(self, kinds: tuple[str, ...]) -> None:
        if self.inner is not None:
            self.inner.will_read(kinds)

    def confirm(self) -> None:
        if self.inner is not None:
            self.inner.confirm()
        self.base.confirm()

    def verify(self, deep: bool = True) -> str | None:
        return self.inner.verify(deep) if self.inner is not None else None

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        self.base.close()


class BaseModel(CheckpointSource):
    """The base of a LoRA model alone, as a plain model's source: what `zerodp convert RUN --to peft`
    writes beside the adapters as a Hugging Face folder when the base is a seed's initial weights, which
    no folder holds. Reads through `lora`, which stays open and is closed by its owner."""

    def __init__(self, lora: LoraSource):
        self.path, self.format, self._base = lora.path, lora.format, lora.base
        config = copy.deepcopy(lora.meta.get("config") or {})
        config["model"] = {k: v for k, v in (config.get("model") or {}).items() if k != "lora"}
        self.meta = {**{k: v for k, v in lora.meta.items() if k != "lora"}, "config": config}

    def param_names(self) -> list[str]:
        return list(self._base.shapes)

    def info(self, name: str) -> TensorInfo:
        return TensorInfo(tuple(self._base.shapes[name]), torch.float32)

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        if kind != "param":
            raise KeyError(f"the base of {self.path} has no {kind} for {name}: weights only")
        return self._base.get(name)

    def has(self, name: str, kind: str) -> bool:
        return kind == "param"

    def files(self) -> list[Path]:
        return self._base.files()

    def verify(self, deep: bool = True) -> str | None:
        return None

    def close(self) -> None:
        pass


class _Folder:
    """A PEFT folder as `parts` names it: the folder and its files."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def files(self) -> list[Path]:
        return sorted(p for p in self.path.iterdir() if p.is_file())


def _model_config(model: dict):
    from zerodp.config import ModelConfig, from_dict, resolve_model

    keys = set(ModelConfig.__dataclass_fields__)
    cfg = from_dict({"model": {k: v for k, v in model.items() if k in keys and k != "lora"}}, "the base model")
    return resolve_model(cfg).model


def lora_of(source: CheckpointSource, merged: bool) -> LoraSource:
    """The LoRA model of an open LoRA checkpoint (`recorded_lora(source.meta)` is not None): its adapters,
    read now, and the base its record names. Closing the result closes `source`."""
    rec = recorded_lora(source.meta)
    assert rec is not None, f"{source.path} holds no LoRA adapters"
    spec = spec_of_record(rec)
    model = dict((source.meta.get("config") or {}).get("model") or {})
    adapters = {n: source.get(n).float() for n in source.param_names() if is_adapter(n)}
    init_from, seed = rec["base"].get("init_from"), int(rec["base"].get("seed") or 0)
    base = _Base(_model_config(model), init_from, seed)
    recorded = rec["base"].get("sha256")
    if recorded:  # the base must be the weights the adapters were trained on, not merely of their shapes
        from zerodp.convert.lora_base import base_sha256, cache_dir

        found = base_sha256(init_from, model, seed, cache_dir())
        if found != recorded:
            base.close()
            raise CheckpointError(f"the base model {base.what} is not the one {source.path}'s adapters were trained "
                                  f"on (sha256 {found[:12]} here, {recorded[:12]} recorded): the weights at that path "
                                  f"changed; put the original base back there")
    return LoraSource(Path(source.path), source.meta, model, spec, adapters, base, merged, inner=source)


def peft_model(folder: str | Path, merged: bool) -> LoraSource:
    """The model of PEFT folder `folder`: its adapters over the base its adapter_config.json names
    (base_model_name_or_path: a folder zerodp reads, such as the base's Hugging Face export)."""
    from zerodp.convert import open_checkpoint
    from zerodp.convert.peft import read_adapters, read_config, spec_of_config
    from zerodp.models.arch import arch_of
    from zerodp.models.hf import ORIGIN

    folder = Path(folder)
    config = read_config(folder, "PEFT folder")
    base_path = config.get("base_model_name_or_path")
    if not base_path or not Path(base_path).exists():
        raise UserError(f"{folder}: its base model ({base_path or 'not named'}: {folder}/adapter_config.json's "
                        f"base_model_name_or_path) is not a folder here; set base_model_name_or_path to the base "
                        f"model's folder (a Hugging Face export or a zerodp checkpoint)")
    with open_checkpoint(base_path) as base_source:
        recorded = (base_source.meta.get("config") or {}).get("model")
        meta = {k: v for k, v in base_source.meta.items() if k in ("tokenizer", ORIGIN)}
    if not recorded:
        raise UserError(f"{folder}: its base model {base_path} records no model config (no config.json, no zerodp "
                        f"metadata); set base_model_name_or_path to a Hugging Face model folder or zerodp checkpoint")
    model_cfg = _model_config(recorded)
    spec = spec_of_config(config)
    adapters = read_adapters(folder, arch_of(model_cfg), spec, "PEFT folder")
    import dataclasses

    model = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k != "lora"}
    base = _Base(model_cfg, str(base_path), 0)
    return LoraSource(folder, {**meta, "config": {"model": model}}, model, spec, adapters, base, merged)


def model_folders(source: CheckpointSource) -> list[Path]:
    """Where the tokenizer and chat template of an open checkpoint's model may lie: beside the checkpoint
    (an export's, or a checkpoint converted from one), then, for a LoRA model, beside its base (the
    folder a PEFT adapter's base_model_name_or_path or a LoRA run's model.init_from names)."""
    path = Path(source.path)
    out = [path, path.parent]
    if isinstance(source, LoraSource) and source.base.source is not None:
        where = Path(source.base.source.path)
        out += [where] if where.is_dir() else [where.parent]
    return out


@contextlib.contextmanager
def open_model(path: str | Path, merged: bool = False):
    """Any checkpoint zerodp.convert.open_checkpoint reads, a LoRA run's as its LoRA model (`lora_of`),
    or a PEFT folder's (`peft_model`); closed at the block's end."""
    from zerodp.convert import open_checkpoint
    from zerodp.convert.peft import is_peft_folder

    if is_peft_folder(path):
        source = peft_model(path, merged)
    else:
        source = open_checkpoint(path)
        if recorded_lora(source.meta) is not None:
            try:
                source = lora_of(source, merged)
            except BaseException:
                source.close()
                raise
    try:
        yield source
    finally:
        source.close()
