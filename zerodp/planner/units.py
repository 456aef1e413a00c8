"""Reading and printing sizes: `80GB`, `80GiB`, `7.5e9`, `7B`.

GB means 10**9 bytes and GiB 2**30, as on datasheets and in `nvidia-smi` respectively; a bare
number of bytes is refused because users mean one or the other and guessing would be off by 7%.
"""

from __future__ import annotations

import difflib
import math
import re

from zerodp.errors import UserError

COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one element in the compute dtype of each train.precision."""

_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = r"([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def parse_bytes(text: str, what: str = "--hbm", example: str = "80GB") -> int:
    """Bytes in `text` such as '80GB' (80e9), '80GiB' (80*2**30), '512 GB'; UserError otherwise,
    also for zero, negative, infinite and sub-byte sizes. `example` is what the message suggests."""
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)", str(text).strip().lower())
    if m and float(m.group(1)) <= 0:  # before the unit check: '0' lacks a unit, but 0 is what is wrong
        raise UserError(f"{what} {text!r} must be positive; write a size such as {example}")
    if not m or m.group(2) not in _BYTE_UNITS:
        raise UserError(
            f"{what} {text!r} is not a size; write a number and a unit, e.g. {example}; GB means 1e9 bytes, "
            f"GiB 2**30; units: KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    value = float(m.group(1)) * _BYTE_UNITS[m.group(2)]
    if not math.isfinite(value):
        raise UserError(f"{what} {text!r} is too large to be a size; write one such as {example}")
    if value < 1:
        raise UserError(f"{what} {text!r} is less than one byte; write a size such as {example}")
    return int(value)


def parse_count(text: str, what: str = "--params") -> int:
    """A count such as '7.5e9', '7B', '124M', '1,557,611,200'; UserError otherwise, also for
    counts that are zero, negative, infinite or round to zero."""
    m = re.fullmatch(_NUMBER + r"([kmbt]?)", str(text).strip().lower().replace(",", "").replace("_", ""))
    if not m:
        raise UserError(f"{what} {text!r} is not a number; write e.g. 7.5e9, 7B or 124M")
    value = float(m.group(1)) * _COUNT_SUFFIXES[m.group(2)]
    if not math.isfinite(value):
        raise UserError(f"{what} {text!r} is too large; write a count such as 7B")
    if round(value) < 1:
        raise UserError(f"{what} {text!r} must be positive (at least 1), e.g. 7B")
    return int(round(value))


def gb(n: float) -> str:
    """Bytes as decimal GB with one decimal, e.g. '13.5 GB'."""
    return f"{n / 1e9:.1f} GB"


def human_count(n: int) -> str:
    """A parameter count as '124.4M' or '6.74B'."""
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    if n >= 10**6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}K" if n >= 10**3 else str(n)


_DURATIONS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def seconds(s: float) -> str:
    """A duration given in seconds, in the largest unit of s, ms, µs, ns that keeps it at 1 or more, to
    three significant digits: '1.23 s', '850 ms', '29.4 ms', '41.7 µs'; whole from 100 up ('1,250 s');
    zero is '0 s'. Durations a tiny model's step is made of stay apart ('31.2 µs vs 14.9 µs', not '0 ms')."""
    if s <= 0:
        return "0 s"
    unit, scale = next(((u, k) for u, k in _DURATIONS if round(s / k, 2) >= 1), _DURATIONS[-1])
    v = s / scale
    digits = next((d for d, below in ((2, 10), (1, 100)) if round(v, d) < below), 0)
    return f"{v:,.{digits}f} {unit}"


def lookup(table: dict, name: str, what: str, otherwise: str):
    """table[name] (case-insensitive), or a UserError naming the closest key and all known ones."""
    key = name.strip().lower()
    if key not in table:
        close = difflib.get_close_matches(key, list(table), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"unknown {what} {name!r}; {hint}known {what}s: {', '.join(table)} ({otherwise})")
    return table[key]


def aligned(rows: list) -> list[str]:
    """Table rows (sequences of strings, the first the header) as lines: the first column left-aligned, the
    others right-aligned, each as wide as its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)).rstrip()
            for r in rows]


def side_by_side(rows: list, base_rows: list, base: tuple[str, str], this: tuple[str, str], extra_heads=(),
                 extra=lambda e: ()) -> list[tuple]:
    """The table rows (header first) of two plans' estimates by strategy, `rows` beside `base_rows` of the same
    name (a row without one is left out): each one's total GB per GPU and whether it fits, `extra`'s columns
    of the row, then each one's checkpointing mode and step. `base`, `this`: (column name, short name)."""
    by_name = {e.name: e for e in base_rows}
    table = [("strategy", base[0], "fits", this[0], "fits", *extra_heads, f"ckpt {base[1]}/{this[1]}",
              f"step {base[1]}/{this[1]}")]
    for e in rows:
        b = by_name.get(e.name)
        if b is None:
            continue
        table.append((e.name, f"{b.total_bytes / 1e9:.1f}", "yes" if b.fits else "NO", f"{e.total_bytes / 1e9:.1f}",
                      "yes" if e.fits else "NO", *extra(e),
                      f"{b.activation_checkpointing}/{e.activation_checkpointing}",
                      f"{seconds(b.step_s)}/{seconds(e.step_s)}"))
    return table
