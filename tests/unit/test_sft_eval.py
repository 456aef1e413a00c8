"""Validation with a loss mask reports the loss over the target tokens of all its batches: the sum of
their losses over their count (the token-weighted mean), not the mean of per-micro-batch means; the
same for `zerodp eval`'s windows (zerodp.trainer.validate)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY
from tests.support.sampler_workers import write_prepared
from zerodp.config import load_config
from zerodp.data.batches import IGNORE_INDEX, TokenBatches, load_tokens
from zerodp.models import build_model
from zerodp.trainer.validate import evaluate, target_sums, windows_batch

TARGETS = [0.0, 1.0, 0.05, 0.6, 0.0, 0.0, 0.3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    docs = np.random.default_rng(0).integers(4, 61, size=200).tolist()
    return write_prepared(tmp_path_factory.mktemp("masked") / "data", docs, docs[:150], targets=TARGETS)


def token_mean(model, rows):
    """One cross-entropy over every target of every (x, y) in `rows`."""
    logits = torch.cat([model(x).flatten(0, 1) for x, _ in rows])
    return F.cross_entropy(logits, torch.cat([y.flatten() for _, y in rows])).item()


def test_validation_is_the_token_weighted_mean_over_all_eval_batches(folder, group):
    cfg = load_config(None, TINY + [f"data.source={folder}", "train.micro_batch_size=1", "train.eval_batches=6",
                                    "train.eval_every=1"])
    data = TokenBatches(load_tokens(cfg), cfg, "val")
    model = build_model(cfg.model, seed=1)
    strategy = SimpleNamespace(model=model, autocast=contextlib.nullcontext)
    env = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    got = evaluate(strategy, data, cfg, env)["val_loss"]
    rows = [data.rank_micro_batches(i, 1, 1, 0, 1)[0] for i in range(6)]
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in rows]
    assert max(counts) > 3 * max(1, min(counts)), counts  # uneven micro batches: the test can fail
    with torch.no_grad():
        whole = token_mean(model, rows)
        plain = np.mean([model(x, y).item() for x, y in rows if (y != IGNORE_INDEX).any()])
    assert got == pytest.approx(whole, rel=1e-5)
    assert abs(plain - whole) > 1e-3, (plain, whole)


def test_eval_windows_take_the_mask_and_sum_over_targets(folder):
    cfg = load_config(None, TINY + [f"data.source={folder}"])
    tokens = load_tokens(cfg)
    model, T = build_model(cfg.model, seed=1), cfg.model.block_size
    total, n, rows = 0.0, 0, []
    with torch.no_grad():
        for first in range(0, 12, 4):
            x, y = windows_batch(tokens.val, tokens.val_mask, range(first, first + 4), T)
            assert torch.equal(x[0], torch.from_numpy(tokens.val[first * T : first * T + T].astype(np.int64)))
            keep = torch.from_numpy(tokens.val_mask[first * T + 1 : first * T + T + 1].astype(bool))
            assert torch.equal(y[0] != IGNORE_INDEX, keep)
            s, k = target_sums(model(x, y), y)
            total, n = total + float(s), n + k
            rows.append((x, y))
        assert total / n == pytest.approx(token_mean(model, rows), rel=1e-5)
    assert n == int(sum(tokens.val_mask[r * T + 1 : r * T + T + 1].sum() for r in range(12)))


def test_eval_of_a_split_without_targets_says_what_to_do(tmp_path):
    from zerodp.cli.use import _eval_split
    from zerodp.errors import UserError

    folder = write_prepared(tmp_path / "none", [40] * 20, [40] * 5, targets=[0.0])
    cfg = load_config(None, TINY + [f"data.source={folder}"])
    tokens = load_tokens(cfg)
    args = SimpleNamespace(max_tokens=None, batch_size=4, no_progress=True, precision="fp32")
    with pytest.raises(UserError, match=r"^the validation split \(val.bin\) holds no target tokens in its first "
                                        r"192 tokens \(its loss mask is all 0\); evaluate more of it"):
        _eval_split(build_model(cfg.model, seed=1), tokens.val, tokens.val_mask, "val.bin", args,
                    torch.device("cpu"))
