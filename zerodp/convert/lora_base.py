"""The identity of a LoRA run's base model: which frozen weights its adapters were trained on.

A LoRA checkpoint holds the adapters only (and their AdamW state); the base comes back from where the run
took it, model.init_from's weights or, without one, the seeded initial values. meta.json's "lora" record
(`lora_record`) names that source and its sha256, so a resume onto other base weights is refused
(`check_base`) instead of silently training the adapters on a model they were not fitted to, and an
export or merge can say which base its adapters need.

The hash of an init_from source is the sha256 over its files (those the checkpoint reader reads:
zerodp.convert.open_checkpoint's `files()`), each file's digest cached by (path, size, mtime) in
data.cache_dir (default $ZERODP_CACHE or ~/.cache/zerodp), so a 16 GB base is read once per machine, not
once per start; a seeded base hashes "seed:<n>" with the model section that shapes its weights.
Torch-free apart from opening the source (zerodp.convert).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zerodp.errors import UserError

CACHE_FILE = "lora-base-sha256.json"


def cache_dir(cfg=None) -> Path:
    """Where the per-file digests are kept: data.cache_dir, else $ZERODP_CACHE, else ~/.cache/zerodp."""
    given = cfg.data.cache_dir if cfg is not None else None
    return Path(given or os.environ.get("ZERODP_CACHE", Path.home() / ".cache" / "zerodp"))


def file_sha256(path: Path, cache: Path | None) -> str:
    """sha256 of the file at `path`, from `cache`'s record when its size and mtime are unchanged. Safe to
    call from several threads (the record table is read and replaced under a lock; hashlib releases the
    GIL while it hashes, so files hash in parallel)."""
    path = Path(path).resolve()
    st = path.stat()
    key, stamp = str(path), [st.st_size, st.st_mtime_ns]
    table = cache / CACHE_FILE if cache is not None else None
    with _TABLE_LOCK:
        hit = _read_table(table).get(key)
    if hit and hit.get("stamp") == stamp:
        return hit["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    if table is not None:
        with _TABLE_LOCK:
            records = _read_table(table)
            records[key] = {"stamp": stamp, "sha256": digest.hexdigest()}
            try:  # a cache we cannot write costs a re-read next time, nothing else
                table.parent.mkdir(parents=True, exist_ok=True)
                tmp = table.with_name(f"{table.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(records))
                os.replace(tmp, table)
            except OSError:
                pass
    return digest.hexdigest()


_TABLE_LOCK = threading.Lock()
HASH_THREADS = 8
"""Files of a base hashed at once: a sharded base (a 70B model is some 30 files) is read at the disk's
speed rather than one core's sha256 (about 1.5 GB/s), while the other ranks wait for rank 0's start checks."""


def _read_table(table: Path | None) -> dict:
    if table is None or not table.is_file():
        return {}
    try:
        return json.loads(table.read_text())
    except (OSError, ValueError):
        return {}


@functools.lru_cache(maxsize=8)
def _source_sha256(init_from: str, cache: str | None, stamp: tuple) -> str:
    from zerodp.convert import open_checkpoint

    with open_checkpoint(init_from) as source:
        files = sorted({Path(f).resolve() for f in source.files() if Path(f).is_file()})
    root = Path(init_from).resolve()
    root = root if root.is_dir() else root.parent
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(files)))) as pool:
        digests = list(pool.map(lambda f: file_sha256(f, Path(cache) if cache else None), files))
    digest = hashlib.sha256()
    for f, file_digest in zip(files, digests):
        digest.update(f"{os.path.relpath(f, root)}\0{file_digest}\n".encode())
    return digest.hexdigest()


def seeded_sha256(model: dict, seed: int) -> str:
    """The identity of the seeded initial weights of the model section `model` (a Config.to_dict()'s): the
    seed and every base parameter's name and shape, which is all those values depend on
    (DecoderLM.initial_values), so settings that change no weight (dropout, rope, norm epsilon) keep it."""
    from zerodp.models.arch import arch_from_section

    shapes = {name: list(shape) for name, shape in arch_from_section(model).param_shapes().items()}
    return hashlib.sha256(f"seed:{seed}\n{json.dumps(shapes, sort_keys=True)}".encode()).hexdigest()


def base_sha256(init_from: str | None, model: dict, seed: int, cache: Path | None) -> str:
    """The sha256 of a base model: over `init_from`'s files, or of the seeded weights of `model` (a
    Config.to_dict()'s model section) for `seed` without one."""
    if not init_from:
        return seeded_sha256(model, seed)
    p = Path(init_from)
    stamp = (p.stat().st_mtime_ns,) if p.exists() else ()
    return _source_sha256(str(p.resolve()), str(cache) if cache is not None else None, stamp)


def base_identity(cfg) -> dict:
    """{"init_from", "seed", "sha256"} of the base weights a run of `cfg` starts from (computed once per
    process and init_from; the files' digests cached on disk)."""
    sha = base_sha256(cfg.model.init_from, cfg.to_dict()["model"], cfg.train.seed, cache_dir(cfg))
    return {"init_from": cfg.model.init_from, "seed": cfg.train.seed, "sha256": sha}


def lora_record(cfg) -> dict | None:
    """meta.json's "lora" entry of a run of `cfg` (None without model.lora): the adapters' settings and
    the base's identity."""
    from zerodp.models.lora_spec import lora_spec

    spec = lora_spec(cfg.model.lora)
    if spec is None:
        return None
    return {**spec.to_dict(), "base": base_identity(cfg)}


def describe(base: dict) -> str:
    where = f"model.init_from {base.get('init_from')}" if base.get("init_from") else f"train.seed={base.get('seed')}"
    return f"{where} (sha256 {str(base.get('sha256'))[:12]})"


def check_base(ckpt: Path | str, recorded: dict | None, cfg) -> None:
    """Raise UserError (one line, naming both bases) when the base recorded in checkpoint `ckpt`'s "lora"
    entry differs from the one `cfg` builds."""
    if not recorded or not recorded.get("base"):
        return
    theirs, ours = recorded["base"], base_identity(cfg)
    if theirs.get("sha256") == ours["sha256"]:
        return
    if theirs.get("init_from") and ours["init_from"] and Path(theirs["init_from"]).resolve() == \
            Path(ours["init_from"]).resolve():
        raise UserError(f"{ckpt} holds LoRA adapters trained on the base model {theirs['init_from']} "
                        f"(model.init_from), and the weights at that path changed since (sha256 "
                        f"{str(theirs.get('sha256'))[:12]} recorded, {ours['sha256'][:12]} now): they would be "
                        f"resumed on weights they were not fitted to; put the original base back there, or start "
                        f"over with --fresh")
    fix = (f"set model.init_from to {theirs['init_from']}" if theirs.get("init_from")
           else f"remove model.init_from and set train.seed={theirs.get('seed')}")
    raise UserError(f"{ckpt} holds LoRA adapters trained on another base model ({describe(theirs)} there, "
                    f"{describe(ours)} here): they would be resumed on weights they were not fitted to; {fix}, "
                    f"or start over with --fresh")
