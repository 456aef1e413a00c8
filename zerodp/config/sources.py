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


SOURCE_KEYS = ("path", "weight", "name")


def _entries(data) -> list:
    """data.sources of a DataConfig or of a run's config as a dict."""
    raw = data.get("sources") if isinstance(data, dict) else getattr(data, "sources", None)
    return list(raw or [])


def primary_source(data) -> str:
    """The path whose meta.json gives the vocabulary and the tokenizer: data.sources' first (all share one
    tokenizer), else data.source. `data`: a DataConfig, or the data section of a run's config.yaml."""
    entries = _entries(data)
    if entries and isinstance(entries[0], dict) and isinstance(entries[0].get("path"), str):
        return entries[0]["path"]
    return (data.get("source") if isinstance(data, dict) else data.source) or "builtin"


def source_entries(data) -> list[tuple[str, str, float]]:
    """(name, path, weight) of each of data.sources (checked by check_sources)."""
    return [(str(e.get("name") or Path(e["path"]).resolve().name or e["path"]), str(e["path"]), float(e["weight"]))
            for e in _entries(data)]


def check_sources(data) -> None:
    """data.sources' form: a list of {path, weight[, name]} with weight > 0 and distinct names, and
    data.source left as it was (one or the other). ConfigError otherwise."""
    from zerodp.errors import ConfigError

    entries = _entries(data)
    if not entries:
        return
    example = "e.g. data.sources=[{path: data/a, weight: 0.7}, {path: data/b, weight: 0.3}]"
    if data.source != "builtin":
        raise ConfigError(f"data.source={data.source} and data.sources are both set; give one: a folder in "
                          f"data.source, or a mixture in data.sources")
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("path"), str) or "weight" not in e:
            raise ConfigError(f"data.sources[{i}]={e!r} must be a mapping with path and weight; {example}")
        unknown = sorted(set(e) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"data.sources[{i}] has unknown key {unknown[0]!r}; its keys are path, weight and name")
        w = e["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or w == float("inf"):
            raise ConfigError(f"data.sources[{i}].weight={w!r} ({e['path']}) must be a positive number; drop the "
                              f"source rather than weigh it 0")
    names = [name for name, _, _ in source_entries(data)]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(f"data.sources has two sources named {twice!r}; give one a name: {{path: ..., weight: ..., "
                          f"name: {twice}2}}")


def check_unpacked(data) -> None:
    """data.packing=false reads one document a sample from a prepare folder's document index: every
    source must be a `zerodp prepare` folder whose meta.json lists train.idx. ConfigError otherwise."""
    from zerodp.errors import ConfigError

    paths = [p for _, p, _ in source_entries(data)] or [data.source]
    for path in paths:
        meta = prepared_meta(path)
        if meta is None:
            raise ConfigError(f"data.packing=false reads one conversation a sample from a zerodp prepare folder, and "
                              f"{path} is none; run zerodp prepare --chat and point data.source at its folder, or "
                              f"set data.packing=true")
        if not ((meta.get("splits") or {}).get("train") or {}).get("index"):
            raise ConfigError(f"data.packing=false needs the document index (train.idx) of {path}, prepared before "
                              f"zerodp prepare wrote one; prepare it again, or set data.packing=true")
