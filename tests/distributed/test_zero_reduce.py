"""bf16 under ZeRO reduces in fp32 (strategy.grad_reduce_dtype's default), so zero1-3 with gradient
accumulation follow ddp, and DeepSpeed's timers never synchronise the device: both on 2 real CPU ranks,
trained by the real loop (4 micro batches per optimizer step)."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from tests.support.harness import run_distributed

BF16_VS_DDP = 0.01
"""Max |loss(zero, bf16) - loss(ddp, bf16)| per step (docs/strategies.md, "Precision semantics at a glance")."""
STEPS = 4
RUN = TINY + ["train.global_batch_size=16", "train.micro_batch_size=2", f"train.max_steps={STEPS}",
              "train.precision=bf16"]  # 2 ranks x 2 x 4 accumulation steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reduce")
    runs = [{"overrides": RUN + [f"strategy.name={s}", f"train.out_dir={tmp / s}"]}
            for s in ("ddp", "zero1", "zero2", "zero3")]
    return run_distributed("tests.support.zero_reduce_workers:counted_runs", 2, {"runs": runs}, timeout=900)[0]


def test_zero_bf16_with_accumulation_follows_ddp(runs):
    ddp = runs[0]
    assert [r["strategy"] for r in runs] == ["ddp", "zero1", "zero2", "zero3"]
    for res in runs[1:]:
        gap = max(abs(a - b) for a, b in zip(res["losses"], ddp["losses"]))
        assert len(res["losses"]) == STEPS and gap < BF16_VS_DDP, (res["strategy"], gap, res["losses"], ddp["losses"])


def test_deepspeed_never_synchronises_the_device(runs):
    """DeepSpeed's accelerator `synchronize`, counted over whole runs of 4 steps x 4 micro batches: with its
    throughput timer on (DeepSpeed's default) every micro batch's forward and the step would call it."""
    for res in runs[1:]:
        assert res["syncs"] / res["steps"] == 0, (res["strategy"], res["syncs"])
