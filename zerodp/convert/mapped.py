"""Memory-mapped checkpoint files: where a tensor of a mapped file lies in it (`file_mappings`,
`file_offset`), the zip records around unread byte ranges of a torch zip file (`_with_records`), and
giving back the resident pages of a tensor already read (`drop_pages`, madvise on Linux). What the
DeepSpeed reader uses to read a parameter's pieces with positioned reads, or let a writer copy them
file to file, and to keep resident memory bounded."""

from __future__ import annotations

import ctypes
import mmap
import struct
import sys
import zipfile
from pathlib import Path

import torch

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


_madvise = _libc_madvise()


def file_mappings(path: Path) -> list[tuple[int, int, int]]:
    """(start address, end address, file offset) of each mapping of `path` in this process (Linux's
    /proc/self/maps); [] if unknown."""
    want = str(Path(path).resolve())
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == want:
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16), int(fields[2], 16)))
    return ranges


def file_offset(t: torch.Tensor, mapped: list[tuple[int, int, int]]) -> int | None:
    """The offset in its file of tensor `t`'s first byte, when `t` lies in one of that file's mappings
    `mapped` (`file_mappings`: torch.load(mmap=True) maps a rank file whole, and its stored records
    are uncompressed); else None."""
    ptr = t.data_ptr()
    for lo, hi, offset in mapped:
        if lo <= ptr and ptr + t.numel() * t.element_size() <= hi:
            return ptr - lo + offset
    return None


def _with_records(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """`ranges` plus, for every stored record of those torch zip files whose data lies wholly inside
    them, the record from its local header on: consecutive unread tensors then make one unread run."""
    from zerodp.checkpoint.manifest import _inside

    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, at, n in ranges:
        by_file.setdefault(path, []).append((at, n))
    out = list(ranges)
    for path, spans in by_file.items():
        try:
            with open(path, "rb") as f:
                records = zipfile.ZipFile(f).infolist()
                for rec in records:
                    if rec.compress_type != zipfile.ZIP_STORED or "/data/" not in rec.filename:
                        continue
                    f.seek(rec.header_offset)
                    head = f.read(30)
                    if len(head) != 30 or head[:4] != b"PK\x03\x04":
                        continue
                    name_len, extra_len = struct.unpack("<HH", head[26:30])
                    data = rec.header_offset + 30 + name_len + extra_len
                    if rec.file_size and _inside(data, data + rec.file_size, spans):
                        out.append((path, rec.header_offset, data + rec.file_size - rec.header_offset))
        except (OSError, zipfile.BadZipFile, ValueError):
            continue  # the data ranges alone, then
    return out


def drop_pages(t: torch.Tensor, mapped: list[tuple[int, int, int]]) -> bool:
    """Give back the resident pages wholly inside tensor `t`'s bytes (madvise MADV_DONTNEED) when they
    lie in one of the file mappings `mapped`: a clean page of a file mapping is re-read from the file if
    touched again, so nothing changes but resident memory (memory not mapped from a file is never
    touched: there MADV_DONTNEED would zero it). True if done; False where it cannot be."""
    if _madvise is None:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if not any(lo <= start and end <= hi for lo, hi, _ in mapped):
        return False
    lo, hi = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    return hi <= lo or _madvise(lo, hi - lo, _MADV_DONTNEED) == 0
