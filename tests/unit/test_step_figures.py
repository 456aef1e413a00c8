"""Each step's own throughput, and the steps a median covers (zerodp.telemetry.step_metrics.Throughput):
a launch's first two steps are its warm-up, left out where others remain and named where not (a run
end to end: tests/distributed/test_loop.py)."""

from __future__ import annotations

from zerodp.config import load_config
from zerodp.telemetry.step_metrics import Throughput


def _throughput():
    cfg = load_config("configs/tiny.yaml", ["train.global_batch_size=8", "train.micro_batch_size=8"])
    return Throughput(cfg, 0, 1, 1000, None)


def test_a_resumed_launch_leaves_its_own_first_steps_out():
    t = _throughput()
    t.first_step = 11  # resumed after step 10
    records = [{"step": s} for s in range(11, 16)]
    kept, what = t.measured(records)
    assert [r["step"] for r in kept] == [13, 14, 15] and what == "steps 13-15, warm-up steps 11-12 left out"
    kept, what = t.measured(records[:2])  # only the warm-up ran: kept, and named
    assert [r["step"] for r in kept] == [11, 12] and what == "steps 11-12 (warm-up, all there is)"
    kept, what = t.measured([{"step": 20}])  # a later console line: no warm-up in it
    assert what == "step 20"
