"""With a loss mask the step's loss is the sum of the global batch's target losses over its target count,
at every world size and micro-batch split: the micro batches' weights (zerodp.data.batches.MicroBatches)
times their mean losses, averaged as the strategies average them (over accumulation and ranks), give
the loss of the whole global batch in one forward. The same data with per-micro-batch means (weights
all 1) gives another number: the test can fail."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import TINY
from tests.support.reference import reference_run
from tests.support.sampler_workers import write_prepared
from zerodp.config import load_config
from zerodp.data.batches import IGNORE_INDEX, TokenBatches, load_tokens
from zerodp.models import build_model
from zerodp.trainer.loop import train

G, T = 12, 32
# Documents of 4 to 60 tokens whose share of targets runs from none to all: micro batches of very uneven
# target counts (3 rows of a few targets beside 3 of many).
TARGETS = [0.0, 1.0, 0.05, 0.6, 0.0, 0.0, 0.3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    docs = np.random.default_rng(0).integers(4, 61, size=400).tolist()
    return write_prepared(tmp_path_factory.mktemp("masked") / "data", docs, docs[:40], targets=TARGETS)


def config(folder, micro):
    return load_config(None, TINY + [f"data.source={folder}", f"train.global_batch_size={G}",
                                     f"train.micro_batch_size={micro}", f"model.block_size={T}"])


@pytest.mark.parametrize("world,micro", [(1, 12), (1, 3), (2, 2), (2, 6), (3, 1), (3, 4)])
def test_the_weighted_micro_batches_give_the_global_batchs_target_mean(folder, world, micro):
    cfg = config(folder, micro)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    model = build_model(cfg.model, seed=1)
    parts = G // micro  # world x accumulation
    for step in (0, 5):
        whole = model(*data.rows(data.offsets(step, G))).item()  # one forward over the global batch
        weighted, plain, counts, weights = 0.0, 0.0, [], []
        for rank in range(world):
            batches = data.rank_micro_batches(step, G, micro, rank, world)
            assert batches.weights is not None and len(batches.weights) == len(batches)
            weights += batches.weights
            for w, (x, y) in zip(batches.weights, batches):
                loss = model(x, y).item()
                weighted += w * loss / parts
                plain += loss / parts
                counts.append(int((y != IGNORE_INDEX).sum()))
        assert weighted == pytest.approx(whole, rel=1e-5, abs=1e-6), (step, weighted, whole)
        # every rank knows the spread of all ranks' weights (the gradient noise scale's correction)
        assert batches.spread == pytest.approx(float(np.mean(np.square(weights))))
        assert (batches.spread > 1.0) == (max(counts) != min(counts))
        if max(counts) > 2 * min(counts):  # uneven micro batches: their plain mean is another number
            assert abs(plain - whole) > 1e-4, (step, plain, whole, counts)  # 10x the equivalence tests' 1e-5


def test_uneven_micro_batches_are_what_the_test_runs_on(folder):
    cfg = config(folder, 1)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    counts = data.target_counts(data.offsets(0, G))
    assert counts.min() <= 4 and counts.max() >= 20, counts
    batches = data.rank_micro_batches(0, G, 1, 0, 1)
    assert batches.weights == pytest.approx(list(counts * G / counts.sum()))
    assert batches.targets == counts.sum() == sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)


def test_a_global_batch_without_targets_weighs_nothing(tmp_path):
    folder = write_prepared(tmp_path / "none", [40] * 50, [40] * 5, targets=[0.0])
    cfg = config(folder, 2)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    batches = data.rank_micro_batches(0, G, 2, 0, 2)
    assert batches.weights == [0.0] * 3
    x, y = batches[0]
    assert (y == IGNORE_INDEX).all() and build_model(cfg.model, seed=1)(x, y).item() == 0.0


def test_without_a_mask_there_are_no_weights(tmp_path):
    folder = write_prepared(tmp_path / "plain", [40] * 50, [40] * 5)
    cfg = config(folder, 2)
    assert TokenBatches(load_tokens(cfg), cfg, "train").rank_micro_batches(0, G, 2, 0, 2).weights is None


def test_rows_are_read_from_the_file_as_the_array_holds_them(tmp_path):
    """RangeReader (pread from a memory-mapped file) gives the slice's values, for a memmap at an offset in
    its file and for views of it (a raw stream's validation part, say), up to the array's end."""
    from zerodp.data.batches import RangeReader

    values = (np.arange(70_000) * 7919 % 65_000).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    values.tofile(path)
    whole = np.memmap(path, dtype=np.uint16, mode="r", offset=2 * 12_345)
    for array in (whole, whole[1000:], whole[40_001:60_000]):
        reader = RangeReader(array)
        assert reader.fd is not None
        for start, n in ((0, 129), (777, 1025), (len(array) - 50, 129)):
            assert np.array_equal(reader.read(start, n), np.asarray(array[start : start + n])), (start, n)
    assert np.array_equal(RangeReader(values).read(5, 10), values[5:15])  # not a file: sliced


def test_single_process_accumulation_follows_one_forward_over_the_global_batch(folder, tmp_path, group):
    """The strategies at world 2 and 3 are held to this in tests/distributed/test_equivalence.py; here
    `single` on one process, 4 micro batches of 3 a step, against plain AdamW on the global batch."""
    cfg = load_config(None, TINY + [f"data.source={folder}", f"train.global_batch_size={G}", "train.micro_batch_size=3",
                                    f"model.block_size={T}", "train.max_steps=4", "optim.lr=1e-3", "optim.min_lr=1e-4",
                                    "strategy.name=single", f"train.out_dir={tmp_path}"])
    ref_losses, ref_weights = reference_run(cfg)
    got = train(cfg, fresh=True, return_weights=True)
    losses = [got["losses"][k] for k in sorted(got["losses"])]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert max((got["weights"][k] - w).abs().max().item() for k, w in ref_weights.items()) < 1e-5
