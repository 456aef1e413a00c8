"""A wsd run split mid-decay and resumed at another world size follows the uninterrupted trajectory
(zerodp.optim.schedules; the lrs of each schedule are pinned in test_schedules)."""

from __future__ import annotations

import json

import pytest

from zerodp.config import load_config
from zerodp.optim.schedules import wsd_decay

# steps 4..7 decay. The first part (single, 1 process) saves after step 4, the first decay step; the second
# (ddp, 2 ranks, 3 accumulation steps each) resumes there.
WSD = ["optim.schedule=wsd", "optim.decay_steps=6", "optim.decay_fraction=0.5", "optim.decay_shape=1-sqrt",
       "train.max_steps=8"]
SPLIT = 5


def test_wsd_trains_and_resumes_mid_decay_at_another_world_size(tiny, tmp_path):
    from tests.support.harness import run_distributed
    from tests.support.reference import WEIGHT_TOLERANCE, reference_run

    over = tiny + WSD + [f"train.out_dir={tmp_path / 'run'}"]
    cfg = load_config(None, over)
    assert wsd_decay(cfg) == (4, 4)
    ref_losses, ref_weights = reference_run(cfg)  # uninterrupted: one process, plain AdamW, the global batch
    (first,) = run_distributed("tests.support.workers:train_runs", 1, {"runs": [
        {"overrides": over + ["strategy.name=single", f"train.max_steps={SPLIT}"]}]})[0]
    (resumed,) = run_distributed("tests.support.workers:train_runs", 2, {"runs": [
        {"overrides": over + ["strategy.name=ddp"], "fresh": False}]})[0]
    assert first["strategy"] == "single" and resumed["strategy"] == "ddp"
    assert len(first["losses"]) == SPLIT and len(resumed["losses"]) == 8 - SPLIT
    loss_diff = max(abs(a - b) for a, b in zip(first["losses"] + resumed["losses"], ref_losses))
    weight_diff = max((resumed["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert loss_diff < 1e-5 and weight_diff < WEIGHT_TOLERANCE, (loss_diff, weight_diff)
    # the lr each step trained at (metrics.jsonl's step k + 1 is step k): warmup, stable, the 1-sqrt decay
    # from 1e-2 to 1e-3 over steps 4..7 (progress 0, 1/4, 1/2, 3/4), across the resume
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["lr"] for r in records] == pytest.approx(
        [5e-3, 1e-2, 1e-2, 1e-2, 1e-2, 5.5e-3, 3.636039e-3, 2.205771e-3], rel=1e-6)
