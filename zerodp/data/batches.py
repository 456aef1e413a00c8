"""Data: batches that are pure functions of (seed, step), from the token streams of zerodp.data.streams.

The global batch of optimizer step k is samples [k*B, (k+1)*B) of the split's sample sequence
(zerodp.data.samples: fixed windows of block_size + 1 tokens, visited in a seeded permutation per epoch,
without replacement; several sources blended by weight), so it is the same whatever the world size and
micro-batch split; rank r takes rows [r * per_rank, (r + 1) * per_rank) of it, cut into micro batches.
A run on 1 process and one on N processes therefore see exactly the same samples per step, and
resuming needs only the step number and where the data stood: a run resumed at step s with another
global batch B' takes positions [p + (k-s)*B', p + (k-s+1)*B') at step k, p the samples consumed when
it stopped (`continue_from`; zerodp.trainer.resume), so no sample of the epoch is skipped or repeated.

A micro batch is (x, y), or (x, y, doc_ids) when data.document_masking is on and every source has a
document index (a `zerodp prepare` folder's train.idx/val.idx): doc_ids[r, t] numbers the documents
within row r from 0 (zerodp.data.samples.doc_ids). The loop calls model(*micro_batch); when the model
trains with dropout, with `dropout_keys=` the micro batch's keys (MicroBatches.dropout_keys): each row's
key a function of (seed, step, its row in the global batch), so its dropout masks are the same whichever
rank and micro batch hold it (zerodp.models.dropout).

A source with a loss mask (`zerodp prepare --chat`'s train.mask/val.mask: 1 where a token is a target)
gives y[r, t] = IGNORE_INDEX where the token it holds, token t + 1 of the sample, is not a target:
F.cross_entropy skips it (its ignore_index defaults to -100) and the loss is the mean over the targets.

data.packing=false: sample i is document i of the split's document index (a conversation of `zerodp
prepare --chat`), its first block_size + 1 tokens, padded with id 0 to that length; y is IGNORE_INDEX
over the padding (and where the mask says no target), so padding is never a target.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from zerodp.config import Config
from zerodp.data.samples import Blend, SampleIndex, doc_ids
from zerodp.data.streams import Mixture, Part, PreparedTokens, describe_prepared, load_tokens, plural, prepared_meta
from zerodp.errors import UserError
from zerodp.models.dropout import drops, row_keys

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index: y where no loss is taken

__all__ = ["IGNORE_INDEX", "Located", "Mixture", "PreparedTokens", "Stream", "TokenBatches", "describe_prepared",
           "load_tokens", "pin_batches", "plural", "prefetch", "prepared_meta"]  # train, sample, use import them here


@dataclass
class Stream:
    """One source's split: its tokens, document index (or None) and where they come from."""

    name: str
    weight: float
    tokens: np.ndarray
    index: np.ndarray | None
    where: str
    mask: np.ndarray | None = None  # uint8 per token, 1 = a target (a prepared folder's train.mask)


@dataclass
class Located:
    """Where the rows of a global batch come from: per row its source (index into TokenBatches.streams),
    its sample number within that source's split, and the token offset the sample starts at."""

    source: np.ndarray
    sample: np.ndarray
    start: np.ndarray


