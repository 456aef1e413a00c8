"""Which samples a global batch holds: the sample index, the per-epoch shuffle, the blend of several
sources and the document ids of a row, as pure functions of (seed, step). numpy only, no torch.

Sample index. A split's token stream (a prepared folder's train.bin, say: its documents packed end to
end, each followed by its separator) is cut into n = (tokens - 1) // T samples of T + 1 tokens (T:
model.block_size): sample i is tokens [i*T, i*T + T + 1). Consecutive samples share their boundary
token, as Megatron-LM's GPTDataset does (add_extra_token_to_sequence; helpers.cpp build_sample_idx):
the last token of sample i is only its label, and the first input of sample i + 1. So every token
but the first is a label exactly once an epoch, and the (tokens - 1) % T tokens after the last sample
never are. The index is this formula: nothing is stored.

Shuffle. Epoch e visits the n samples in the order of a permutation drawn from a generator seeded with
(seed, split, epoch): every sample exactly once an epoch, in a new order each epoch (Megatron's
shuffle index, _build_shuffle_index in megatron/core/datasets/gpt_dataset.py, shuffles once over all
epochs it builds; here each epoch has its own, so none needs knowing how many epochs there will be).
The concatenated epoch orders are one sequence of sample positions: global batch k holds positions
[k*B, (k+1)*B). Position p is sample perm_{p // n}[p % n]: finding a batch at step 10^6 computes its
epoch directly and costs what it costs at step 1, the permutation of that epoch (one array of n
int32, built on first use and kept until another epoch is needed) and then O(B).

Blend. Several sources share one sequence of positions; position p goes to a source and to a position
within it, each source then keeping its own epochs and permutations. The choice is a rounding rule
(a Sturmian sequence) rather than Megatron's greedy error minimisation (helpers.cpp
build_blending_indices), which needs the whole history: source 0 takes position p iff
round(w0 (p+1)) > round(w0 p), so of any L consecutive positions it holds floor(w0 L) or ceil(w0 L):
within one sample of w0 L over ANY window, not only from the start. The positions it leaves go to
sources 1.. by the same rule with weight w1 / (1 - w0), and so on. With two sources both are exact in
that sense; with more, the first is and the others stay within two samples of w L over any window
(tests/unit/test_samples.py measures it). Exact for every window is impossible in general: a sequence
over three or more sources whose every window is within one sample of w L is a balanced word, and
balanced words with distinct rates have rates (2^(K-1), ..., 2, 1) / (2^K - 1) only (Fraenkel's
conjecture, proved for K <= 7).

Document ids. With the document index (a prepared folder's train.idx: each document's first token
offset), a row's doc_ids[t] is the number of document starts in (start, start + t], so 0 for the
document the row starts in and up by one at each start inside it: O(log D) a row (np.searchsorted).
"""

from __future__ import annotations

import numpy as np


class SampleIndex:
    """One split's samples: n fixed windows of T + 1 tokens of a stream of `tokens` tokens, and the
    order epoch e visits them in, from a generator seeded with (*key, e) (key: seed, split, source)."""

    def __init__(self, tokens: int, block: int, key: list[int]):
        self.block, self.key = block, [int(k) for k in key]
        self.n = max(0, (tokens - 1) // block)
        self._epoch, self._perm = -1, None

    @classmethod
    def of_documents(cls, documents: int, block: int, key: list[int]) -> SampleIndex:
        """One sample per document (data.packing=false): sample i is document i of the split."""
        index = cls(0, block, key)
        index.n = documents
        return index

    @classmethod
    def of_pairs(cls, documents: int, block: int, key: list[int]) -> SampleIndex:
        """One sample per document, documents (2i, 2i+1) a preference pair (zerodp prepare --preference) that
        stays whole and in order: the epoch visits the pairs in a seeded order, position p being document
        2 pair + p % 2 of pair p // 2 of that order (PairIndex)."""
        return PairIndex(documents, block, key)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order: a permutation of range(n) (int32 below 2^31 samples), built on first
        use and kept until another epoch is asked for."""
        if epoch != self._epoch:
            dtype = np.int32 if self.n < 2**31 else np.int64
            perm = np.arange(self.n, dtype=dtype)
            np.random.Generator(np.random.PCG64([*self.key, epoch])).shuffle(perm)
            self._epoch, self._perm = epoch, perm  # one assignment: a reader sees a matching pair
        return self._perm

    def samples(self, positions: np.ndarray) -> np.ndarray:
        """The sample numbers at `positions` of the concatenated epoch orders (int64)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(len(positions), dtype=np.int64)
        epochs = positions // self.n
        for e in np.unique(epochs):  # a batch spans at most a few epochs
            mask = epochs == e
            out[mask] = self.permutation(int(e))[positions[mask] - e * self.n]
        return out

    def starts(self, positions: np.ndarray) -> np.ndarray:
        """Token offsets of the samples at `positions`: sample i starts at i * T."""
        return self.samples(positions) * self.block


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5).astype(np.int64)


