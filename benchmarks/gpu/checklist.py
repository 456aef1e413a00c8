"""The checks, in the order they run: each a group of lines, the GPUs it needs, what it costs on one
H200 (estimated from the runs it makes: a worker process's start and CUDA context about 15 s, a tiny run
a few seconds, DeepSpeed's engine a few more, Inductor's compilation about a minute), and whether the CPU
mode (--device cpu --tiny: 2 CPU processes, tiny shapes) can run it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from benchmarks.gpu import features, ranks, state


@dataclass(frozen=True)
class Check:
    name: str
    gpus: int
    """GPUs it needs; it runs at world = every visible GPU (the resume/memory group on one)."""
    seconds: int
    """Expected duration on one H200 (the 2-GPU groups: on two), an estimate."""
    cpu: bool
    """The CPU mode runs it (what needs CUDA itself, the allocator's peaks or fp16 under DeepSpeed, does not)."""
    run: Callable
    what: str


CHECKS = (
    Check("resume", 1, 150, False, state.resume_memory,
          "fsdp, zero3 on GPT-2 124M's shape, bf16 and fp16: resume bit-identical; allocator peaks <= the "
          "planner's; fsdp bf16 bit-identical in a second process"),
    Check("features", 1, 60, True, features.features,
          "fsdp vs single; activation checkpointing; evaluation; data.prefetch=2; train.deterministic=false; "
          "accumulation (fsdp, zero2, zero3); llama (fsdp, zero3)"),
    Check("offload", 1, 90, True, features.offload,
          "the catalog's offload rows (zero2, zero3 optimizer [and params], fsdp CPUOffloadPolicy) vs single"),
    Check("compile", 1, 90, False, features.compiled, "train.compile=true under fsdp and zero3 vs single"),
    Check("syncs", 1, 45, True, features.syncs,
          "host syncs per step (torch.cuda.set_sync_debug_mode) under each planned strategy, bf16: at most 1 "
          "per train.log_every steps"),
    Check("throughput", 1, 120, True, features.mfu,
          "tokens/s per GPU and MFU of the Llama-3.2-1B shape (16 x 2048, block 2048, bf16) per planned strategy"),
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
