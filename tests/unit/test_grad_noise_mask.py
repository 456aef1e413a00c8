"""The gradient noise scale under a loss mask (zerodp.telemetry.grad_noise): micro batches of uneven
target counts reach the hooks weighted by their share of the global batch's targets, and the estimator
takes the spread of those weights. Gradients drawn as a masked step makes them (each micro batch's
gradient the mean of its n_i target tokens' gradients, each token's with covariance tr_tok / d per
dimension), many steps averaged: the estimate is the critical batch in target tokens over the targets
per sequence, and the same norms without the spread are far off."""

from __future__ import annotations

import numpy as np
import pytest

from zerodp.telemetry.grad_noise import NoiseScale

B_SMALL, B_BIG, T = 2, 8, 32  # 4 micro batches of 2 sequences
COUNTS = np.array([3, 40, 10, 75])  # their target tokens: 128 in the global batch, 16 a sequence
TRACE, DIM, DRAWS = 100.0, 4, 20_000


def norms(seed: int) -> tuple[float, float, float]:
    """(mean |G_small|^2, mean |G_big|^2, spread) over DRAWS masked steps, |G|^2 = 1."""
    rng = np.random.default_rng(seed)
    n, parts = COUNTS, len(COUNTS)
    g = np.eye(DIM)[0] + rng.standard_normal((DRAWS, parts, DIM)) * np.sqrt(TRACE / DIM / n)[None, :, None]
    weighted = (n * parts / n.sum())[None, :, None] * g  # (DRAWS, parts, DIM): what the hooks see
    small = np.square(weighted).sum(-1).mean()
    big = np.square(weighted.mean(1)).sum(-1).mean()  # the reduced gradient: the global batch's target mean
    return small, big, float(np.mean(np.square(n * parts / n.sum())))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_spread_of_the_loss_weights_recovers_the_noise_scale(seed):
    small, big, spread = norms(seed)
    truth = TRACE / (COUNTS.sum() / B_BIG)  # 100 target tokens / 16 targets a sequence = 6.25 sequences
    est = NoiseScale(B_SMALL, B_BIG, 0.0, T).update(small, big, spread)
    assert spread == pytest.approx(1.79, abs=0.01)
    assert est["sequences"] == pytest.approx(truth, rel=0.05) and est["tokens"] == est["sequences"] * T
    plain = NoiseScale(B_SMALL, B_BIG, 0.0, T).update(small, big)  # as if the micro batches were even
    assert plain["sequences"] > 1.5 * truth, plain


def test_a_step_that_compares_no_two_batch_sizes_is_left_out():
    noise = NoiseScale(B_SMALL, B_BIG, 0.9, T)
    assert noise.update(5.0, 1.0, spread=0.0) is None and noise.steps == 0  # no targets in the step
    assert noise.update(5.0, 1.0, spread=B_BIG / B_SMALL) is None and noise.steps == 0  # all in one micro batch
    assert noise.update(5.0, 2.0, spread=1.5)["sequences"] == pytest.approx(6.4 / 1.2) and noise.steps == 1