def _streams(tokens, cfg: Config, split: str) -> list[Stream]:
    block, evaluating = cfg.model.block_size, bool(cfg.train.eval_every)
    if isinstance(tokens, np.ndarray):
        n_val = int(len(tokens) * cfg.data.val_fraction)
        part = tokens[: len(tokens) - n_val] if split == "train" else tokens[len(tokens) - n_val :]
        where = f"the {'last' if split == 'val' else 'first'} part of {cfg.data.source}"
        streams = [Stream(Path(cfg.data.source).name or cfg.data.source, 1.0, part, None, where)]
    else:
        parts = tokens.parts if isinstance(tokens, Mixture) else [Part(Path(cfg.data.source).name, 1.0, tokens)]
        streams = []
        for p in parts:
            data = p.data
            stream, index = data.split(split)
            if split == "val" and len(stream) <= block + 1 and evaluating:
                raise UserError(f"{data.folder / 'val.bin'} has {len(stream)} tokens, fewer than "
                                f"model.block_size+2={block + 2} for validation; run zerodp prepare with a "
                                f"larger --val-fraction, or set train.eval_every=0")
            read = split
            if split == "val" and not evaluating and len(stream) <= block + 1:
                read = "train"  # eval is off, so val is never read: a short val.bin is no error
                stream, index = data.split(read)
            streams.append(Stream(p.name, p.weight, stream, index, str(data.folder / f"{split}.bin"), data.mask(read)))
    for s in streams:
        if len(s.tokens) <= block + 1:
            raise UserError(f"the {split} split has {len(s.tokens)} tokens, fewer than model.block_size+2="
                            f"{block + 2}; use more data or a smaller block_size / data.val_fraction")
    return streams


