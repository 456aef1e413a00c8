"""A torch.distributed.checkpoint data file's tensor chunks, read straight into the tensors they belong
to: one positioned read per chunk, sorted by file offset (a sequential pass over each file), no copy.

Each chunk in a `.distcp` file is a small torch.save zip (data.pkl, one stored data record). dcp.load
reads it with torch.load into a fresh tensor and copies that into place (two copies, and a planning
round per call); here the zip's directory and its pickle (a restricted unpickler that knows one
function, torch._utils._rebuild_tensor_v2, and the storage types: nothing else is callable) give where
the chunk's bytes lie, and they are read into the destination. A chunk laid out any other way (a
transform, a non-contiguous or big-endian tensor, a compressed record) raises Unsupported: the caller
then reads it with dcp.load, as before.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile

import torch

_STORAGES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}


class Unsupported(Exception):
    """A chunk this reader does not handle (the caller falls back to dcp.load)."""


class Truncated(Exception):
    """The file ends before a chunk's bytes do."""


def _rebuild(storage, storage_offset, size, stride, *_):
    return storage, int(storage_offset), tuple(size), tuple(stride)


class _ChunkUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise Unsupported(f"GLOBAL {module}.{name}")

    def persistent_load(self, pid):
        # ("storage", storage type, key, location, numel), as torch.save writes it
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise Unsupported(f"persistent id {pid!r}")
        return pid[1], str(pid[2]), int(pid[4])


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable file (what zipfile reads)."""

    def __init__(self, fd: int, start: int, length: int):
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.start + self.pos)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


def _contiguous_strides(size: tuple) -> tuple:
    strides, step = [], 1
    for s in reversed(size):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))


def chunk_bytes(fd: int, start: int, length: int, dtype: torch.dtype, size: tuple) -> int:
    """The file offset of the chunk's data: the torch.save blob at [start, start + length) of `fd`
    holding a contiguous tensor of `dtype` and `size` (as .metadata says). Unsupported otherwise."""
    try:
        z = zipfile.ZipFile(_Window(fd, start, length))
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise Unsupported(f"{len(pkl)} data.pkl records")
        prefix = pkl[0][: -len("data.pkl")]
        if prefix + "byteorder" in z.namelist() and z.read(prefix + "byteorder") != b"little":
            raise Unsupported("big-endian data")
        (stored, key, numel), offset, shape, stride = _ChunkUnpickler(io.BytesIO(z.read(pkl[0]))).load()
        rec = z.getinfo(f"{prefix}data/{key}")
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, EOFError, pickle.UnpicklingError, struct.error) as e:
        raise Unsupported(f"{type(e).__name__}: {e}") from None
    n = 1
    for s in shape:
        n *= s
    if stored != dtype or shape != tuple(size) or (n > 1 and stride != _contiguous_strides(shape)):
        raise Unsupported(f"a {stored} {shape} tensor with strides {stride} where {dtype} {tuple(size)} is expected")
    if rec.compress_type != zipfile.ZIP_STORED or rec.file_size != numel * dtype.itemsize or offset + n > numel:
        raise Unsupported("a compressed or short data record")
    head = os.pread(fd, 30, start + rec.header_offset)  # the record's local header: its name and extra field
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise Unsupported("no local header")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return start + rec.header_offset + 30 + name_len + extra_len + offset * dtype.itemsize


def read_into(fd: int, at: int, target: torch.Tensor) -> None:
    """Fill contiguous `target` with the file's bytes from offset `at`; Truncated if the file ends first."""
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], at + done)
        if got <= 0:
            raise Truncated(f"ended {len(view) - done} bytes early")
        done += got
