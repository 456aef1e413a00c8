"""Data: a token stream in a memory-mapped file, and batches that are pure functions of (seed, step).

The global batch of optimizer step k is drawn from a generator seeded with (seed, k, split), so it is
the same whatever the world size and micro-batch split; rank r takes rows
[r * per_rank, (r + 1) * per_rank) of it, cut into micro batches. A run on 1 process and one on N
processes therefore see exactly the same samples per step, and resuming needs only the step number.

Sources: 'builtin' (the Python standard library's own source files, present wherever Python is, up to
data.max_bytes), a text file, a folder of text files (both read whole; all three byte-level: token =
byte, vocabulary 256), or a pre-tokenized token file (.bin, nanoGPT's layout: a flat array of uint16 or
uint32 token ids). What a text source gave (files, bytes, tokens) is said once on stderr.

A folder written by `zerodp prepare` (it holds meta.json with format "zerodp-prepare") gives its own
splits: train.bin for training and val.bin for validation (data.val_fraction and data.token_dtype are
not used; meta.json says the dtype); training says what it holds (documents, tokens of each split,
tokenizer: describe_prepared) once both splits passed their checks. A config that leaves
model.vocab_size unset gets meta.json's vocab_size (zerodp.config.take_prepared_vocab); one that sets
it must set at least that. A val.bin
too short for one block is an error while train.eval_every > 0 (re-prepare with a larger
--val-fraction, or set train.eval_every=0).
"""

from __future__ import annotations

import hashlib
import os
import queue
import socket
import sys
import sysconfig
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from zerodp.config import Config
from zerodp.data.prepare import plural, prepared_meta  # train, sample and use take prepared_meta from here
from zerodp.errors import UserError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".html", ".tex")


def _text_files(source: str) -> list[Path]:
    if source == "builtin":
        root = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in root.glob("*.py"))
    p = Path(source)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"data.source {p} holds no text files ({', '.join(TEXT_SUFFIXES)}); point it at text")
        return files
    raise UserError(f"data.source {source!r} not found; use 'builtin', a text file or folder, or a .bin token file")


def _text_plan(cfg: Config) -> tuple[list[tuple[Path, int]], int]:
    """The files to read with the bytes to take from each, and how many files the source holds.

    A user's own text is read whole. Only the built-in corpus (the standard library's source, tens of
    MB) stops at data.max_bytes, which keeps the demo's tokenizing quick."""
    files = _text_files(cfg.data.source)
    limit = cfg.data.max_bytes if cfg.data.source == "builtin" else None
    plan, total = [], 0
    for f in files:
        n = f.stat().st_size if limit is None else min(f.stat().st_size, limit - total)
        if n > 0:
            plan.append((f, n))
            total += n
        if limit is not None and total >= limit:
            break
    return plan, len(files)


def _cache_dir(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir or os.environ.get("ZERODP_CACHE", Path.home() / ".cache" / "zerodp"))


_CHUNK = 1 << 24  # bytes tokenized at a time: a large text never sits in memory whole


def _tokenize_to_cache(cfg: Config, plan: list[tuple[Path, int]]) -> tuple[Path, bool]:
    """Byte-level tokenize `plan` once into a uint16 memmap file; return its path and whether it was
    already cached."""
    key = hashlib.sha256()
    for f, n in plan:
        st = f.stat()
        key.update(f"{f}:{st.st_size}:{st.st_mtime_ns}:{n}".encode())
    out = _cache_dir(cfg) / f"bytes-{key.hexdigest()[:16]}.bin"
    if out.exists():
        return out, True
    out.parent.mkdir(parents=True, exist_ok=True)
    # unique per process and host: ranks of several nodes may share the cache folder
    tmp = out.with_suffix(f".tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as sink:
        for f, n in plan:
            with open(f, "rb") as text:
                while n > 0 and (chunk := text.read(min(n, _CHUNK))):
                    np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16).tofile(sink)
                    n -= len(chunk)
    os.replace(tmp, out)  # atomic: ranks racing to build the cache all publish the same bytes
    return out, False