class TokenBatches:
    """Deterministic batches from one split (train or val): of a prepared folder's train.bin or val.bin,
    of each folder of a mixture, else of the stream less its last data.val_fraction, or that last part.
    `document_masking` (default: data.document_masking) adds doc_ids to each micro batch where every
    source has a document index; where one lacks it, `note` says masking is off."""

    def __init__(self, tokens, cfg: Config, split: str, document_masking: bool | None = None):
        self.block, self.split = cfg.model.block_size, split
        self.dropout_seed = cfg.train.seed if split == "train" and drops(cfg.model) else None
        """train.seed when training batches carry their rows' dropout keys (the model drops), else None."""
        self.streams = _streams(tokens, cfg, split)
        split_id = 0 if split == "train" else 1
        self.packing = cfg.data.packing
        self.pairs = cfg.train.objective == "dpo"
        """Rows are preference pairs (chosen, rejected adjacent): config validation made sure of the data."""
        if not self.packing:
            lacking = next((s for s in self.streams if s.index is None or not len(s.index)), None)
            if lacking is not None:
                raise UserError(f"data.packing=false takes one document a sample from the document index, and "
                                f"{lacking.where} has none; prepare it again with zerodp prepare, or set "
                                f"data.packing=true")
            documents = SampleIndex.of_pairs if self.pairs else SampleIndex.of_documents
            self.index = [documents(len(s.index), self.block, [cfg.train.seed, split_id, d])
                          for d, s in enumerate(self.streams)]
        else:
            self.index = [SampleIndex(len(s.tokens), self.block, [cfg.train.seed, split_id, d])
                          for d, s in enumerate(self.streams)]
        self.blend = Blend([s.weight for s in self.streams]) if len(self.streams) > 1 else None
        self.bases = np.cumsum([0] + [len(s.tokens) for s in self.streams[:-1]]).astype(np.int64)
        self.origin = (0, 0)
        """(step, position): global batch `step` starts at that position of the sample sequence, each
        later one right after the one before (`continue_from`); (0, 0) unless resumed with another batch."""
        self._readers = [RangeReader(s.tokens) for s in self.streams]
        self._mask_readers = [RangeReader(s.mask) if s.mask is not None else None for s in self.streams]
        masking = cfg.data.document_masking if document_masking is None else document_masking
        lacking = [s for s in self.streams if s.index is None]
        self.with_doc_ids = bool(masking) and not lacking
        self.note = None
        if masking and lacking:
            self.note = (f"data.document_masking is off: {lacking[0].where} has no document index (a folder prepared "
                         f"before zerodp prepare wrote train.idx, raw text, builtin or a .bin file); samples are "
                         f"fixed windows of the stream all the same")

    @property
    def tokens(self) -> np.ndarray:
        """The first (for one source, the only) source's tokens of this split."""
        return self.streams[0].tokens

    def per_source(self) -> list[tuple[str, TokenBatches]]:
        """(name, the batches of that source alone) for each source: validation reports each."""
        if len(self.streams) == 1:
            return [(self.streams[0].name, self)]
        out = []
        for d, s in enumerate(self.streams):
            view = object.__new__(TokenBatches)
            view.__dict__.update(self.__dict__, streams=[s], index=[self.index[d]], blend=None,
                                 _readers=[self._readers[d]], _mask_readers=[self._mask_readers[d]],
                                 bases=np.zeros(1, dtype=np.int64))
            out.append((s.name, view))
        return out

    def samples_per_epoch(self) -> list[int]:
        return [ix.n for ix in self.index]

    def continue_from(self, step: int, position: int) -> None:
        """Global batch `step` starts at sample `position` of the sequence (a resumed run's samples
        consumed), whatever the global batch of the steps before it."""
        self.origin = (step, position)

    def position(self, step: int, rows: int) -> int:
        """The position global batch `step` of `rows` samples starts at: the samples taken before it."""
        at, position = self.origin
        return position + (step - at) * rows

    def locate(self, step: int, rows: int) -> Located:
        """Source, sample and start offset of each of the `rows` rows of global batch `step`: a pure
        function of (seed, step), O(rows) once the epoch's permutation is built."""
        first = self.position(step, rows)
        positions = np.arange(first, first + rows, dtype=np.int64)
        if self.blend is None:
            source, within = np.zeros(rows, dtype=np.int64), positions
        else:
            source, within = self.blend.assign(positions)
        sample = np.empty(rows, dtype=np.int64)
        start = np.empty(rows, dtype=np.int64)
        for d in np.unique(source):
            mask = source == d
            sample[mask] = self.index[d].samples(within[mask])
            start[mask] = sample[mask] * self.block if self.packing else self.streams[d].index[sample[mask]]
        return Located(source, sample, start)

    def epochs(self, steps: int, rows: int) -> list[float]:
        """Epochs each source has completed after `steps` global batches of `rows` samples."""
        done = self.position(steps, rows)
        taken = [done] if self.blend is None else self.blend.counts(done).tolist()
        return [t / ix.n for t, ix in zip(taken, self.index)]

    def offsets(self, step: int, rows: int) -> np.ndarray:
        """Start offsets of the `rows` sequences of global batch `step` (for a mixture into the sources'
        streams laid end to end): a pure function of (seed, step)."""
        where = self.locate(step, rows)
        return self.bases[where.source] + where.start

    def rows(self, offsets: np.ndarray, pin: bool = False) -> tuple[torch.Tensor, ...]:
        """(x, y), with doc_ids (x, y, doc_ids), of the sequences at `offsets`: x and y two views of one
        (B, T+1) buffer (y a copy with IGNORE_INDEX at the non-targets where a source has a loss mask), all
        in page-locked host memory with `pin`."""
        T = self.block
        offsets = np.asarray(offsets, dtype=np.int64)
        source = np.searchsorted(self.bases, offsets, side="right") - 1
        local = offsets - self.bases[source]
        lengths = self._lengths(source, local)
        buf = np.zeros((len(offsets), T + 1), dtype=np.int64)  # (B, T+1); unpacked rows padded with id 0
        for r, (d, o, n) in enumerate(zip(source.tolist(), local.tolist(), lengths.tolist())):
            buf[r, :n] = self._readers[d].read(o, n)
        t = torch.from_numpy(buf)
        if pin:
            t = t.pin_memory()
        x, y = t[:, :-1], t[:, 1:]
        if not self.packing or any(self.streams[d].mask is not None for d in np.unique(source).tolist()):
            y = torch.from_numpy(self._masked_targets(buf, source, local, lengths))
            y = y.pin_memory() if pin else y
        if not self.with_doc_ids:
            return x, y
        ids = np.zeros((len(offsets), T), dtype=np.int64)
        for d in np.unique(source):
            mask = source == d
            ids[mask] = doc_ids(self.streams[d].index, local[mask], T)
        ids = torch.from_numpy(ids)
        return x, y, ids.pin_memory() if pin else ids

    def _masked_targets(self, buf: np.ndarray, source: np.ndarray, local: np.ndarray,
                        lengths: np.ndarray) -> np.ndarray:
        """y of the rows in `buf` (B, T+1) with IGNORE_INDEX where the token y holds is no target: y[r, t] is
        token t + 1 of the sample, so its mask is the mask's entry t + 1; past a row's `lengths` (the
        padding of an unpacked row) no token is one."""
        T, y = self.block, buf[:, 1:].copy()
        for r, (d, o, n) in enumerate(zip(source.tolist(), local.tolist(), lengths.tolist())):
            mask = self.streams[d].mask
            if mask is not None:
                keep = np.zeros(T, dtype=bool)
                keep[: n - 1] = self._mask_readers[d].read(o + 1, n - 1) != 0
                y[r, ~keep] = IGNORE_INDEX
            y[r, n - 1 :] = IGNORE_INDEX
        return y

    def _lengths(self, source: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The real tokens of each row (int64): T + 1, or for an unpacked row its document's length up to
        T + 1 (the document ends where the next one starts)."""
        out = np.full(len(local), self.block + 1, dtype=np.int64)
        if self.packing:
            return out
        for d in np.unique(source):
            rows, index = source == d, self.streams[d].index
            nxt = np.searchsorted(index, local[rows], side="right")
            ends = np.where(nxt < len(index), index[np.minimum(nxt, len(index) - 1)], len(self.streams[d].tokens))
            out[rows] = np.minimum(out[rows], ends - local[rows])
        return out

    def rank_micro_batches(self, step: int, global_batch: int, micro: int, rank: int, world: int,
                           pin: bool = False) -> MicroBatches:
        """This rank's micro batches of global batch `step`: a list of (x, y) (with doc_ids: (x, y,
        doc_ids)), each (micro, T); where a source has a loss mask, with the `weights` that make the
        step's loss the mean over the global batch's targets; where the model drops, with each micro
        batch's rows' `dropout_keys` (`MicroBatches`)."""
        per_rank = global_batch // world
        offsets = self.offsets(step, global_batch)
        mine = offsets[rank * per_rank : (rank + 1) * per_rank]
        out = MicroBatches(self.rows(mine[i : i + micro], pin) for i in range(0, per_rank, micro))
        if self.dropout_seed is not None:
            first = rank * per_rank  # this rank's first row of the global batch
            keys = [self.dropout_keys(step, range(first + i, first + min(i + micro, per_rank)))
                    for i in range(0, per_rank, micro)]
            out.dropout_keys = [k.pin_memory() for k in keys] if pin else keys
        out.step = step
        if self.pairs:  # the objective divides by the global counts itself (zerodp.trainer.objective)
            counts = self.target_counts(offsets)
            out.targets, out.pairs, out.chosen_tokens = int(counts.sum()), global_batch // 2, int(counts[0::2].sum())
            out.parts = global_batch // micro
            mine_docs = self.locate(step, global_batch).sample[rank * per_rank : (rank + 1) * per_rank]
            out.documents = [mine_docs[i : i + micro] for i in range(0, per_rank, micro)]
        elif not self.packing or any(s.mask is not None for s in self.streams):
            counts = self.target_counts(offsets)  # every row of the global batch: no collective needed
            total, parts = int(counts.sum()), global_batch // micro  # parts: world x accumulation
            # every micro batch's weight, rank by rank (n_i * parts / N; 0 without targets)
            weights = counts.reshape(parts, micro).sum(axis=1) * parts / total if total else np.zeros(parts)
            per = per_rank // micro
            out.weights = weights[rank * per : (rank + 1) * per].tolist()
            out.targets = total
            out.spread = float(np.mean(np.square(weights)))
        return out

    def dropout_keys(self, step: int, rows) -> torch.Tensor:
        """The dropout keys (len(rows),) int64 of rows `rows` of global batch `step`
        (zerodp.models.dropout.row_keys): what the model takes as `dropout_keys` for them."""
        assert self.dropout_seed is not None, "dropout keys of batches whose model does not drop"
        return row_keys(self.dropout_seed, step, list(rows))

    def target_counts(self, offsets: np.ndarray) -> np.ndarray:
        """The number of target tokens (y not IGNORE_INDEX) of each row at `offsets` (int64): T where its
        source has no loss mask (for an unpacked row, its real tokens less one)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        source = np.searchsorted(self.bases, offsets, side="right") - 1
        local = offsets - self.bases[source]
        out = self._lengths(source, local) - 1
        for r, (d, o, n) in enumerate(zip(source.tolist(), local.tolist(), out.tolist())):
            mask = self.streams[d].mask
            if mask is not None:
                out[r] = int(np.count_nonzero(self._mask_readers[d].read(o + 1, n)))
        return out


