"""The canonical, streaming view of a checkpoint that every reader provides.

A source names its distinct parameters (a tied alias is listed in `tied()`, never twice), describes
each one without reading it (`info`), and hands out one tensor at a time (`get`), so converting a
model never holds more than a tensor or two in memory. Kinds: "param" (the weight, as stored: fp32
master weights for DeepSpeed, DCP and zerodp; the file's dtype for safetensors), "exp_avg" and
"exp_avg_sq" (AdamW moments, fp32), present where the source has optimizer state.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from zerodp.errors import CheckpointError

KINDS = ("param", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FileRanges:
    """Where a stored tensor's bytes lie on disk, in its own row-major order: (file, offset, length)
    ranges which, read one after the other, give the tensor as `get` would return it (same dtype and
    shape). A writer whose output keeps that dtype and layout copies them file to file in the kernel
    (`copy_ranges`) instead of reading them into memory."""

    ranges: tuple[tuple[str, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.ranges)

    def read_into(self, target: torch.Tensor, opened: dict[str, int]) -> None:
        """Fill contiguous `target` (of nbytes bytes) with positioned reads of the ranges; `opened`:
        {path: fd}, filled as needed (the caller closes them). CheckpointError if a file ends early."""
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        at = 0
        for path, offset, n in self.ranges:
            if path not in opened:
                opened[path] = os.open(path, os.O_RDONLY)
            done = 0
            while done < n:
                got = os.preadv(opened[path], [view[at + done:at + n]], offset + done)
                if got <= 0:
                    raise CheckpointError(f"{path} ended {n - done} bytes early (truncated)")
                done += got
            at += n


class CheckpointSource:
    """Base of every reader. Subclasses fill `format`, `path`, `meta` and the methods marked so."""

    format: str = "?"
    path: Path
    meta: dict  # JSON-able: strategy, world_size, step, ... as far as the source records them

    # -- to implement -------------------------------------------------------------------------------
    def param_names(self) -> list[str]:
        raise NotImplementedError

    def info(self, name: str) -> TensorInfo:
        raise NotImplementedError

    def get(self, name: str, kind: str = "param") -> torch.Tensor:
        """The full tensor `kind` of parameter `name`; KeyError if the source has no such tensor."""
        raise NotImplementedError

    def files(self) -> list[Path]:
        raise NotImplementedError

    def confirm(self) -> None:
        """Wait for an integrity check running beside the reads (zerodp's sha256 manifest) and raise
        CheckpointError if it failed: writers call it before they publish anything."""

    def locate(self, name: str, kind: str = "param") -> FileRanges | None:
        """Where `get(name, kind)`'s bytes lie in the source's files, when they lie there as they are
        (uncompressed, in that dtype, row-major, whole or in consecutive pieces); None otherwise, or
        where the format does not say (the writer then reads the tensor). Called before any reading
        begins, from the thread that opened the source."""
        return None

    def unread_ranges(self, kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """(file, offset, length) ranges of the source's files that a reader of only these kinds never
        touches: the data of the other kinds' tensors, and of copies of the weights the reader does not
        use (DeepSpeed's module weights beside its fp32 partitions). [] where the format does not say."""
        return []

    def will_read(self, kinds: tuple[str, ...]) -> None:
        """Called by a writer before it reads: only tensors of these kinds will be read. A source whose
        integrity check runs beside the reads (zerodp's per-block sha256) then checks only what is read."""

    def get_many(self, requests: list[tuple[str, str]]) -> list[torch.Tensor]:
        """`get` of each (name, kind), in order; a format that reads better in bulk (DCP) overrides it."""
        return [self.get(n, k) for n, k in requests]

    def verify(self, deep: bool = True) -> str | None:
        """None if every file is present and intact, else the reason (naming the file)."""
        raise NotImplementedError

    # -- shared behaviour ---------------------------------------------------------------------------
    def tied(self) -> dict[str, str]:
        """{alias: source name} for weights stored once and used under two names."""
        return dict(self.meta.get("tied") or {})

    def kinds(self) -> tuple[str, ...]:
        """Which kinds this source holds (always "param"; the moments where it has optimizer state)."""
        return ("param",)

    def has(self, name: str, kind: str) -> bool:
        return kind in self.kinds()

    def step(self, name: str | None = None) -> float | None:
        """AdamW's step count of `name` (or the training step when name is None); None if unknown."""
        s = self.meta.get("step")
        return None if s is None else float(s)

    def loss_scaler(self) -> dict | None:
        """The saved loss scaler's fields, where the format keeps one (DeepSpeed); else None."""
        return None

    def total_bytes(self) -> int:
        return sum(self.info(n).nbytes for n in self.param_names())

    def iter_tensors(self, kinds: tuple[str, ...] = ("param",)) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(name, kind, tensor) one at a time, in parameter order; kinds the source lacks are skipped."""
        for name in self.param_names():
            for kind in kinds:
                if self.has(name, kind):
                    yield name, kind, self.get(name, kind)

    def describe(self) -> dict:
        """A JSON-able summary kept in converted files' metadata."""
        keep = ("strategy", "world_size", "step", "zero_stage", "ds_version", "dtype")
        return {"format": self.format, "path": str(self.path), **{k: self.meta[k] for k in keep if k in self.meta}}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def names_layout(source: CheckpointSource) -> str:
    """"hf" if the source's tensors are in Hugging Face's names and layouts, else "zerodp": as its
    metadata says (`meta["names"]`), else as zerodp.models.hf.guess_layout reads the shapes."""
    from zerodp.models.hf import guess_layout

    said = source.meta.get("names")
    if said in ("hf", "zerodp"):
        return said
    return guess_layout({n: source.info(n).shape for n in source.param_names() if n.endswith("c_attn.weight")})


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


# ---- safetensors files, read and written without mmap (so RSS holds one tensor, not the file) ----

ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file: header parsed and checked against the file size at open."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path} is missing")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path} is truncated ({size} bytes; not even a safetensors header)")
            n = int.from_bytes(head, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{self.path} is truncated or not a safetensors file (header of {n} bytes "
                                      f"in a file of {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path} has a corrupted safetensors header ({e})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        end = 0
        for name, e in header.items():
            if e.get("dtype") not in ST_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {e.get('dtype')}")
            start, stop = e["data_offsets"]
            info = TensorInfo(tuple(e["shape"]), ST_DTYPES[e["dtype"]])
            if stop - start != info.nbytes:
                raise CheckpointError(f"{self.path}: tensor {name} has {stop - start} bytes for shape "
                                      f"{list(info.shape)} {e['dtype']}; the header is corrupted")
            self.entries[name] = (info.dtype, info.shape, 8 + n + start, 8 + n + stop)
            end = max(end, stop)
        if size != 8 + n + end:
            raise CheckpointError(f"{self.path} has {size} bytes but its header describes {8 + n + end} "
                                  f"(truncated or overwritten); re-copy or re-create it")

    def info(self, name: str) -> TensorInfo:
        dtype, shape, _, _ = self.entries[name]
        return TensorInfo(shape, dtype)

    def locate(self, name: str) -> FileRanges:
        _, _, start, stop = self.entries[name]
        return FileRanges(((str(self.path), start, stop - start),))

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, start, stop = self.entries[name]
        buf = torch.empty(stop - start, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(start)
            got = f.readinto(memoryview(buf.numpy()))
        if got != stop - start:
            raise CheckpointError(f"{self.path} ended early while reading {name} (truncated)")
        return buf.view(dtype).reshape(shape)


def write_safetensors_file(path: Path, names: list[str], infos: dict[str, TensorInfo], fetch, metadata: dict,
                           on_bytes=None) -> None:
    """Write a safetensors file tensor by tensor: the header first (shapes are known), then each
    tensor from `fetch(name)`: a tensor already in infos[name].dtype, or the FileRanges of a source
    tensor stored exactly so, copied from file to file (`copy_ranges`). Written to `path.tmp`, renamed
    at the end; its bytes then start for the disk in a background thread (`flush_soon`) while the next
    file is written."""
    header, offset = {}, 0
    for n in names:
        i = infos[n]
        header[n] = {"dtype": ST_NAMES[i.dtype], "shape": list(i.shape), "data_offsets": [offset, offset + i.nbytes]}
        offset += i.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    sources: dict[str, int] = {}  # the files FileRanges point into, opened once each
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for n in names:
                t = fetch(n)
                i = infos[n]
                if isinstance(t, FileRanges):
                    assert t.nbytes == i.nbytes, (n, t, i)
                    f.flush()
                    copy_ranges(t, f.fileno(), f.tell(), sources)
                    f.seek(t.nbytes, os.SEEK_CUR)
                else:
                    assert t.dtype == i.dtype and tuple(t.shape) == i.shape, (n, t.dtype, t.shape, i)
                    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
                del t  # before the next fetch: one tensor in memory at a time, not two
                if on_bytes:
                    on_bytes(i.nbytes)
            if f.tell() != 8 + len(raw) + offset:
                raise CheckpointError(f"{tmp} holds {f.tell()} bytes where its header describes "
                                      f"{8 + len(raw) + offset}")
    finally:
        for fd in sources.values():
            os.close(fd)
    tmp.replace(path)
    flush_soon(path)


# errno values with which copy_file_range says it cannot copy between these two files (another file
# system on an older kernel, a file system without it, a platform without the call): read and write then
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}
_KERNEL_COPY = [hasattr(os, "copy_file_range")]
_COPY_BUFFER = 8 << 20
_BUFFER: list[memoryview] = []  # the fallback's one buffer, made when first needed (the writer's thread only)


def copy_ranges(where: FileRanges, out_fd: int, at: int, opened: dict[str, int]) -> None:
    """Copy the bytes of `where` to `out_fd` from offset `at` on: os.copy_file_range, so the kernel copies
    page cache to page cache and the bytes never enter this process (what `cp` does); positioned
    reads and writes through one reused buffer where it cannot. `opened`: {path: fd} of the source
    files, filled as they are first needed (the caller closes them). CheckpointError if a file ends
    before its range does."""
    for path, offset, n in where.ranges:
        if path not in opened:
            opened[path] = os.open(path, os.O_RDONLY)
        fd, done = opened[path], 0
        while done < n:
            got = _copy_some(fd, out_fd, min(n - done, 1 << 30), offset + done, at + done)
            if got <= 0:
                raise CheckpointError(f"{path} ended {n - done} bytes early (truncated since it was opened)")
            done += got
        at += n


def _copy_some(src: int, dst: int, count: int, src_at: int, dst_at: int) -> int:
    if _KERNEL_COPY[0]:
        try:
            return os.copy_file_range(src, dst, count, src_at, dst_at)
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
            _KERNEL_COPY[0] = False  # the same for every later range: say so once, by not retrying
    if not _BUFFER:
        _BUFFER.append(memoryview(bytearray(_COPY_BUFFER)))
    view = _BUFFER[0][:min(count, _COPY_BUFFER)]
    got = os.preadv(src, [view], src_at)
    done = 0
    while done < got:
        done += os.pwrite(dst, view[done:got], dst_at + done)
    return got


def flush_soon(path: Path) -> threading.Thread:
    """fsync `path` in a daemon thread, so that the disk writes a finished output file while the next one
    is converted: the kernel would otherwise hold its pages until the final fsync (zerodp.checkpoint.safe_output's,
    before publishing; still done, and then has little left to wait for). Errors are left to that one."""
    def run() -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    t = threading.Thread(target=run, name="zerodp-flush", daemon=True)
    t.start()
    return t
