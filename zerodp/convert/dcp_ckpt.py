"""torch.distributed.checkpoint folders (FSDP2, torchtitan, zerodp's fsdp strategy), read without
a process group, a few keys at a time.

Keys are flattened FQNs. Optimizer state from `get_state_dict` sits under `[optim|optimizer.]state.
<param fqn>.{exp_avg,exp_avg_sq,step}`; model weights under `model.<fqn>` (when saved as
{"model": ..., ...}) or at the top level (torchtitan). A model key without optimizer state whose
tensor equals a parameter's is a tied alias (plain FSDP saves the tie under both names).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch

from zerodp.convert import dcp_chunks
from zerodp.convert.safeload import read_dcp_metadata, safe_dcp_planner, safe_dcp_reader
from zerodp.convert.source import MOMENTS, CheckpointSource, FileRanges, TensorInfo, check_kind
from zerodp.errors import CheckpointError

_OPT = re.compile(r"^(optim\.|optimizer\.|optimizers\.)?state\.(.+)\.(exp_avg|exp_avg_sq|step)$")
_NOT_MODEL = ("optim.", "optimizer.", "optimizers.", "lr_scheduler.", "lr_schedulers.", "dataloader.",
              "train_state.", "scheduler.")


class DcpSource(CheckpointSource):
    format = "dcp"

    def __init__(self, path: Path, tied: dict[str, str] | None = None, read_steps: bool = True):
        """`read_steps`: read every parameter's AdamW step now, for `meta["step"]`; a zerodp checkpoint
        that wraps the folder records its step itself, and a weights-only conversion of it then never
        reads the optimizer's entries (`unread_ranges`)."""
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise CheckpointError(f"{self.path} has no .metadata file; not a torch.distributed.checkpoint folder")
        self._reader = None  # dcp.load's, made only for a chunk dcp_chunks does not read
        self._fds: dict[str, int] = {}
        self._steps: dict[str, float] | None = None
        try:
            # Plain stand-in records (zerodp.convert.safeload.read_dcp_metadata): no DCP import unless needed
            self.md = read_dcp_metadata(self.path / ".metadata")
        except CheckpointError:
            raise
        except Exception as e:  # a truncated .metadata pickle
            raise CheckpointError(f"{self.path / '.metadata'} is unreadable ({type(e).__name__}: {e})") from None
        problem = self.verify(deep=False)  # sizes first: nothing is read from a truncated file
        if problem:
            raise CheckpointError(problem)
        tensors = {k: v for k, v in self.md.state_dict_metadata.items() if type(v).__name__ == "TensorStorageMetadata"}
        self._chunk_at = {(i.fqn, tuple(getattr(i, "offset", None) or ())): where
                          for i, where in self.md.storage_data.items()}
        self.meta_of = tensors
        self.opt_keys: dict[tuple[str, str], str] = {}  # (param, exp_avg|exp_avg_sq|step) -> key
        model_keys = []
        for k in tensors:
            m = _OPT.match(k)
            if m:
                self.opt_keys[(m.group(2), m.group(3))] = k
            elif not k.startswith(_NOT_MODEL):
                model_keys.append(k)
        opt_params = {p for p, _ in self.opt_keys}
        # Strip "model." when that is how the keys were nested (matched against optimizer names, or
        # every key carries it); torchtitan-style flat keys are kept as they are.
        strip = all(k.startswith("model.") for k in model_keys) and bool(model_keys) and (
            not opt_params or sum(k[6:] in opt_params for k in model_keys) >= sum(k in opt_params for k in model_keys))
        self.key_of = {(k[6:] if strip else k): k for k in model_keys}
        self._tied = dict(tied or {})
        for alias in list(self._tied):
            self.key_of.pop(alias, None)
        if opt_params and not tied:
            self._find_ties(opt_params)
        steps = [self.step(n) for n in opt_params] if read_steps else [None]
        ranks = {m.group(1) for s in self.md.storage_data.values()
                 if (m := re.match(r"__(\d+)_\d+\.distcp$", s.relative_path))}
        self.meta = {"tied": self._tied, "world_size": len(ranks) or None,
                     "step": int(max(steps)) if steps and None not in steps else None,
                     "dtype": ",".join(sorted({str(v.properties.dtype).replace("torch.", "")
                                               for v in tensors.values()}))}

    def _find_ties(self, opt_params: set[str]) -> None:
        by_shape: dict[tuple, list[str]] = {}
        for n in self.key_of:
            if n in opt_params:
                by_shape.setdefault((tuple(self.info(n).shape), self.info(n).dtype), []).append(n)
        for n in [n for n in self.key_of if n not in opt_params]:
            for cand in by_shape.get((tuple(self.info(n).shape), self.info(n).dtype), []):
                if torch.equal(self._load(self.key_of[n]), self._load(self.key_of[cand])):
                    self._tied[n] = cand
                    del self.key_of[n]
                    break

    def tied(self) -> dict[str, str]:
        return dict(self._tied)

    def _load(self, key: str) -> torch.Tensor:
        return self._load_many([key])[0]

    def _load_many(self, keys: list[str]) -> list[torch.Tensor]:
        """The tensors of `keys`: each chunk read straight into place (zerodp.convert.dcp_chunks), in file
        order; any chunk laid out otherwise in one dcp.load (one pass per file, one planning round)."""
        out = {k: torch.empty(tuple(self.meta_of[k].size), dtype=self.meta_of[k].properties.dtype) for k in keys}
        try:
            rest = self._read_direct(out, keys)
            if rest:
                self._dcp_load({k: out[k] for k in rest})
        except BaseException as e:
            if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
                raise  # (DCP's CheckpointException, a BaseException, wraps file errors)
            problem = self.verify(deep=False) or f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
            what = keys[0] if len(keys) == 1 else f"{len(keys)} tensors ({keys[0]}, ...)"
            raise CheckpointError(f"{self.path}: cannot read {what}: {problem}") from None
        return [out[k] for k in keys]

    def _read_direct(self, out: dict[str, torch.Tensor], keys: list[str]) -> list[str]:
        """Fill out[k] for the keys whose chunks dcp_chunks reads; return the others."""
        plan, rest = [], []
        for k in keys:
            md = self.meta_of[k]
            try:
                pieces = []
                for chunk in md.chunks:
                    where = self._chunk_at.get((k, tuple(chunk.offsets)))
                    if where is None or getattr(where, "transform_descriptors", None):
                        raise dcp_chunks.Unsupported("a chunk with a transform")
                    fd = self._fd(where.relative_path)
                    at = dcp_chunks.chunk_bytes(fd, where.offset, where.length, md.properties.dtype,
                                                tuple(chunk.sizes))
                    target = out[k]
                    for dim, (start, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                        target = target.narrow(dim, start, n)
                    pieces.append((where.relative_path, at, target))
            except dcp_chunks.Unsupported:
                rest.append(k)
                continue
            plan += pieces
        for rel, at, target in sorted(plan, key=lambda p: (p[0], p[1])):  # one forward pass per file
            if target.is_contiguous():  # a row block of the tensor (how FSDP shards): straight into place
                dcp_chunks.read_into(self._fd(rel), at, target)
            else:
                piece = torch.empty(target.shape, dtype=target.dtype)
                dcp_chunks.read_into(self._fd(rel), at, piece)
                target.copy_(piece)
        return rest

    def _dcp_load(self, out: dict[str, torch.Tensor]) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(out, storage_reader=self.reader, planner=safe_dcp_planner(), no_dist=True)

    @property
    def reader(self):
        """dcp.load's storage reader (its metadata unpickled, with the allowlist, into DCP's own classes)."""
        if self._reader is None:
            self._reader = safe_dcp_reader(self.path)
            self._reader.read_metadata()  # parsed once: cached by the reader
        return self._reader

    def _fd(self, rel: str) -> int:
        if rel not in self._fds:
            self._fds[rel] = os.open(self.path / rel, os.O_RDONLY)
        return self._fds[rel]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _key(self, name: str, kind: str) -> str:
        check_kind(kind)
        if kind == "param":
            return self.key_of[name]
        if (name, kind) not in self.opt_keys:
            raise KeyError(f"{self.path} has no {kind} for {name}")
        return self.opt_keys[(name, kind)]

    def param_names(self) -> list[str]:
        return list(self.key_of)

    def info(self, name: str) -> TensorInfo:
        m = self.meta_of[self.key_of[name]]
        return TensorInfo(tuple(m.size), m.properties.dtype)

    def kinds(self) -> tuple[str, ...]:
        return ("param",) + MOMENTS if self.opt_keys else ("param",)

    def has(self, name: str, kind: str) -> bool:
        return kind == "param" or (name, kind) in self.opt_keys

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        return self.get_many([(name, kind)])[0]

    def get_many(self, requests: list[tuple[str, str]]) -> list[torch.Tensor]:
        tensors = self._load_many([self._key(n, k) for n, k in requests])
        return [t if k == "param" else t.float() for t, (_, k) in zip(tensors, requests)]

    def locate(self, name: str, kind: str = "param") -> FileRanges | None:
        """The chunks' data in the .distcp files, when they are whole rows of the tensor in row order (how
        FSDP shards on dim 0) stored in the dtype `get` returns; None otherwise."""
        try:
            key = self._key(name, kind)
        except KeyError:
            return None
        md = self.meta_of[key]
        dtype, size = md.properties.dtype, tuple(md.size)
        if kind != "param" and dtype != torch.float32:
            return None  # `get` returns the moments as fp32
        ranges, row = [], 0
        for chunk in sorted(md.chunks, key=lambda c: tuple(c.offsets)):
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if size and (offsets[0] != row or any(offsets[1:]) or sizes[1:] != size[1:]):
                return None
            where = self._chunk_at.get((key, offsets))
            if where is None or getattr(where, "transform_descriptors", None):
                return None
            try:
                at = dcp_chunks.chunk_bytes(self._fd(where.relative_path), where.offset, where.length, dtype, sizes)
            except dcp_chunks.Unsupported:
                return None
            n = dtype.itemsize
            for s in sizes:
                n *= s
            ranges.append((str(self.path / where.relative_path), at, n))
            row += sizes[0] if size else 1
        if (size and row != size[0]) or (not size and len(ranges) != 1):
            return None
        return FileRanges(tuple(ranges))

    def unread_ranges(self, kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """The whole torch.save blob of every chunk of the moments not in `kinds` (its zip records too:
        nothing in it is read), and with both moments left out, of the AdamW steps beside them."""
        skip = [kind for kind in MOMENTS if kind not in kinds]
        if len(skip) == len(MOMENTS):
            skip.append("step")
        keys = {key for (_, kind), key in self.opt_keys.items() if kind in skip}
        return [(str(self.path / where.relative_path), where.offset, where.length)
                for index, where in self.md.storage_data.items() if index.fqn in keys]

    def step(self, name: str | None = None) -> float | None:
        if name is None:
            return None if self.meta.get("step") is None else float(self.meta["step"])
        if self._steps is None:  # every parameter's step in one read
            keys = {p: k for (p, kind), k in self.opt_keys.items() if kind == "step"}
            self._steps = dict(zip(keys, map(float, self._load_many(list(keys.values())))))
        return self._steps.get(name)

    def files(self) -> list[Path]:
        rel = sorted({s.relative_path for s in self.md.storage_data.values()})
        return [self.path / ".metadata"] + [self.path / r for r in rel]

    def verify(self, deep: bool = True) -> str | None:
        """Each data file present and at least as long as the byte ranges .metadata points into.
        (DCP records no checksums; bytes flipped inside a tensor's range surface only as a load error.)"""
        need: dict[str, int] = {}
        for s in self.md.storage_data.values():
            need[s.relative_path] = max(need.get(s.relative_path, 0), s.offset + s.length)
        for rel, n in sorted(need.items()):
            p = self.path / rel
            if not p.is_file():
                return f"{p} is missing"
            if p.stat().st_size < n:
                return f"{p} has {p.stat().st_size} bytes but .metadata points up to byte {n} (truncated)"
        return None
