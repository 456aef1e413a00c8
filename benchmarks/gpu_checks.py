"""GPU checks: what the CPU test suite cannot show, run on this machine's GPUs.

    python benchmarks/gpu_checks.py                  # every check the visible GPUs allow (< 10 min on one H200)
    python benchmarks/gpu_checks.py --gpus 1         # only the 1-GPU checks on a bigger machine
    python benchmarks/gpu_checks.py --list           # each check, the GPUs it needs, its expected duration
    python benchmarks/gpu_checks.py --only syncs,offload
    python benchmarks/gpu_checks.py --device cpu --tiny --only offload   # the checks' code on 2 CPU processes

One line per check, `PASS <check>: <what was measured>` or `FAIL <check>: <what differed>`, then a
summary line; the exit code is 1 if any check failed, else 0 (2 for an unknown --only name). On a
machine without a usable GPU it says so and exits 0 (nothing to check). The checks themselves are in
benchmarks/gpu/ (checklist.py lists them; verdicts.py holds the pure verdicts); each group runs at
world = every visible GPU, except resume/memory (one GPU) and the killed rank (two).
--device cpu --tiny runs the groups that need no CUDA of their own on 2 CPU processes (gloo, DeepSpeed's
CPU accelerator) with tiny shapes: it shows the code paths run, not what a GPU would measure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/gpu_checks.py` from anywhere

from benchmarks.gpu.checklist import listing, select
from benchmarks.gpu.runner import Setup, worker
from benchmarks.gpu.verdicts import GIB, Result, exit_code, same_losses, summary, within  # noqa: F401  (the verdicts, as before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="use at most this many GPUs (default: all visible)")
    parser.add_argument("--list", action="store_true", help="print each check, the GPUs it needs and its expected "
                                                            "duration on one H200, and exit")
    parser.add_argument("--only", default=None, help="comma-separated check names (default: all; see --list)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run the checks' code on 2 CPU processes instead (needs --tiny)")
    parser.add_argument("--tiny", action="store_true", help="with --device cpu: tiny shapes (the CPU mode)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.list:
        print("\n".join(listing()))
        return 0
    cpu = args.device == "cpu"
    if cpu != args.tiny:
        print("gpu_checks: --device cpu and --tiny go together (the CPU mode runs tiny shapes only)", file=sys.stderr)
        return 2
    if cpu:
        gpus = 0
        os.environ.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")  # also for gpu_throughput's runs
    else:
        from zerodp.distributed.devices import count_gpus

        gpus = count_gpus(args.gpus)
    try:
        checks = select(args.only, gpus, cpu)
    except ValueError as e:
        print(f"gpu_checks: {e}", file=sys.stderr)
        return 2
    if not cpu and gpus == 0:
        print("gpu_checks: no usable GPU on this machine (CUDA_VISIBLE_DEVICES, a CPU build of torch or no "
              "driver): nothing to check")
        return 0
    print(f"gpu_checks: {'2 CPU processes (tiny shapes)' if cpu else f'{gpus} GPU(s)'}: "
          f"{', '.join(c.name for c in checks) or 'no check selected'}", flush=True)
    results: list[Result] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_checks") as tmp:
        setup = Setup(gpus=gpus, tmp=Path(tmp), device=args.device)
        for check in checks:
            for r in check.run(setup):
                print(r.line(), flush=True)
                results.append(r)
    print(summary(results) + f" in {time.monotonic() - t0:.0f} s")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