class Blend:
    """Positions of one sequence shared out among sources in the proportions of `weights` (positive,
    normalised here): see the module's docstring."""

    def __init__(self, weights: list[float]):
        w = np.asarray(weights, dtype=np.float64)
        assert len(w) >= 1 and (w > 0).all(), weights
        w = w / w.sum()
        left = 1.0 - np.concatenate([[0.0], np.cumsum(w)[:-1]])  # the share still to give out before source d
        self.weights = w
        self.shares = np.minimum(1.0, w / np.maximum(left, 1e-300))  # source d's share of what it is offered
        self.shares[-1] = 1.0

    def assign(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, position within that source) of each of `positions` (int64 arrays)."""
        q = np.asarray(positions, dtype=np.int64).copy()
        source = np.full(len(q), len(self.weights) - 1, dtype=np.int64)
        within = q.copy()
        open_ = np.ones(len(q), dtype=bool)
        for d, share in enumerate(self.shares[:-1]):
            taken_before = _round(share * q)
            takes = open_ & (_round(share * (q + 1)) > taken_before)
            source[takes], within[takes] = d, taken_before[takes]
            open_ &= ~takes
            q = np.where(open_, q - taken_before, q)  # the position among those source d left
            within[open_] = q[open_]
        return source, within

    def counts(self, positions: int) -> np.ndarray:
        """How many of positions [0, positions) each source holds (int64, one per source)."""
        out, q = np.zeros(len(self.weights), dtype=np.int64), int(positions)
        for d, share in enumerate(self.shares[:-1]):
            out[d] = int(_round(np.float64(share) * q))
            q -= out[d]
        out[-1] = q
        return out


def doc_ids(index: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """(rows, length) int64: for each row starting at token `starts[r]`, the document of each of its
    first `length` tokens, counted from 0 at the row's first token; `index` holds the documents' first
    token offsets, ascending."""
    starts = np.asarray(starts, dtype=np.int64)
    lo = np.searchsorted(index, starts, side="right")  # first document starting after the row's start
    hi = np.searchsorted(index, starts + length, side="left")  # first starting at or past its end
    inside = hi - lo  # document starts inside each row
    row = np.repeat(np.arange(len(starts)), inside)
    which = np.arange(int(inside.sum())) - np.repeat(np.cumsum(inside) - inside, inside) + np.repeat(lo, inside)
    marks = np.zeros((len(starts), length), dtype=np.int64)
    marks[row, np.asarray(index[which], dtype=np.int64) - starts[row]] = 1  # distinct starts: no repeats
    return np.cumsum(marks, axis=1)


def documents_of(index: np.ndarray, start: int, length: int) -> tuple[int, int]:
    """The first and last document (numbers in the split) the tokens [start, start + length) belong to."""
    first = int(np.searchsorted(index, start, side="right")) - 1
    last = int(np.searchsorted(index, start + length - 1, side="right")) - 1
    return max(first, 0), max(last, 0)


class PairIndex(SampleIndex):
    """SampleIndex.of_pairs: n documents, pairs (2i, 2i+1) adjacent at every even position, whatever the
    global batch (an even number of rows: train.objective=dpo's validation) or the epoch boundary."""

    def __init__(self, documents: int, block: int, key: list[int]):
        super().__init__(0, block, key)
        self.n = documents - documents % 2
        self._pairs = SampleIndex.of_documents(documents // 2, block, key)

    def samples(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        return 2 * self._pairs.samples(positions // 2) + positions % 2
