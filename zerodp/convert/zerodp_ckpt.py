"""zerodp's own checkpoint folders (`step_XXXXXXXX/` with meta.json), of any strategy.

The meta.json manifest (size and sha256 of every file) is checked before anything is read; the
tensors then come from the strategy's own files: the canonical safetensors layout (single, ddp),
DeepSpeed's files (zero1/2/3) or a DCP folder (fsdp), each found by what is on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerodp.checkpoint.manifest import META, BackgroundVerify, resolve_step_folder as resolve_zerodp_root  # noqa: F401
from zerodp.convert.source import MOMENTS, CheckpointSource, FileRanges, SafetensorsFile, TensorInfo, check_kind
from zerodp.errors import CheckpointError


class ZerodpSource(CheckpointSource):
    format = "zerodp"

    def __init__(self, path: Path, verify_deep: bool = False, hash_beside_reads: bool = False,
                 hashing: BackgroundVerify | None = None):
        self.path = Path(path)
        try:
            self.meta = json.loads((self.path / META).read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.path / META} is not valid JSON ({e})") from None
        # Sizes always, and with verify_deep the sha256 of every file: first, or with hash_beside_reads in
        # threads beside the reads (hashlib releases the GIL); a writer then publishes nothing until
        # `confirm()` has seen it pass. `hashing`: that check already begun on this folder (the command
        # starts it before torch is imported).
        self._check: BackgroundVerify | None = None
        if verify_deep and hash_beside_reads:
            if hashing is not None and hashing.ckpt.resolve() == self.path.resolve():
                self._check = hashing
            else:
                if hashing is not None:
                    hashing.cancel()
                self._check = BackgroundVerify(self.path)
            problem = self._check.problem  # the sizes, known at once
        else:
            problem = self.verify(deep=verify_deep)
        if problem:
            raise CheckpointError(problem)
        self.inner: CheckpointSource | None = None
        self.model = self.optim = None
        if (self.path / "model.safetensors").is_file():
            self.layout = "safetensors"
            self.model = SafetensorsFile(self.path / "model.safetensors")
            optim = self.path / "optim.safetensors"
            self.optim = SafetensorsFile(optim) if optim.is_file() else None
            oj = self.path / "optim.json"
            self.optim_json = json.loads(oj.read_text()) if oj.is_file() else {"step": {}, "extra": {}}
            self._names = list(self.model.entries)
        else:
            from zerodp.convert.dcp_ckpt import DcpSource
            from zerodp.convert.deepspeed_ckpt import DeepSpeedSource, find_deepspeed_dir

            if find_deepspeed_dir(self.path) is not None:
                self.layout = "deepspeed"
                self.inner = DeepSpeedSource(self.path)
            else:
                dcp_dirs = sorted(p.parent for p in self.path.rglob(".metadata"))
                if len(dcp_dirs) != 1:
                    raise CheckpointError(f"{self.path}: found neither model.safetensors, DeepSpeed files nor one "
                                          f"torch.distributed.checkpoint folder; the checkpoint is incomplete")
                self.layout = "dcp"
                self.inner = DcpSource(dcp_dirs[0], tied=self.meta.get("tied"), read_steps=False)
            self._names = self.inner.param_names()
        trainer = self.path / "trainer.json"
        self.trainer = json.loads(trainer.read_text()) if trainer.is_file() else {}

    def param_names(self) -> list[str]:
        return list(self._names)

    def info(self, name: str) -> TensorInfo:
        return self.model.info(name) if self.inner is None else self.inner.info(name)

    def kinds(self) -> tuple[str, ...]:
        if self.inner is not None:
            return self.inner.kinds()
        return ("param",) + MOMENTS if self.optim is not None and self.optim.entries else ("param",)

    def has(self, name: str, kind: str) -> bool:
        if self.inner is not None:
            return self.inner.has(name, kind)
        return kind == "param" or (self.optim is not None and f"{name}/{kind}" in self.optim.entries)

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        check_kind(kind)
        if self.inner is not None:
            return self.inner.get(name, kind)
        if kind == "param":
            return self.model.read(name)
        if not self.has(name, kind):
            raise KeyError(f"{self.path} has no {kind} for {name}")
        return self.optim.read(f"{name}/{kind}")

    def locate(self, name: str, kind: str = "param") -> FileRanges | None:
        if self.inner is not None:
            return self.inner.locate(name, kind)
        if kind == "param":
            return self.model.locate(name)
        return self.optim.locate(f"{name}/{kind}") if self.has(name, kind) else None

    def unread_ranges(self, kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
        if self.inner is not None:
            return self.inner.unread_ranges(kinds)
        if self.optim is None:
            return []
        return [self.optim.locate(key).ranges[0] for key in self.optim.entries if key.rsplit("/", 1)[-1] not in kinds]

    def will_read(self, kinds: tuple[str, ...]) -> None:
        """Hand the sha256 check the byte ranges these kinds never touch: the blocks inside them (of files
        whose manifest has per-block hashes) are not hashed."""
        if self._check is None:
            return
        root = self.path.resolve()
        unread: dict[str, list[tuple[int, int]]] = {}
        for path, at, n in self.unread_ranges(tuple(kinds)):
            try:
                rel = str(Path(path).resolve().relative_to(root))
            except ValueError:
                continue
            unread.setdefault(rel, []).append((at, n))
        self._check.plan(unread)

    def get_many(self, requests: list[tuple[str, str]]) -> list[torch.Tensor]:
        return self.inner.get_many(requests) if self.inner is not None else super().get_many(requests)

    def step(self, name: str | None = None) -> float | None:
        if name is None:
            return super().step()
        if self.inner is not None:
            return self.inner.step(name)
        s = self.optim_json.get("step", {}).get(name)
        return None if s is None else float(s)

    def loss_scaler(self) -> dict | None:
        return self.inner.loss_scaler() if self.inner is not None else None

    def describe(self) -> dict:
        return {**super().describe(), "layout": getattr(self, "layout", "?")}

    def files(self) -> list[Path]:
        return [self.path / META] + [self.path / rel for rel in self.meta.get("files", {})]

    def verify(self, deep: bool = True) -> str | None:
        from zerodp.checkpoint.manifest import verify

        return verify(self.path, deep=deep)

    def confirm(self) -> None:
        problem = self._check.result() if self._check is not None else None
        if problem:
            raise CheckpointError(problem)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
        if self._check is not None and self._check.problem is None:
            self._check.cancel()  # a conversion given up midway: stop hashing (confirm() now fails)
