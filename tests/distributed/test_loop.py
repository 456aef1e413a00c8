"""The loop waits for the device only at its sync points (every train.log_every steps, checkpoints,
validations, the last step), yet metrics.jsonl gets every step; tokens/s, MFU and the run summary
follow from the records by their definitions."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from tests.support.harness import run_distributed

SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")


def count_syncs(overrides: list[str], slow_first_s: float = 0.0) -> dict:
    """Train with every host sync zerodp's own code makes counted by the step it happens in: the tensor
    methods that bring a value to the host, torch.cuda.synchronize, and the loop's all-gather. Calls
    from torch's or DeepSpeed's own code (AdamW reads its CPU step counter with .item()) are theirs.
    `slow_first_s`: the first step sleeps this long inside its step (a warm-up: compilation, tuning)."""
    import time

    import torch

    import zerodp.telemetry.step_metrics
    import zerodp.trainer.loop
    from zerodp.config import load_config

    package = str(Path(zerodp.trainer.loop.__file__).parent.parent)  # the whole zerodp package
    state = {"step": 0}
    seen: list[tuple[int, str, str]] = []  # (step, call, caller's file)

    def counted(name, real):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(package):
                seen.append((state["step"], name, Path(caller).name))
            return real(*args, **kwargs)
        return call

    for name in SYNCS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    torch.cuda.synchronize = counted("synchronize", torch.cuda.synchronize)
    zerodp.telemetry.step_metrics.all_gather_floats = counted("all_gather",
                                                              zerodp.telemetry.step_metrics.all_gather_floats)
    real_step = zerodp.trainer.loop.train_step

    def numbered_step(*args, **kwargs):  # what follows belongs to this step, up to the next one
        state["step"] += 1
        if state["step"] == 1:
            time.sleep(slow_first_s)
        return real_step(*args, **kwargs)

    zerodp.trainer.loop.train_step = numbered_step
    cfg = load_config(None, overrides)
    summary = zerodp.trainer.loop.train(cfg, fresh=True)
    records = [json.loads(x) for x in (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"seen": seen, "records": records, "run": summary["run"]}


def test_no_host_sync_between_log_steps_and_every_step_recorded(tiny, tmp_path):
    over = tiny + ["strategy.name=single", "train.max_steps=12", "train.log_every=5", "checkpoint.every=6",
                   "train.eval_every=0", "train.peak_tflops=0.5", f"train.out_dir={tmp_path}"]
    res = run_distributed("tests.distributed.test_loop:count_syncs", 1, {"overrides": over, "slow_first_s": 1.0},
                          fresh=True)[0]
    in_steps = [tuple(s) for s in res["seen"] if s[0] > 0]  # after start-up
    # log steps 5 and 10, the checkpoint at 6 and the last step 12; nothing anywhere else
    assert {step for step, _, _ in in_steps} == {5, 6, 10, 12}, in_steps
    assert [step for step, name, _ in in_steps if name == "all_gather"] == [5, 6, 10, 12]
    # one device fetch per sync point: the interval's losses and grad norms stacked
    fetches = [step for step, name, where in in_steps if name == "tolist" and where == "step_metrics.py"]
    assert fetches == [5, 6, 10, 12], in_steps

    records, run = res["records"], res["run"]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert len({r["loss"] for r in records}) == 12
    assert [r["sync_wait_s"] > 0 for r in records] == [r["step"] in (5, 6, 10, 12) for r in records]
    from zerodp.config import load_config
    from zerodp.models import flops_per_token

    cfg = load_config(None, over)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.block_size
    # wall_step_s is the interval's: between two sync points (steps 1-5, 6, 7-10, 11-12) over its steps,
    # the same for each of them, the host's time between the steps included (the saves after 6 and 12 not).
    for steps in ([1, 2, 3, 4, 5], [6], [7, 8, 9, 10], [11, 12]):
        interval = [records[s - 1] for s in steps]
        assert len({r["wall_step_s"] for r in interval}) == 1, interval
        assert sum(r["wall_step_s"] for r in interval) >= sum(r["step_time_s"] for r in interval)
    # Throughput is each step's own: step 1's second of warm-up stays in its row, not in steps 2-5's
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(tokens_per_step / r["max_step_time_s"])
        assert r["tokens_per_s_per_device"] == r["tokens_per_s"]  # one process
        assert r["mfu"] == pytest.approx(flops_per_token(cfg.model) * r["tokens_per_s"] / 0.5e12)
        assert r["tokens"] == r["step"] * tokens_per_step
    assert records[0]["max_step_time_s"] > 1.0
    assert all(r["max_step_time_s"] < 0.5 for r in records[1:]), [r["max_step_time_s"] for r in records]
    assert records[0]["tokens_per_s"] < min(r["tokens_per_s"] for r in records[1:]) / 2
    # the summary: the median of steps 3-12, the warm-up (steps 1-2) left out and named
    median = statistics.median(r["max_step_time_s"] for r in records[2:])
    assert run["steps"] == 12 and run["measured_steps"] == "steps 3-12, warm-up steps 1-2 left out"
    assert run["median_step_s"] == pytest.approx(median)
    assert run["tokens_per_s"] == pytest.approx(tokens_per_step / median)
    assert run["mfu"] == pytest.approx(flops_per_token(cfg.model) * tokens_per_step / median / 0.5e12)
    assert run["median_wall_step_s"] == pytest.approx(statistics.median(r["wall_step_s"] for r in records[2:]))
    assert run["data_wait_s"] == pytest.approx(sum(r["data_wait_s"] for r in records))
    assert run["checkpoint_save_s"] > 0  # steps 6 and 12 saved
    # the gradient noise scale (6 micro batches of 2 against the global 12) came with the same fetches
    noise = [r["grad_noise_scale"] for r in records if "grad_noise_scale" in r]
    assert noise and records[-1]["grad_noise_scale"] == run["grad_noise_scale"]
    assert all(n["sequences"] > 0 and n["tokens"] == pytest.approx(n["sequences"] * cfg.model.block_size)
               for n in noise)


def test_no_mfu_on_a_cpu_without_a_peak():
    import torch

    from zerodp.config import load_config
    from zerodp.telemetry.step_metrics import peak_flops

    assert peak_flops(load_config(None, []), torch.device("cpu")) == (None, "")
    assert peak_flops(load_config(None, ["train.peak_tflops=312"]), torch.device("cpu")) == (312e12, "")


def no_checkpoint_run(overrides: list[str], sigterm_at: int) -> dict:
    """Train with SIGTERM sent to this process during step `sigterm_at` (0: none); the console's lines,
    what the run left in its folder and the steps metrics.jsonl holds."""
    import contextlib
    import io
    import os
    import signal

    import zerodp.trainer.loop
    from zerodp.config import load_config

    real_step, state = zerodp.trainer.loop.train_step, {"step": 0}

    def step(*args, **kwargs):
        state["step"] += 1
        if state["step"] == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption
        return real_step(*args, **kwargs)

    zerodp.trainer.loop.train_step = step
    cfg = load_config(None, overrides)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            summary = zerodp.trainer.loop.train(cfg, fresh=True)
    finally:
        zerodp.trainer.loop.train_step = real_step
    metrics = Path(cfg.train.out_dir) / "metrics.jsonl"
    return {"lines": err.getvalue().splitlines(), "files": sorted(p.name for p in Path(cfg.train.out_dir).iterdir()),
            "final_step": summary["final_step"], "preempted": summary["preempted"],
            "steps": [json.loads(x)["step"] for x in metrics.read_text().splitlines()]}


def test_a_run_without_checkpoints_writes_none_and_says_so(tiny, tmp_path):
    """checkpoint.enabled=false: said among the first lines; no checkpoint at checkpoint.every, at the end or
    on a preemption, which stops the run after its step and says nothing was saved."""
    over = tiny + ["strategy.name=single", "train.max_steps=8", "train.log_every=2", "checkpoint.every=2",
                   "checkpoint.enabled=false", "train.eval_every=0", "train.sample_tokens=0", "train.progress=false",
                   f"train.out_dir={tmp_path / 'preempted'}"]
    whole = [o for o in over if not o.startswith(("train.max_steps=", "train.out_dir="))]
    res, whole = run_distributed("tests.support.workers:several", 1, {"calls": [
        {"target": "tests.distributed.test_loop:no_checkpoint_run", "kwargs": {"overrides": over, "sigterm_at": 3}},
        {"target": "tests.distributed.test_loop:no_checkpoint_run",
         "kwargs": {"overrides": whole + ["train.max_steps=5", f"train.out_dir={tmp_path / 'whole'}"],
                    "sigterm_at": 0}}]}, fresh=True)[0]
    lines = res["lines"]
    said = "zerodp: checkpoint.enabled=false: this run writes no checkpoint, not even at the end; a preemption " \
           "stops it without saving"
    assert said in lines[:8], lines
    assert "zerodp: preempted: stopped after step 4, no checkpoint saved (checkpoint.enabled=false)" in lines, lines
    assert res["preempted"] and res["final_step"] == 4
    assert res["files"] == ["config.yaml", "metrics.jsonl"], res["files"]
    assert any(line.startswith("zerodp: step 2/8: ") and line.endswith("(median of steps 1-2 (warm-up, all there is))")
               for line in lines), lines
    assert any(line.startswith("zerodp: step 4/8: ") and line.endswith("(median of steps 3-4)") for line in lines)
    # without a preemption: every step recorded, the last (5, not a log step) a sync point without a save
    assert whole["steps"] == [1, 2, 3, 4, 5] and whole["files"] == ["config.yaml", "metrics.jsonl"], whole
    assert any(line.startswith("zerodp: run: 5 steps; steps 3-5, warm-up steps 1-2 left out")
               for line in whole["lines"]), whole["lines"]
