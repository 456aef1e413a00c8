"""Rank functions for tests/distributed/test_zero_reduce.py: bf16 runs of ddp and zero1-3 trained by the
real loop, with DeepSpeed's accelerator `synchronize` wrapped to count its calls (the real one still runs)."""

from __future__ import annotations

from tests.support.workers import train_runs


def counted_runs(runs: list[dict]) -> list[dict]:
    """`train_runs`, each result with `syncs`: the calls to DeepSpeed's accelerator `synchronize` during
    that run, and `steps`: its optimizer steps."""
    from deepspeed.accelerator import get_accelerator

    from zerodp.config import load_config

    accel = get_accelerator()
    real, calls = accel.synchronize, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    accel.synchronize = counting  # an instance attribute over the method: counts, then runs the real one
    results = []
    try:
        for run in runs:
            before = calls[0]
            (result,) = train_runs([run])
            result["syncs"] = calls[0] - before
            result["steps"] = load_config(None, run["overrides"]).train.max_steps
            result["weights"] = None  # not needed; keeps the result small
            results.append(result)
    finally:
        del accel.synchronize
    return results
