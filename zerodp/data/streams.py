"""Data sources: the token stream of each, as a read-only memmap, and for a `zerodp prepare` folder its
two splits with their document indexes; several prepared folders for a mixture (data.sources).

Sources: 'builtin' (the Python standard library's own source files, present wherever Python is, up to
data.max_bytes), a text file, a folder of text files (both read whole; all three byte-level: token =
byte, vocabulary 256), or a pre-tokenized token file (.bin, nanoGPT's layout: a flat array of uint16 or
uint32 token ids). What a text source gave (files, bytes, tokens) is said once on stderr.

A folder written by `zerodp prepare` (it holds meta.json with format "zerodp-prepare") gives its own
splits: train.bin for training and val.bin for validation (data.val_fraction and data.token_dtype are
not used; meta.json says the dtype), and beside each its document index (train.idx, val.idx: the int64
offset of each document's first token), which a folder prepared before the index existed lacks.
Training says what it holds (documents, tokens of each split, tokenizer: describe_prepared) once both
splits passed their checks. A config that leaves model.vocab_size unset gets meta.json's vocab_size
(zerodp.config.take_prepared_vocab); one that sets it must set at least that. A val.bin too short for
one block is an error while train.eval_every > 0 (re-prepare with a larger --val-fraction, or set
train.eval_every=0).

data.sources names several prepared folders of one tokenizer, each with its weight (zerodp.data.samples
blends them): each must be a prepare folder, and all must share the tokenizer (its sha256).
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import sysconfig
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from zerodp.config import Config
from zerodp.data.prepare import plural, prepared_meta
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
    """The two splits of a `zerodp prepare` folder, as read-only memmaps (either may be empty), with
    their document indexes (None for a folder prepared without one)."""

    folder: Path
    meta: dict
    train: np.ndarray
    val: np.ndarray
    train_index: np.ndarray | None = None
    val_index: np.ndarray | None = None
    train_mask: np.ndarray | None = None
    val_mask: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.train) + len(self.val)

    def split(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, document index) of split `name`."""
        return (self.train, self.train_index) if name == "train" else (self.val, self.val_index)

    def mask(self, name: str) -> np.ndarray | None:
        """Split `name`'s loss mask (uint8 per token, 1 = a target: `zerodp prepare --chat`), or None."""
        return self.train_mask if name == "train" else self.val_mask


@dataclass
class Part:
    """One source of a mixture: its name (val_loss/<name>), weight and prepared folder."""

    name: str
    weight: float
    data: PreparedTokens


@dataclass
class Mixture:
    """data.sources: several prepared folders of one tokenizer, blended by weight (zerodp.data.samples)."""

    parts: list[Part] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(p.data) for p in self.parts)


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


def _index_file(folder: Path, meta: dict, split: str, tokens: int) -> np.ndarray | None:
    """The split's document index (meta.json's splits.<split>.index), or None when meta.json names none."""
    about = ((meta.get("splits") or {}).get(split) or {}).get("index")
    if not isinstance(about, dict):
        return None
    path, dtype = folder / str(about.get("file")), np.dtype(about.get("dtype", "int64"))
    if not path.is_file() or path.stat().st_size % dtype.itemsize:
        raise UserError(f"{path}, the document index {folder / 'meta.json'} lists, is missing or not a whole "
                        f"number of {dtype.name} offsets; run zerodp prepare again")
    if path.stat().st_size == 0 or tokens == 0:
        return np.zeros(0, dtype=dtype)
    index = np.memmap(path, dtype=dtype, mode="r")
    if index[0] != 0 or index[-1] >= max(tokens, 1):
        raise UserError(f"{path} does not index {split}.bin (its first document starts at {int(index[0])}, its last "
                        f"at {int(index[-1])} of {tokens} tokens); run zerodp prepare again")
    return index


def _mask_file(folder: Path, meta: dict, split: str, tokens: int) -> np.ndarray | None:
    """The split's loss mask (meta.json's splits.<split>.mask), or None when meta.json names none."""
    about = ((meta.get("splits") or {}).get(split) or {}).get("mask")
    if not isinstance(about, dict):
        return None
    path = folder / str(about.get("file"))
    if not path.is_file() or path.stat().st_size != tokens:
        raise UserError(f"{path}, the loss mask {folder / 'meta.json'} lists, is missing or not one byte per token "
                        f"of {split}.bin ({tokens:,} tokens); run zerodp prepare again")
    return np.memmap(path, dtype=np.uint8, mode="r") if tokens else np.zeros(0, dtype=np.uint8)


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
    train, val = (_split_file(folder, meta, s, np.dtype(dtype)) for s in ("train", "val"))
    data = PreparedTokens(folder, meta, train, val, _index_file(folder, meta, "train", len(train)),
                          _index_file(folder, meta, "val", len(val)), _mask_file(folder, meta, "train", len(train)),
                          _mask_file(folder, meta, "val", len(val)))
    if len(data.train) == 0:
        raise UserError(f"{folder / 'train.bin'} is empty; prepare more documents")
    for split in (data.train, data.val):
        _check_ids(split, cfg, folder)
    return data


