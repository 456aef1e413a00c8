"""Stacked experts and Hugging Face files: a mixture-of-experts family keeps each block's experts in a
few stacked tensors (zerodp.models.moe), Hugging Face files keep one tensor per expert and projection
(`model.layers.3.mlp.experts.7.gate_proj.weight`). The family spec's EXPERTS table (stacked name inside a
block -> the per-expert parts concatenated along their first dimension) is read both ways here, as views
of a checkpoint source:

    stacked(source)        an HF folder's per-expert tensors as the stacked parameters (open_checkpoint)
    per_expert(source, a)  the stacked parameters as the per-expert tensors an HF file holds (write_hf)

Everything else passes through unchanged; a source without experts is returned as it is."""

from __future__ import annotations

import re
import threading

import torch

from zerodp.convert.source import CheckpointSource, TensorInfo
from zerodp.models.arch import FAMILIES, spec_of


def _tables() -> dict[str, dict]:
    return {f: spec_of(f).EXPERTS for f in FAMILIES if getattr(spec_of(f), "EXPERTS", None)}


class _View(CheckpointSource):
    """A source presenting some tensors under other names and shapes; everything else is the inner one's."""

    KEEP = 2
    """Stacked tensors kept read (a block's gate_up_proj and down_proj: HF's sorted names alternate)."""

    def __init__(self, inner: CheckpointSource):
        self.inner, self.format, self.path, self.meta = inner, inner.format, inner.path, inner.meta
        self._lock = threading.Lock()
        self._cached: dict[tuple[str, str], torch.Tensor] = {}

    def __getattr__(self, name: str):  # what a kind of source adds (a LoRA source's parts): the inner one's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def files(self):
        return self.inner.files()

    def confirm(self):
        return self.inner.confirm()

    def verify(self, deep: bool = True):
        return self.inner.verify(deep)

    def unread_ranges(self, kinds):
        return self.inner.unread_ranges(kinds)

    def will_read(self, kinds):
        return self.inner.will_read(kinds)

    def tied(self):
        return self.inner.tied()

    def kinds(self):
        return self.inner.kinds()

    def step(self, name=None):
        return self.inner.step(name)

    def loss_scaler(self):
        return self.inner.loss_scaler()

    def close(self):
        return self.inner.close()

    def _read(self, name: str, kind: str) -> torch.Tensor:
        """The inner source's tensor, the last KEEP kept: the E slices of a stacked tensor read it once."""
        with self._lock:
            key = (name, kind)
            if key not in self._cached:
                if len(self._cached) >= self.KEEP:
                    del self._cached[next(iter(self._cached))]
                self._cached[key] = self.inner.get(name, kind)
            return self._cached[key]


class Stacked(_View):
    """Per-expert tensors presented as the stacked parameters (`stacked`)."""

    def __init__(self, inner: CheckpointSource, table: dict, groups: dict):
        super().__init__(inner)
        self.table = table
        self.groups = groups  # stacked name -> [[part names of expert 0], [of expert 1], ...]
        self._names = []
        grouped = {p for experts in groups.values() for parts in experts for p in parts}
        placed = set()
        for n in inner.param_names():
            if n not in grouped:
                self._names.append(n)
                continue
            stacked_name = next(s for s, experts in groups.items() if any(n in parts for parts in experts))
            if stacked_name not in placed:
                placed.add(stacked_name)
                self._names.append(stacked_name)

    def param_names(self):
        return list(self._names)

    def info(self, name):
        if name not in self.groups:
            return self.inner.info(name)
        experts = self.groups[name]
        parts = [self.inner.info(p) for p in experts[0]]
        rows = sum(i.shape[0] for i in parts)
        return TensorInfo((len(experts), rows, *parts[0].shape[1:]), parts[0].dtype)

    def get(self, name, kind="param"):
        if name not in self.groups:
            return self.inner.get(name, kind)
        return torch.stack([torch.cat([self.inner.get(p, kind) for p in parts]) for parts in self.groups[name]])

    def has(self, name, kind):
        return self.inner.has(self.groups[name][0][0] if name in self.groups else name, kind)

    def locate(self, name, kind="param"):
        return None if name in self.groups else self.inner.locate(name, kind)


