"""Start-up and training peaks on a CPU: the peak RSS, reset when start-up ends (zerodp.telemetry.memory)."""

from __future__ import annotations

import torch

from zerodp.telemetry.memory import Peaks, peak_bytes

MB = 2**20


def test_the_training_peak_leaves_out_what_start_up_held_and_freed():
    cpu = torch.device("cpu")
    peaks = Peaks(cpu)
    before = peak_bytes(cpu)
    transient = torch.ones(300 * MB // 4)  # 300 MB touched, then freed (mmap'd: given back to the kernel)
    del transient
    peaks.startup_over()
    held = torch.ones(40 * MB // 4)
    peaks.training_over()
    assert peaks.startup_bytes >= max(before, 300 * MB), (before, peaks.summary())
    assert peaks.startup_bytes > peaks.train_bytes + 200 * MB, peaks.summary()  # without the reset: >= startup
    assert peaks.train_bytes > 40 * MB, peaks.summary()
    assert peaks.summary()["measure"] == "peak_rss"
    assert peaks.line().startswith("rank 0's peak memory resident (RSS, the whole process): start-up ")
    del held


def test_on_cuda_both_peaks_are_set_against_the_plan():
    # PlanCheck reads no device with the peaks given: what a GPU run's end-of-run lines would say.
    from zerodp.config import load_config
    from zerodp.telemetry.comm import PlanCheck

    cfg = load_config(None, ["strategy.name=fsdp", "model.n_layer=4", "model.n_embd=256", "model.n_head=4",
                             "train.global_batch_size=64"])
    check = PlanCheck(cfg, 8, 80 * 2**30, "NVIDIA H100 80GB HBM3")
    e = check.estimate
    cuda = torch.device("cuda", 0)
    peaks = Peaks(cuda, startup_bytes=e.startup_bytes - e.overhead_bytes,
                  train_bytes=2 * (e.total_bytes - e.overhead_bytes))
    compared = check.compare(None, {}, cuda, peaks)
    assert compared["startup_peak_allocated_bytes"] == {"predicted": e.startup_bytes - e.overhead_bytes,
                                                        "measured": e.startup_bytes - e.overhead_bytes}
    assert compared["peak_allocated_bytes"]["measured"] == 2 * compared["peak_allocated_bytes"]["predicted"]
    lines = check.report(compared).splitlines()
    assert any(ln.startswith("  allocated at the start-up peak per rank: predicted") and ln.endswith("(+0.0%)")
               for ln in lines), lines
    assert any(ln.startswith("  peak allocated per rank: predicted") and ln.endswith("(+100.0%)")
               for ln in lines), lines
    assert peaks.summary() == {"measure": "max_memory_allocated", "startup_peak_bytes": peaks.startup_bytes,
                               "train_peak_bytes": peaks.train_bytes}
