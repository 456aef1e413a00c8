"""What a `data.source` path holds, as far as the config needs to know: a `zerodp prepare` folder's
meta.json (its vocabulary fills a `model.vocab_size` left unset). Reads one small JSON file; no numpy,
no torch. The folder's writer is `zerodp.data.prepare`, which takes the format's name from here."""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "zerodp-prepare"
"""meta.json's "format" in a folder `zerodp prepare` wrote."""
META = "meta.json"


def prepared_meta(source: str) -> dict | None:
    """meta.json of a `zerodp prepare` folder, or None when `source` is not one. Reads one small file:
    training, the config (a vocabulary left unset) and `zerodp generate`/`eval` ask it what a path is."""
    meta_file = Path(source) / META
    if source == "builtin" or not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None
