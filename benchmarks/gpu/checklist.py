"""The groups of checks, in the order they run: by value for a short rental (what is still unverified
on CUDA, or a silent wrong result, first), each with the GPUs it needs, its expected duration on one
H200 and whether the CPU mode (--device cpu --tiny: 2 CPU processes, tiny shapes) can run it.

The estimates count each group's worker process (python, torch, DeepSpeed, the CUDA context: about 15 s),
its runs (a tiny run a couple of seconds, a 1B run's set-up and 12 steps about 10 s) and Inductor's
compilations (a tiny block about 20 s, the 1B block about 40 s); DeepSpeed builds its CPU Adam on first
use (about 60 s, the offload group). --budget skips a group whose estimate no longer fits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from benchmarks.gpu import features, one_gpu, ranks


@dataclass(frozen=True)
class Check:
    name: str
    gpus: int
    """GPUs it needs; it runs at world = every visible GPU."""
    seconds: int
    """Expected duration on one H200 (the 2-GPU groups: on two), an estimate."""
    cpu: bool
    """The CPU mode runs it (what needs CUDA itself, Inductor on the GPU or fp16 under DeepSpeed, does not)."""
    run: Callable
    what: str


CHECKS = (
    Check("compile", 1, 60, False, features.compiled,
          "train.compile=true under fsdp and zero3 vs single, tiny fp32 (zero3 + compile is refused on CUDA "
          "until this passes)"),
    Check("throughput", 1, 80, True, one_gpu.throughput_eager,
          "Llama-3.2-1B shape, bf16, micro 4, eager, per planned strategy (and loss_chunks / activation "
          "checkpointing rows where this zerodp has the keys): tokens/s, MFU, host syncs per step, allocator "
          "peak vs the planner's"),
    Check("resume", 1, 60, True, one_gpu.resume, "single, fsdp, zero3 in bf16 and fp16, tiny: resumed losses "
                                                 "bit-identical to the straight run's"),
    Check("fp16", 1, 25, False, one_gpu.fp16_zero, "fp16 zero1/2/3 vs single's fp16, tiny, within the bands"),
    Check("offload", 1, 95, True, features.offload,
          "the catalog's offload rows (zero2, zero3 optimizer [and params], fsdp CPUOffloadPolicy) vs single"),
    Check("save", 1, 70, True, one_gpu.save_stall,
          "1B shape under single: the background save's stall beside a synchronous save's"),
    Check("compiled", 1, 90, False, one_gpu.throughput_compiled,
          "the throughput rows with train.compile=true (single, fsdp)"),
    Check("features", 1, 45, True, features.features,
          "fsdp vs single; activation checkpointing; evaluation; data.prefetch=2; train.deterministic=false; "
          "accumulation (fsdp, zero2, zero3); llama (fsdp, zero3): 10/10 on the first GPU run"),
    Check("equivalence", 2, 90, True, ranks.equivalence,
          "ddp, zero1/2/3, fsdp in fp32 vs single (losses, weights); killed rank under torchrun (world 2)"),
    Check("precision", 2, 45, True, ranks.mixed_precision,
          "bf16 ddp vs fp32; bf16 zero1/2/3, fsdp and fp16 zero1/2 vs ddp within docs/strategies.md's bands"),
    Check("hsdp", 2, 25, True, ranks.hsdp, "fsdp hybrid_shard (shard groups of 1 on 2 GPUs) vs single"),
)


def listing(checks=CHECKS) -> list[str]:
    """--list's lines: each check, the GPUs it needs, its expected duration on one H200; then the totals."""
    lines = [f"{c.name:<12} {c.gpus}+ GPU  ~{c.seconds:>3} s  {'cpu-mode' if c.cpu else 'GPU only'}  {c.what}"
             for c in checks]
    one = sum(c.seconds for c in checks if c.gpus == 1)
    lines.append(f"total on one H200: ~{one} s; on 2+ GPUs: ~{sum(c.seconds for c in checks)} s at world 2")
    return lines


def select(names: str | None, gpus: int, cpu: bool, checks=CHECKS) -> list[Check]:
    """The checks to run: those named in `names` (comma-separated; None: all), that `gpus` GPUs allow (the
    CPU mode counts as 2) and, in the CPU mode, that it can run. ValueError for a name that is not a check."""
    chosen = checks if names is None else [c for c in checks if c.name in names.split(",")]
    unknown = sorted(set(names.split(",")) - {c.name for c in checks}) if names else []
    if unknown:
        raise ValueError(f"no check named {', '.join(unknown)}; --list shows them: "
                         f"{', '.join(c.name for c in checks)}")
    return [c for c in chosen if c.gpus <= (2 if cpu else gpus) and (c.cpu or not cpu)]


def fits(check: Check, used_s: float, budget_s: float | None) -> bool:
    """Whether `check`'s estimate fits what is left of `budget_s` after `used_s` (None: no budget)."""
    return budget_s is None or used_s + check.seconds <= budget_s
