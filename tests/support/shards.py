"""Run the distributed tier as several pytest processes at once, each on its own share of the files.

Most of a distributed test's time is spent where its processes do not use both cores: starting
torchrun, a rendezvous, a timeout or heartbeat the test waits out, one rank writing a checkpoint while
the other waits. One pytest process leaves about a third of a 2-core machine idle over the tier; two of
them, each with its own pool of rank processes (tests.support.harness.World), fill it.

Files, not tests, are shared out (a module's fixtures and its pooled ranks stay in one process), by the
seconds each file takes while two shares run on 2 cores (SECONDS: `pytest --durations=0` under this
runner, summed per file), longest first to the least loaded share (LPT scheduling); the unit tier
runs in share 0. A file not in the table counts DEFAULT_SECONDS; refresh the
table when a file's time changes a lot. Every process computes the same assignment, so the shares are
disjoint and cover every file: tests/conftest.py keeps a process's share when ZERODP_TEST_SHARD=k/n.

    python -m tests.support.shards 2 -- -q tests    # what `make test` runs (TEST_JOBS=2)

Each share's output is printed whole when it ends; the exit code is the worst of theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD_ENV = "ZERODP_TEST_SHARD"
DEFAULT_SECONDS = 5
UNIT_SECONDS = 49
"""The unit tier's seconds beside another share (it runs in share 0): counted before the files are shared out."""
# Measured on a clean clone of main (`python -m tests.support.shards 2 -- -q tests --durations=0`, the phases'
# seconds summed per file; the mean of three runs), nothing else running; refresh after changing what a
# file runs. A pooled world is started by the first file of a share that needs its size, so a file's
# figure includes what it shares. The cpu_adam build is left out (BUILD_SECONDS).
SECONDS = {
    "test_faults.py": 122,
    "test_first_day.py": 87,
    "test_readme.py": 72,
    "test_equivalence.py": 70,
    "test_launchers.py": 51,
    "test_dpo.py": 46,
    "test_resume_latest.py": 46,
    "test_compile.py": 42,
    "test_startup_memory.py": 39,
    "test_sample.py": 36,
    "test_verify.py": 36,
    "test_dist.py": 34,
    "test_async_faults.py": 33,
    "test_gpu_checks.py": 30,
    "test_planner_validation.py": 23,
    "test_qwen3_moe.py": 23,
    "test_loggers.py": 21,
    "test_lora_zero.py": 21,
    "test_zeropp.py": 21,
    "test_fsdp.py": 20,
    "test_hf.py": 18,
    "test_replicas.py": 18,
    "test_convert_memory.py": 16,
    "test_devices.py": 14,
    "test_async_checkpoint.py": 13,
    "test_planner_search.py": 13,
    "test_zero.py": 13,
    "test_cli.py": 12,
    "test_loop.py": 12,
    "test_portable.py": 12,
    "test_prepared_data.py": 11,
    "test_convert_engines.py": 10,
    "test_qwen3.py": 10,
    "test_lora.py": 9,
    "test_lora_export.py": 9,
    "test_resume.py": 9,
    "test_runtime.py": 9,
    "test_grad_noise.py": 5,
    "test_convert.py": 4,
    "test_zero_counters.py": 4,
    "test_ddp.py": 3,
    "test_sampler.py": 3,
    "test_bf16_optimizer.py": 2,
    "test_convert_safety.py": 2,
    "test_determinism.py": 2,
    "test_init.py": 2,
    "test_lora_memory.py": 2,
    "test_sft.py": 2,
    "test_zero_reduce.py": 2,
    "test_configs.py": 1,
    "test_export_keeps.py": 1,
    "test_convert_stream.py": 0,
    "test_document_mask.py": 0,
    "test_schedule_resume.py": 0,
    "test_speed_gpu.py": 0,
}


BUILDS_CPU_ADAM = ("test_lora_zero.py", "test_planner_validation.py")
"""The files with strategy.offload_optimizer runs: in a fresh environment the first such run builds DeepSpeed's
cpu_adam op (BUILD_SECONDS; the others load it, or wait for its lock, idle). They go to one share as one
unit, so the build is counted once and always there; SECONDS leaves it out of their figures."""
BUILD_SECONDS = 55


def assignment(files: list[str], shards: int) -> dict[str, int]:
    """file -> share index: longest first, each to the share with the fewest seconds so far (share 0
    starting at the unit tier's UNIT_SECONDS; ties: the lower index), so the assignment depends only on
    the file names and the table. BUILDS_CPU_ADAM's files are one unit of their seconds and BUILD_SECONDS."""
    units = [[f] for f in files if f not in BUILDS_CPU_ADAM]
    together = [f for f in files if f in BUILDS_CPU_ADAM]
    if together:
        units.append(together)

    def seconds(unit: list[str]) -> float:
        return sum(SECONDS.get(f, DEFAULT_SECONDS) for f in unit) + (BUILD_SECONDS if unit is together else 0)

    load = [0.0] * shards
    load[0] = UNIT_SECONDS  # share 0 runs the unit tier first
    out = {}
    for unit in sorted(units, key=lambda u: (-seconds(u), u)):
        k = min(range(shards), key=lambda i: (load[i], i))
        out.update(dict.fromkeys(unit, k))
        load[k] += seconds(unit)
    return out


def parse_shard(value: str) -> tuple[int, int]:
    """'k/n' -> (k, n), 0 <= k < n."""
    k, _, n = value.partition("/")
    k, n = int(k), int(n)
    if not 0 <= k < n:
        raise ValueError(f"{SHARD_ENV}={value!r}: expected k/n with 0 <= k < n")
    return k, n


def keep(paths: list[Path], value: str) -> set[Path]:
    """The test files of `paths` that share `value` ('k/n') runs: a distributed-tier file goes by its
    name through `assignment`; anything else (the unit tier) runs in share 0 only."""
    k, n = parse_shard(value)
    names = sorted({p.name for p in paths if p.parent.name == "distributed"})
    share = assignment(names, n)
    return {p for p in paths if (share[p.name] == k if p.parent.name == "distributed" else k == 0)}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m tests.support.shards N -- PYTEST_ARGS...", file=sys.stderr)
        return 2
    n, pytest_args = int(argv[0]), argv[2:]
    if n <= 1:
        return subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerodp-shards-") as tmp:
        procs = []
        for k in range(n):
            log = open(Path(tmp) / f"share-{k}.log", "w+")
            env = dict(os.environ, **{SHARD_ENV: f"{k}/{n}"})
            procs.append((k, log, subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], env=env,
                                                   stdout=log, stderr=subprocess.STDOUT)))
        codes = {}
        try:
            for k, log, p in procs:
                codes[k] = p.wait()
        except KeyboardInterrupt:
            for _, _, p in procs:
                p.terminate()
            for _, _, p in procs:
                p.wait()
            raise
        for k, log, _ in procs:
            log.seek(0)
            print(f"===== share {k + 1} of {n}: exit {codes[k]} =====")
            sys.stdout.write(log.read())
            log.close()
    # pytest's exit codes: 0 passed, 5 nothing collected (a share may be empty); anything else fails.
    worst = max((c for c in codes.values() if c != 5), default=0)
    print(f"===== {n} shares in {time.monotonic() - t0:.0f} s: exit {worst} =====")
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