def _container(inside: str) -> str:
    """The module holding the experts, from a stacked name inside a block: `mlp.experts.gate_up_proj` ->
    `mlp.experts` (the per-expert tensors are `<block>.mlp.experts.<j>.<part>`)."""
    return inside.rpartition(".")[0]


def stacked(source: CheckpointSource) -> CheckpointSource:
    """`source` with every complete set of per-expert tensors of a family's EXPERTS table presented as the
    stacked parameter (`model.layers.3.mlp.experts.gate_up_proj` (E, 2I, C) from experts 0..E-1's gate_proj
    and up_proj); `source` itself when it holds none."""
    names = source.param_names()
    for table in _tables().values():
        groups = {}
        for inside, parts in table.items():
            container = _container(inside)
            pattern = re.compile(rf"(.*)\.{re.escape(container)}\.(\d+)\.(.+)")  # <block>.<container>.<j>.<part>
            found: dict[str, dict[int, set]] = {}  # block -> expert -> parts present
            for n in names:
                if (m := pattern.fullmatch(n)) and m[3] in parts:
                    found.setdefault(m[1], {}).setdefault(int(m[2]), set()).add(m[3])
            for block, experts in found.items():
                count = 1 + max(experts)
                if all(set(parts) <= experts.get(j, set()) for j in range(count)):
                    groups[f"{block}.{inside}"] = [[f"{block}.{container}.{j}.{p}" for p in parts]
                                                   for j in range(count)]
        if groups:
            return Stacked(source, table, groups)
    return source


class PerExpert(_View):
    """The stacked parameters presented as per-expert tensors (`per_expert`)."""

    def __init__(self, inner: CheckpointSource, parts: dict):
        super().__init__(inner)
        self.split = parts  # per-expert name -> (stacked name, expert, first row, rows)
        self._names = []
        by_stacked: dict[str, list[str]] = {}
        for n, (s, *_) in parts.items():
            by_stacked.setdefault(s, []).append(n)
        for n in inner.param_names():
            self._names += by_stacked.get(n, [n])

    def param_names(self):
        return list(self._names)

    def info(self, name):
        if name not in self.split:
            return self.inner.info(name)
        s, _, _, rows = self.split[name]
        have = self.inner.info(s)
        return TensorInfo((rows, *have.shape[2:]), have.dtype)

    def get(self, name, kind="param"):
        if name not in self.split:
            return self.inner.get(name, kind)
        s, j, start, rows = self.split[name]
        return self._read(s, kind)[j, start:start + rows].clone()

    def has(self, name, kind):
        return self.inner.has(self.split[name][0] if name in self.split else name, kind)

    def locate(self, name, kind="param"):
        return None if name in self.split else self.inner.locate(name, kind)


def split_shapes(a, shapes: dict[str, tuple]) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(`shapes` with each stacked expert parameter replaced by its per-expert tensors in HF's order,
    per-expert name -> (stacked name, expert, first row, rows)) for architecture `a`."""
    table = getattr(a.spec, "EXPERTS", None) or {}
    out, parts = {}, {}
    for name, shape in shapes.items():
        inside = next((k for k in table if name.endswith("." + k)), None)
        if inside is None:
            out[name] = shape
            continue
        block = name[: -len(inside) - 1]
        E, rows = shape[0], shape[1] // len(table[inside])
        for j in range(E):
            for p, part in enumerate(table[inside]):
                n = f"{block}.{_container(inside)}.{j}.{part}"
                out[n] = (rows, *shape[2:])
                parts[n] = (name, j, p * rows, rows)
    return out, parts


def per_expert(source: CheckpointSource, a, shapes: dict[str, tuple]) -> tuple[CheckpointSource, dict]:
    """(`source` with the stacked expert parameters of architecture `a` presented as HF's per-expert
    tensors, the model's `shapes` so split); `source` and `shapes` as they are for a dense family."""
    split, parts = split_shapes(a, shapes)
    if not parts:
        return source, shapes
    return PerExpert(source, parts), split