def _on_rank0() -> bool:
    """Rank 0 of the process group, or a process without one: the data is loaded on every rank, and
    what it is gets said once."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank() == 0


def _say_what_was_read(cfg: Config, plan: list[tuple[Path, int]], n_files: int, tokens: int, cached: bool) -> None:
    files = f"{len(plan)} of {n_files} files" if len(plan) < n_files else \
        f"{n_files} file{'s' if n_files > 1 else ''}"
    notes = ["cached"] if cached else []
    if cfg.data.source == "builtin":
        notes.append(f"the built-in corpus stops at data.max_bytes={cfg.data.max_bytes:,}")
    print(f"zerodp: data.source={cfg.data.source}: read {files}, {sum(n for _, n in plan):,} bytes -> {tokens:,} "
          f"byte-level tokens" + (f" ({'; '.join(notes)})" if notes else ""), file=sys.stderr, flush=True)


@dataclass
class PreparedTokens:
    """The two splits of a `zerodp prepare` folder, as read-only memmaps (either may be empty)."""

    folder: Path
    meta: dict
    train: np.ndarray
    val: np.ndarray

    def __len__(self) -> int:
        return len(self.train) + len(self.val)


def _split_file(folder: Path, meta: dict, split: str, dtype: np.dtype) -> np.ndarray:
    name = (meta.get("splits") or {}).get(split, {}).get("file", f"{split}.bin")
    path = folder / name
    if not path.is_file():
        raise UserError(f"{path} not found, though {folder / 'meta.json'} lists it; run zerodp prepare again")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise UserError(f"{path} is not a whole number of {dtype.name} tokens (meta.json's dtype); "
                        f"run zerodp prepare again")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)


def _load_prepared(cfg: Config, folder: Path, meta: dict) -> PreparedTokens:
    vocab = int(meta.get("vocab_size") or 0)
    if cfg.model.vocab_size < vocab:
        raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of "
                        f"{folder} (meta.json vocab_size={vocab}); set model.vocab_size >= {vocab}, or leave it "
                        f"unset to take meta.json's")
    dtype = meta.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise UserError(f"{folder / 'meta.json'} gives dtype={dtype!r}, not uint16 or uint32; "
                        f"run zerodp prepare again")
    data = PreparedTokens(folder, meta, *(_split_file(folder, meta, s, np.dtype(dtype)) for s in ("train", "val")))
    if len(data.train) == 0:
        raise UserError(f"{folder / 'train.bin'} is empty; prepare more documents")
    for split in (data.train, data.val):
        _check_ids(split, cfg, folder)
    return data


def describe_prepared(cfg: Config, data: np.ndarray | PreparedTokens) -> str | None:
    """For a prepared folder the line training says once both splits passed their checks (as a text
    source gets one from load_tokens): documents, tokens of each split, the tokenizer; else None."""
    if not isinstance(data, PreparedTokens):
        return None
    meta, splits = data.meta, data.meta.get("splits") or {}

    def documents(n) -> str:
        return plural(int(n or 0), "document")

    cut = meta.get("split_by_tokens") or 0
    between = f" ({cut:,} split by tokens between train and val)" if cut else ""
    train, val = (documents((splits.get(s) or {}).get("documents")) for s in ("train", "val"))
    tokenizer = (meta.get("tokenizer") or {}).get("path")
    return (f"data.source={cfg.data.source}: a zerodp prepare folder, {documents(meta.get('documents'))}{between}, "
            f"{len(data):,} tokens: train {len(data.train):,} ({train}), val {len(data.val):,} ({val}); tokenizer "
            f"{tokenizer} (vocabulary {meta.get('vocab_size')}, model.vocab_size={cfg.model.vocab_size}, "
            f"{data.train.dtype})")


def _check_ids(tokens: np.ndarray, cfg: Config, path: Path) -> None:
    sample_max = int(tokens[: 1 << 20].max()) if len(tokens) else 0
    if sample_max >= cfg.model.vocab_size:
        raise UserError(f"{path} holds token id {sample_max} >= model.vocab_size={cfg.model.vocab_size}; "
                        f"raise model.vocab_size or check data.token_dtype")


def load_tokens(cfg: Config) -> np.ndarray | PreparedTokens:
    """The whole token stream as a read-only memmap, or for a `zerodp prepare` folder its two splits.
    For a text source, rank 0 (or a process without a process group) says on stderr what was read:
    files, bytes and tokens."""
    src = cfg.data.source
    meta = prepared_meta(src)
    if meta is not None:
        return _load_prepared(cfg, Path(src), meta)
    if src != "builtin" and src.endswith(".bin"):
        path, dtype = Path(src), np.dtype(cfg.data.token_dtype)
        if not path.is_file():
            raise UserError(f"data.source {src} not found; give the path of a pre-tokenized .bin file")
        if path.stat().st_size == 0:
            raise UserError(f"data.source {src} is empty; give a .bin file of {dtype.name} token ids")
        if path.stat().st_size % dtype.itemsize:
            raise UserError(f"{src} is not a whole number of {dtype.name} tokens; check data.token_dtype")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    else:
        if cfg.model.vocab_size < 256:
            raise UserError(f"model.vocab_size={cfg.model.vocab_size} is below 256, too small for byte-level "
                            f"text from data.source={src!r}; set model.vocab_size >= 256")
        plan, n_files = _text_plan(cfg)
        if not plan:
            raise UserError(f"data.source {src!r} holds no text (its files are empty); point it at text")
        path, cached = _tokenize_to_cache(cfg, plan)
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if _on_rank0():
            _say_what_was_read(cfg, plan, n_files, len(tokens), cached)
    _check_ids(tokens, cfg, path)
    return tokens


class TokenBatches:
    """Deterministic batches from one split (train or val) of the token stream: a prepared folder's
    train.bin or val.bin, else the stream less its last data.val_fraction, or that last part."""

    def __init__(self, tokens: np.ndarray | PreparedTokens, cfg: Config, split: str):
        self.block = cfg.model.block_size
        if isinstance(tokens, PreparedTokens):
            self.tokens = tokens.train if split == "train" else tokens.val
            if split == "val" and len(self.tokens) <= self.block + 1 and cfg.train.eval_every:
                raise UserError(f"{tokens.folder / 'val.bin'} has {len(self.tokens)} tokens, fewer than "
                                f"model.block_size+2={self.block + 2} for validation; run zerodp prepare with a "
                                f"larger --val-fraction, or set train.eval_every=0")
            if split == "val" and not cfg.train.eval_every:
                # eval is off, so val is never read: a short val.bin is no error
                self.tokens = self.tokens if len(self.tokens) > self.block + 1 else tokens.train
        else:
            n_val = int(len(tokens) * cfg.data.val_fraction)
            self.tokens = tokens[: len(tokens) - n_val] if split == "train" else tokens[len(tokens) - n_val :]
        if len(self.tokens) <= self.block + 1:
            raise UserError(f"the {split} split has {len(self.tokens)} tokens, fewer than model.block_size+2="
                            f"{self.block + 2}; use more data or a smaller block_size / data.val_fraction")
        self.seed = cfg.train.seed
        self.split_id = 0 if split == "train" else 1

    def offsets(self, step: int, rows: int) -> np.ndarray:
        """Start offsets of the `rows` sequences of global batch `step`: a pure function of (seed, step)."""
        rng = np.random.Generator(np.random.PCG64([self.seed, step, self.split_id]))
        return rng.integers(0, len(self.tokens) - self.block - 1, size=rows)

    def rows(self, offsets: np.ndarray, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the sequences at `offsets`: two views of one (B, T+1) buffer, in page-locked host
        memory with `pin` (then both views are pinned too)."""
        T = self.block
        buf = np.stack([np.asarray(self.tokens[o : o + T + 1], dtype=np.int64) for o in offsets])  # (B, T+1)
        t = torch.from_numpy(buf)
        if pin:
            t = t.pin_memory()
        return t[:, :-1], t[:, 1:]

    def rank_micro_batches(self, step: int, global_batch: int, micro: int, rank: int, world: int,
                           pin: bool = False):
        """This rank's micro batches of global batch `step`: a list of (x, y), each (micro, T)."""
        per_rank = global_batch // world
        mine = self.offsets(step, global_batch)[rank * per_rank : (rank + 1) * per_rank]
        return [self.rows(mine[i : i + micro], pin) for i in range(0, per_rank, micro)]


