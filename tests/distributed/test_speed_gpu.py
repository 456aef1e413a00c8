"""The speed settings on a GPU (skipped without one): torch's fused AdamW steps as the default path does,
and the prefetch thread hands over pinned batches. Their CPU halves: tests/unit/test_optim.py,
tests/unit/test_data.py."""

from __future__ import annotations

import pytest

from tests.support.harness import run_distributed


@pytest.mark.gpu(1)
def test_fused_adamw_steps_as_the_default_path_on_a_gpu(tiny):
    """Ten steps of a tiny GPT on one GPU: the fused kernel and the foreach path agree to fp32 rounding."""
    (got,) = run_distributed("tests.support.speed_workers:fused_against_unfused", 1,
                             {"overrides": tiny, "steps": 10}, device="cuda")
    assert got["flags"] == [True, False]
    assert got["max_weight_diff"] < 1e-5, got
    assert max(abs(a - b) for a, b in zip(got["fused_losses"], got["unfused_losses"])) < 1e-4, got


@pytest.mark.gpu(1)
def test_prefetched_batches_arrive_pinned_on_a_gpu(tiny):
    (got,) = run_distributed("tests.support.speed_workers:prefetched_pinned", 1, {"overrides": tiny},
                             device="cuda")
    assert got["pinned"] and all(got["pinned"]) and got["equal"], got
