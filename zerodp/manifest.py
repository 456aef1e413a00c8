"""A checkpoint folder's manifest: its format version, `meta.json`, and the size and sha256 of every
file, checked before anything is read. Shared by training (zerodp.checkpoint) and conversion
(zerodp.convert), which import it and not each other."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT_VERSION = 1
META = "meta.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify(ckpt: Path, deep: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """Return None if `ckpt` is complete and intact, else the reason it is not (naming the file).

    Every file's presence and size are checked; with `deep`, the sha256 of the files in this
    `share` = (index, count) of the sorted manifest, so that `count` ranks together hash each file once."""
    meta_path = ckpt / META
    if not meta_path.is_file():
        return f"{ckpt} has no {META} (an interrupted save)"
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        return f"{meta_path} is not valid JSON ({e})"
    files = sorted(meta.get("files", {}).items())
    for rel, info in files:
        p = ckpt / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != info["bytes"]:
            return f"{p} has {p.stat().st_size} bytes, {info['bytes']} were saved (truncated or overwritten)"
    if deep:
        index, count = share
        for rel, info in files[index::count]:
            if sha256_file(ckpt / rel) != info["sha256"]:
                return f"{ckpt / rel} fails its sha256 check (corrupted)"
    return None
