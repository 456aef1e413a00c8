"""Hugging Face style safetensors: one `*.safetensors` file, or shards listed by `*.index.json`.

Weights only. Ties are read from our own metadata (`zerodp.tied`) when present; an HF file that
simply omits a tied head (GPT-2's lm_head) has nothing to record and is read as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerodp.convert.source import CheckpointSource, SafetensorsFile, TensorInfo, check_kind
from zerodp.errors import CheckpointError

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
        for key, field in (("zerodp.tied", "tied"), ("zerodp.source", "source")):
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
        # Tied aliases present as tensors are written twice by some tools; keep one name per tensor.
        self._names = [n for n in names if n not in self.tied()]

    def param_names(self) -> list[str]:
        return list(self._names)

    def info(self, name: str) -> TensorInfo:
        return self.where[name].info(name)

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        check_kind(kind)
        if kind != "param":
            raise KeyError(f"{self.path} holds weights only, no {kind} for {name}")
        return self.where[name].read(name)

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