def pin_batches(device: torch.device | None) -> bool:
    """Whether the prefetch thread hands over batches in pinned (page-locked) host memory: for a CUDA
    device only. A copy from pinned memory with non_blocking=True is an asynchronous DMA that overlaps
    the step already queued; from pageable memory the same call stages through a pinned buffer and
    blocks the host until the copy is done. On the CPU (and without a device) batches stay as they are."""
    return device is not None and torch.device(device).type == "cuda"


def prefetch(batches: TokenBatches, steps: range, cfg: Config, rank: int, world: int, depth: int,
             device: torch.device | None = None) -> Iterator:
    """Yield (step, micro_batches) for `steps`, prepared `depth` steps ahead by a background thread;
    for a CUDA `device` that thread pins them (`pin_batches`), off the training thread's time. With depth
    0 the training thread prepares each step itself, unpinned."""
    t = cfg.train
    pin = pin_batches(device)
    if depth == 0:
        for s in steps:
            yield s, batches.rank_micro_batches(s, t.global_batch_size, t.micro_batch_size, rank, world)
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        try:
            for s in steps:
                item = (s, batches.rank_micro_batches(s, t.global_batch_size, t.micro_batch_size, rank, world, pin))
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(None)
        except BaseException as e:  # hand it to the training thread: a dead producer must not hang it
            q.put(e)

    thread = threading.Thread(target=work, daemon=True, name="zerodp-prefetch")
    thread.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # Wait for the producer to leave: a thread still inside torch when Python shuts down aborts
        # the process. It notices `stop` within 0.1 s of finishing the batch at hand.
        thread.join(timeout=30)
