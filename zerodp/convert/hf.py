"""Hugging Face style safetensors: one `*.safetensors` file, or shards listed by `*.index.json`; with a
Hugging Face config.json beside them, a model folder (the model types zerodp.models.hf.SUPPORTED lists).

Weights only. Ties are read from our own metadata (`zerodp.tied`) when present, else from config.json's
tie_word_embeddings; an HF file that simply omits a tied head (GPT-2's lm_head) has nothing to record.
Which names and layouts the tensors are in ("hf" or "zerodp", `meta["names"]`) comes from our own
metadata (`zerodp.layout`) when present; zerodp.convert.full_state.FullState guesses otherwise. A
config.json gives `meta["config"]["model"]` (zerodp's model keys, so a model check compares settings
as for a zerodp checkpoint) and `meta["hf_config"]`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerodp.convert.source import CheckpointSource, FileRanges, SafetensorsFile, TensorInfo, check_kind
from zerodp.errors import CheckpointError, UserError

INDEX = "model.safetensors.index.json"


class SafetensorsSource(CheckpointSource):
    format = "safetensors"

    def __init__(self, path: Path):
        self.path = Path(path)
        if self.path.is_dir():
            index = self.path / INDEX
            if not index.is_file():
                found = sorted(self.path.glob("*.index.json")) or sorted(self.path.glob("*.safetensors"))
                if len(found) != 1:
                    raise CheckpointError(f"{self.path} holds {len(found)} safetensors files and no {INDEX}; "
                                          f"point at one file or add an index")
                index = found[0]
            self.path = index
        self.index: dict | None = None
        if self.path.name.endswith(".index.json"):
            try:
                self.index = json.loads(self.path.read_text())
                weight_map = self.index["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{self.path} is not a valid safetensors index ({e})") from None
            shard_names = sorted(set(weight_map.values()))
            self.shards = {s: SafetensorsFile(self.path.parent / s) for s in shard_names}
            self.where = {}
            for s, f in self.shards.items():
                for n in f.entries:
                    self.where[n] = f
            missing = [n for n in weight_map if n not in self.where]
            if missing:
                raise CheckpointError(f"{self.path} lists {len(missing)} tensors no shard holds (first: {missing[0]})")
            names = list(weight_map)
        else:
            f = SafetensorsFile(self.path)
            self.shards = {self.path.name: f}
            self.where = dict.fromkeys(f.entries, f)
            names = list(f.entries)
        self._names = names
        first = next(iter(self.shards.values()))
        md = dict(first.metadata)
        if self.index:
            md.update({k: v for k, v in (self.index.get("metadata") or {}).items() if isinstance(v, str)})
        self.meta = {"metadata": md, "shards": len(self.shards)}
        for key, field in (("zerodp.tied", "tied"), ("zerodp.source", "source"), ("zerodp.tokenizer", "tokenizer"),
                           ("zerodp.hf_origin", "hf_origin")):  # zerodp.models.hf.ORIGIN
            if key in md:
                try:
                    self.meta[field] = json.loads(md[key])
                except json.JSONDecodeError:
                    pass
        src = self.meta.get("source") or {}
        for k in ("strategy", "world_size", "step"):
            if k in src:
                self.meta[k] = src[k]
        dtypes = sorted({str(self.info(n).dtype).replace("torch.", "") for n in names})
        self.meta["dtype"] = ",".join(dtypes)
        if md.get("zerodp.layout") in ("hf", "zerodp"):
            self.meta["names"] = md["zerodp.layout"]
        if "zerodp.config" in md and "config" not in self.meta:
            try:
                self.meta["config"] = json.loads(md["zerodp.config"])
            except json.JSONDecodeError:
                pass
        self._read_hf_config(names)
        # Tied aliases present as tensors are written twice by some tools; keep one name per tensor.
        self._names = [n for n in names if n not in self.tied()]

    def _read_hf_config(self, names: list[str]) -> None:
        """Take the model's settings and ties from a config.json beside the weights, if there is one. A
        model zerodp cannot run is recorded (`hf_config_error`), not raised: inspect and --to safetensors
        still read it; loading it into a model (FullState) raises."""
        from zerodp.models.arch import spec_of
        from zerodp.models.hf import model_config_from_hf

        cfg_path = self.path.parent / "config.json"
        if not cfg_path.is_file():
            return
        try:
            raw = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return
        if not isinstance(raw, dict) or "model_type" not in raw:
            return
        self.meta["hf_config"] = raw
        try:
            model = model_config_from_hf(raw, where=str(cfg_path))
        except UserError as e:
            self.meta["hf_config_error"] = str(e)
            return
        spec = spec_of(model["arch"])
        if not spec.LEARNED_POSITIONS:  # a RoPE model's training length is not a property of its weights
            model.pop("block_size")
        self.meta.setdefault("config", {"model": model})
        if model["tie_embeddings"] and "zerodp.tied" not in self.meta["metadata"]:
            # HF files omit the tied head (some tools write it twice: it is then listed once)
            bare = spec.EMBEDDING.removeprefix(spec.IMPORT_PREFIX) if spec.IMPORT_PREFIX else spec.EMBEDDING
            embedding = next((n for n in (spec.EMBEDDING, bare) if n in names), None)
            if embedding:
                self.meta["tied"] = {"lm_head.weight": embedding}

    def param_names(self) -> list[str]:
        return list(self._names)

    def info(self, name: str) -> TensorInfo:
        return self.where[name].info(name)

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        check_kind(kind)
        if kind != "param":
            raise KeyError(f"{self.path} holds weights only, no {kind} for {name}")
        return self.where[name].read(name)

    def locate(self, name: str, kind: str = "param") -> FileRanges | None:
        return self.where[name].locate(name) if kind == "param" else None

    def files(self) -> list[Path]:
        extra = [self.path] if self.index else []
        return extra + [f.path for f in self.shards.values()]

    def verify(self, deep: bool = True) -> str | None:
        # A safetensors header fixes the file's exact size: re-checking it catches truncation and
        # overwrites. The format has no checksum, so flipped bytes inside a tensor cannot be seen.
        for f in self.files():
            try:
                if f.suffix == ".safetensors":
                    SafetensorsFile(f)
                elif not f.is_file():
                    return f"{f} is missing"
            except CheckpointError as e:
                return str(e)
        return None