class RangeReader:
    """Reads elements [start, start + n) of a token or mask array. For a memory-mapped file, with
    os.pread from the file rather than through the mapping: a slice of the mapping faults in whole
    page-cache folios around each row (about 1.5 MB a row of 1,025 tokens, measured by
    benchmarks/data_index.py), which then count in the process's RSS; pread copies only the row. Other
    arrays are sliced."""

    def __init__(self, array: np.ndarray):
        self.array, self.fd = array, None
        mm = getattr(array, "_mmap", None)
        if isinstance(array, np.memmap) and mm is not None and array.filename and array.flags.c_contiguous:
            # the file byte of element 0: where numpy's mapping starts in the file plus how far into the
            # mapping this array (or view of it) starts
            mapped = np.frombuffer(mm, dtype=np.uint8)
            start = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY
            self.first = start + (array.ctypes.data - mapped.ctypes.data)
            self.fd = os.open(array.filename, os.O_RDONLY)

    def read(self, start: int, n: int) -> np.ndarray:
        if self.fd is None:
            return np.asarray(self.array[start : start + n])
        n = max(0, min(n, len(self.array) - start))
        size = self.array.dtype.itemsize
        data = os.pread(self.fd, n * size, self.first + start * size)
        return np.frombuffer(data, dtype=self.array.dtype)

    def __del__(self):
        if self.fd is not None:
            os.close(self.fd)