def _load_mixture(cfg: Config) -> Mixture:
    """data.sources' folders (the config checked the entries' form and weights): each a prepare folder,
    all of one tokenizer."""
    from zerodp.config.sources import source_entries

    mix, first = Mixture(), None
    for i, (name, path, weight) in enumerate(source_entries(cfg.data)):
        meta = prepared_meta(path)
        if meta is None:
            raise UserError(f"data.sources[{i}].path {path} is not a zerodp prepare folder (no meta.json of format "
                            f"zerodp-prepare); prepare it: zerodp prepare INPUTS --tokenizer TOK --out {path}")
        tok = (meta.get("tokenizer") or {})
        if first is None:
            first = (path, tok)
        elif tok.get("sha256") != first[1].get("sha256"):
            raise UserError(f"data.sources mixes tokenizers: {first[0]} was prepared with {first[1].get('path')}, "
                            f"{path} with {tok.get('path')} (sha256 differs); prepare every source with one tokenizer")
        mix.parts.append(Part(name, weight, _load_prepared(cfg, Path(path), meta)))
    return mix


def describe_prepared(cfg: Config, data) -> str | None:
    """For a prepared folder the line training says once both splits passed their checks (as a text
    source gets one from load_tokens): documents, tokens of each split, the tokenizer; for a mixture one
    such line per source, with its weight; else None."""
    if isinstance(data, Mixture):
        return "\n".join(f"data.sources {p.name} (weight {p.weight:g}): " + _describe(cfg, p.data, str(p.data.folder))
                         for p in data.parts)
    if not isinstance(data, PreparedTokens):
        return None
    return f"data.source={cfg.data.source}: " + _describe(cfg, data, cfg.data.source)


def _describe(cfg: Config, data: PreparedTokens, where: str) -> str:
    meta, splits = data.meta, data.meta.get("splits") or {}

    def documents(n) -> str:
        return plural(int(n or 0), "document")

    cut = meta.get("split_by_tokens") or 0
    between = f" ({cut:,} split by tokens between train and val)" if cut else ""
    train, val = (documents((splits.get(s) or {}).get("documents")) for s in ("train", "val"))
    tokenizer = (meta.get("tokenizer") or {}).get("path")
    pref = meta.get("preference")
    if pref:  # a pair is two documents; what prepare left out is said again here
        pairs = [int((splits.get(s) or {}).get("pairs") or 0) for s in ("train", "val")]
        left = sum((pref.get("skipped") or {}).values())
        between += (f" ({pairs[0]:,} preference pairs in train, {pairs[1]:,} in val; {plural(left, 'row')} of "
                    f"{pref.get('rows', 0):,} skipped at prepare: "
                    + (", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in pref["skipped"].items() if n) or "none")
                    + ")")
    return (f"a zerodp prepare folder, {documents(meta.get('documents'))}{between}, "
            f"{len(data):,} tokens: train {len(data.train):,} ({train}), val {len(data.val):,} ({val}); tokenizer "
            f"{tokenizer} (vocabulary {meta.get('vocab_size')}, model.vocab_size={cfg.model.vocab_size}, "
            f"{data.train.dtype})")


def _check_ids(tokens: np.ndarray, cfg: Config, path: Path) -> None:
    sample_max = int(tokens[: 1 << 20].max()) if len(tokens) else 0
    if sample_max >= cfg.model.vocab_size:
        raise UserError(f"{path} holds token id {sample_max} >= model.vocab_size={cfg.model.vocab_size}; "
                        f"raise model.vocab_size or check data.token_dtype")


def load_tokens(cfg: Config) -> np.ndarray | PreparedTokens | Mixture:
    """The whole token stream as a read-only memmap, or for a `zerodp prepare` folder its two splits,
    or for data.sources their folders. For a text source, rank 0 (or a process without a process group)
    says on stderr what was read: files, bytes and tokens."""
    if cfg.data.sources:
        return _load_mixture(cfg)
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


