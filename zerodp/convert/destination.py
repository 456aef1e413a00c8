"""Where `zerodp convert` may write, checked before the source is opened: a DST that overlaps an input,
holds a training run or foreign files, or is the output of another target is refused; and the sizes its
options take. No torch import: the command checks all this (and starts hashing the source) while torch
is still loading."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from zerodp.checkpoint.safe_output import check_output
from zerodp.errors import UserError

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")  # beside the weights
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, what: str = "--max-shard-size") -> int:
    """'5GB' -> 5_000_000_000 (HF's decimal units); '10MiB', '123' (bytes) also accepted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{what} {text!r} is not a size; write it like 5GB, 500MB or 10MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# A `zerodp convert` output records that convert made it in the metadata it has always written, so
# no extra file rides along to the hub: a zerodp checkpoint's meta.json has `converted_from`; a
# safetensors export has `zerodp.source` in every file's header metadata (and the index's) and no
# meta.json; a Hugging Face export is one whose files also say `zerodp.layout: hf`, with the
# config.json written beside them. Either is replaceable only if it holds nothing else: a user's
# tokenizer added to an export folder (or a config.json added to a --to safetensors one) would be lost.
_EXPORT_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|" + re.escape(INDEX))
HF_CONFIG = "config.json"
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # zerodp.convert.peft's
PEFT_BASE = "base"  # zerodp.convert.peft.BASE_FOLDER: a seeded base, written inside as a --to hf export


def _is_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink() and any(p.iterdir())


def check_destination(dst: str | Path, to: str, overwrite: bool, inputs=()) -> None:
    """Refuse (UserError) a `dst` that `zerodp convert --to {to}` may not write: one that overlaps an
    input, a file, a non-empty folder without `overwrite`, or one that is not an earlier output of
    `--to {to}` (a training run or checkpoint, foreign files, another target's output)."""
    def not_replaceable(folder: Path) -> str | None:
        kind, why = convert_output_kind(folder)
        if kind is None:
            return why
        return None if kind == to else f"is the output of `zerodp convert --to {kind}`"

    check_output(dst, inputs, overwrite, f"zerodp convert --to {to}", not_replaceable)


def convert_output_kind(folder: Path) -> tuple[str | None, str]:
    """("safetensors" | "hf" | "zerodp" | "peft", "") if non-empty `folder` is an earlier `zerodp convert`
    output and holds nothing else; else (None, what it is instead)."""
    entries = sorted(folder.iterdir())
    if (folder / PEFT_FILES[0]).is_file():  # a PEFT adapter: ours if its weights' metadata says so
        foreign = [p.name for p in entries if (p.name not in PEFT_FILES or not p.is_file() or p.is_symlink())
                   and not (p.name == PEFT_BASE and _is_dir(p) and convert_output_kind(p)[0] == "hf")]
        if foreign:
            return None, f"holds {foreign[0]}, which zerodp convert did not write"
        if "zerodp.source" not in _header_metadata(folder / PEFT_FILES[1]):
            return None, "is a PEFT adapter folder zerodp convert did not write"
        return "peft", ""
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except (ValueError, OSError):
            return None, "holds a meta.json that is not valid JSON"
        if not isinstance(meta, dict) or "converted_from" not in meta:
            return None, "is a checkpoint written by training (its meta.json has no converted_from)"
        listed = set(meta.get("files") or {}) | {"meta.json"}
        foreign = [p.name for p in entries if p.name not in listed or not p.is_file() or p.is_symlink()]
        return (None, f"holds {foreign[0]}, which zerodp convert did not write") if foreign else ("zerodp", "")
    layouts, tokenizer_files = set(), {}
    for p in entries:
        if p.name == HF_CONFIG and p.is_file() and not p.is_symlink():
            continue
        if p.name in TOKENIZER_FILES and p.is_file() and not p.is_symlink():
            continue  # checked below against the sha256 the weights' metadata records
        if not _EXPORT_NAME.fullmatch(p.name) or not p.is_file() or p.is_symlink():
            return None, f"holds {p.name}, which zerodp convert did not write"
        md = _index_metadata(p) if p.name == INDEX else _header_metadata(p)
        if "zerodp.source" not in md:
            return None, f"holds {p.name}, which zerodp convert did not write (no zerodp.source in its metadata)"
        layouts.add(md.get("zerodp.layout"))
        tokenizer_files.update(json.loads(md.get("zerodp.tokenizer_files") or "{}"))
    for p in entries:
        if p.name in TOKENIZER_FILES and tokenizer_files.get(p.name) != hashlib.sha256(p.read_bytes()).hexdigest():
            return None, f"holds {p.name}, which zerodp convert did not write (or which was changed since)"
    if not layouts:
        return None, f"holds {HF_CONFIG}, which zerodp convert did not write (no weights of ours beside it)"
    kind = "hf" if layouts == {"hf"} and (folder / HF_CONFIG).is_file() else "safetensors"
    if kind == "safetensors" and (folder / HF_CONFIG).exists():
        return None, f"holds {HF_CONFIG}, which zerodp convert --to safetensors did not write"
    return kind, ""


def _header_metadata(path: Path) -> dict:
    """A safetensors file's `__metadata__`, read leniently (a damaged earlier export is still ours)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n <= 100 * 2**20 else {}
        return dict(header.get("__metadata__") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _index_metadata(path: Path) -> dict:
    try:
        return dict(json.loads(path.read_text()).get("metadata") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