class MicroBatches(list):
    """One rank's micro batches of a step. `weights` (None: all 1): what the loop multiplies each micro
    batch's loss (the mean over its targets) by, n_i * P / N for a micro batch of n_i targets, P = world
    x accumulation micro batches in the step and N targets in the whole global batch. The strategies
    average the P losses (1/accumulation, the mean over ranks), so the step minimises the sum of the
    global batch's target losses over N, whatever the world size or split: a per-micro-batch mean would
    weigh a micro batch of 3 targets as much as one of 300 (docs/fine_tuning.md). Each rank finds N from
    the data alone: the global batch is a pure function of (seed, step)."""

    weights: list[float] | None = None
    targets: int | None = None
    """N, the target tokens of the whole global batch (metrics.jsonl's target_tokens)."""
    dropout_keys: list[torch.Tensor] | None = None
    """Per micro batch its rows' dropout keys (micro,) (zerodp.models.dropout.row_keys of (train.seed,
    step, the row's index in the global batch)); None when the model trains without dropout."""
    step: int = 0
    """The step (0-based) whose global batch these are part of."""
    pairs: int | None = None
    """train.objective=dpo: the global batch's preference pairs (rows / 2)..."""
    chosen_tokens: int = 0
    """...its chosen completions' tokens (the RPO term's count)..."""
    documents: list[np.ndarray] | None = None
    """train.objective=dpo: per micro batch its rows' document numbers in the split (the precomputed
    reference log-probs are looked up by them)."""
    parts: int = 1
    """...and its micro batches, world x accumulation: each micro batch's loss is its pairs' share of the
    global pair mean, times parts, which the strategies' mean over the parts undoes."""
    spread: float = 1.0
    """The mean of the squared weights of the step's P micro batches, every rank's (0 without targets): the
    gradient noise scale's correction for uneven micro batches (zerodp.telemetry.grad_noise)."""


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
