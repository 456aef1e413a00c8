"""Start-up memory, measured from outside (issue 11, item 5): when rank 0 prints its strategy line, every
rank's start-up is over (construction, initialisation, loading; a barrier precedes the line). Each rank's
peak RSS growth over a tiny model's run must match the planner's start-up prediction for the run within
20%, and under fsdp stay below 0.7 x the whole model's fp32 size: a rank that builds the full model
before sharding it has already held 1.0 x; a sharded start-up holds its shard (0.5 x on 2 ranks).

zero3 is held to the planner only: before its first step DeepSpeed's engine allocates 16 bytes per
parameter of the rank's partition in fp32 (the partition, its flattened copy, a separate fp32 master,
the gradient partition buffer), 2 x the fp32 model at N=2 however the model is built; meta-device
construction removes the full model each rank used to build first, which on GPUs was also moved to the
device whole (docs/memory_model.md, "Start-up").

The measurement is benchmarks/startup_memory.py's: `zerodp train` under torchrun on 2 CPU processes,
each rank's VmHWM read from /proc when the line arrives, the run then stopped (its steps are not wanted).
"""

from __future__ import annotations

import pytest

from benchmarks.startup_memory import BASELINE, MB, measure, model_figures, model_overrides

WORLD = 2
# 8 x 512: 25M parameters, 102 MB fp32, far above the run-to-run noise of a rank's peak (a few MB): fsdp's
# sharded start-up (0.5 x, ~51 MB a rank) is 51 MB from a full build's 1.0 x, and 20% of the planner's
# prediction is 11 MB (fsdp) and 35 MB (zero3). Measured: 0.93 x the prediction under both (8 x 1024, four
# times the start-up work: 0.88-0.93 x).
MODEL = model_overrides(layers=8, width=512, heads=8)


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_no_rank_grows_by_the_whole_model_during_startup(strategy, monkeypatch):
    # glibc keeps freed chunks below its mmap threshold (which grows up to 32 MiB) in its heap, so the
    # RSS of a model this small counts copies DeepSpeed has already freed (its flattened partitions, up
    # to 1.4 x the prediction); at 1 MiB RSS follows the live tensors, as it does for a large model's
    # partitions under the default (benchmarks/startup_memory.py: 1.04 x at 24 x 2048).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))
    common = [f"strategy.name={strategy}", "train.precision=fp32"]
    fp32, predicted = model_figures(MODEL + common, WORLD, strategy)
    base = measure(BASELINE + common, WORLD)
    big = measure(MODEL + common, WORLD)
    # Every rank found and measured: a missed rank must fail, not pass vacuously.
    assert sorted(base.peak) == sorted(big.peak) == list(range(WORLD)), (base.peak, big.peak)
    assert all(p > 100 * MB for p in base.peak.values()), f"a rank with torch loaded holds > 100 MB: {base.peak}"
    growth = {r: big.peak[r] - base.peak[r] for r in range(WORLD)}
    figures = ", ".join(f"rank {r}: {growth[r] / MB:,.0f} MB = {growth[r] / fp32:.2f} x" for r in range(WORLD))
    # Each rank holds at least half its shard of the weights: far less means the measurement missed them.
    assert all(g > 0.5 * fp32 / WORLD for g in growth.values()), f"{figures} of the {fp32 / MB:,.0f} MB fp32 model"
    assert predicted, "the planner predicts a start-up peak for this run"
    assert all(0.8 < g / predicted < 1.2 for g in growth.values()), (
        f"{strategy}: peak RSS growth during start-up {figures}; the planner predicted {predicted / MB:,.0f} MB")
    if strategy == "fsdp":
        assert all(g < 0.7 * fp32 for g in growth.values()), (
            f"{strategy}: peak RSS growth during start-up {figures} of the whole fp32 model ({fp32 / MB:,.0f} MB); "
            f"a sharded start-up stays below 0.7 x")
