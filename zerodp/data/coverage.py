"""What data.packing=false never trains: a conversation longer than a sample (block_size + 1 tokens) is
cut to its first block_size + 1 tokens (zerodp.data.batches), so the targets past them are never a
target of any step. Start-up says how many conversations and targets that is, and refuses a run whose
samples hold no target at all (its loss would be 0 every step, its val_loss NaN).

The targets of a source are those of its loss mask (`zerodp prepare --chat`), else every token but the
split's first (what packing would train); the trained ones are those in the first block_size + 1
tokens of each conversation, its first token excepted (the first input, never a label).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zerodp.data.streams import plural
from zerodp.errors import UserError

_CHUNK = 1 << 22  # mask entries summed at a time: memory stays O(chunk + documents)


@dataclass
class Coverage:
    """One source's split under data.packing=false."""

    where: str
    documents: int
    long: int
    """Documents longer than a sample (block_size + 1 tokens)."""
    targets: int
    trained: int
    """Targets within the first block_size + 1 tokens of their document: those some step trains."""


def prefix_sums(mask: np.ndarray, points: np.ndarray) -> np.ndarray:
    """sum(mask[:p]) for each of the ascending `points` (int64, each in [0, len(mask)]), reading `mask` (a
    memmap, say) chunk by chunk."""
    out = np.zeros(len(points), dtype=np.int64)
    base = 0
    for c0 in range(0, len(mask), _CHUNK):
        chunk = np.asarray(mask[c0 : c0 + _CHUNK])
        sums = np.cumsum(chunk, dtype=np.int64)  # sums[k] = sum(chunk[:k + 1])
        lo = np.searchsorted(points, c0 + 1, side="left")  # the points in (c0, c0 + len(chunk)]
        hi = np.searchsorted(points, c0 + len(chunk), side="right")
        out[lo:hi] = base + sums[points[lo:hi] - c0 - 1]
        base += int(sums[-1]) if len(sums) else 0
    return out


def coverage(stream, block: int) -> Coverage:
    """The Coverage of one `zerodp.data.batches.Stream` (with its document index) at `block`."""
    starts = np.asarray(stream.index, dtype=np.int64)
    ends = np.append(starts[1:], len(stream.tokens))
    lengths = ends - starts
    kept = np.minimum(lengths, block + 1)  # the real tokens of each sample
    if stream.mask is None:
        targets, trained = max(0, len(stream.tokens) - 1), int(np.maximum(kept - 1, 0).sum())
    else:
        at = prefix_sums(stream.mask, np.stack([np.minimum(starts + 1, ends), starts + kept], axis=1).ravel())
        targets, trained = int(np.count_nonzero(stream.mask)), int((at[1::2] - at[0::2]).sum())
    return Coverage(stream.where, len(starts), int((lengths > block + 1).sum()), targets, trained)


def unpacked_note(data) -> str | None:
    """For training batches (zerodp.data.batches.TokenBatches) with data.packing=false: one line saying
    what the run never trains, or None when every target is trained (or the data is packed); UserError
    when no sample holds a target."""
    if data.packing:
        return None
    found = [coverage(s, data.block) for s in data.streams]
    sample = f"model.block_size+1={data.block + 1} tokens"
    for c in found:
        if c.trained == 0:
            raise UserError(f"data.packing=false: no sample of {c.where} holds a target: of its "
                            f"{plural(c.documents, 'conversation')}, {c.long:,} are longer than a sample "
                            f"({sample}) and none has a target within its first {data.block + 1} tokens "
                            f"({c.targets:,} targets in all); raise model.block_size or set data.packing=true")
    lost = [c for c in found if c.targets > c.trained]
    if not lost:
        return None
    parts = [f"{c.long:,} of {plural(c.documents, 'conversation')} of {c.where} are longer than a sample, and "
             f"{c.targets - c.trained:,} of its {c.targets:,} targets are never trained" for c in lost]
    return (f"data.packing=false: {'; '.join(parts)} (a sample is a conversation's first {sample}); raise "
            f"model.block_size, drop them at prepare time (--max-len {data.block + 1} --too-long drop), or set "
            f"data.packing=true")
