"""GPU checks: what the CPU test suite cannot show, run on this machine's GPUs, sized for a short rental.

    python benchmarks/gpu_checks.py --budget 480     # the groups that fit 8 minutes, by value (--list)
    python benchmarks/gpu_checks.py                  # every group the visible GPUs allow
    python benchmarks/gpu_checks.py --list           # each group, the GPUs it needs, its expected duration
    python benchmarks/gpu_checks.py --only throughput,compile --json out.json
    python benchmarks/gpu_checks.py --device cpu --tiny --only throughput   # the code on 2 CPU processes

Groups run one after another, most valuable first (benchmarks/gpu/checklist.py); before each, a line with
its estimate on one H200; with --budget a group whose estimate would pass the budget is skipped with a
line saying so. One line per check, printed as soon as it is known: `PASS <check>: <what was measured>`,
`FAIL <check>: <what differed>` or `SKIP <check>: <why>`, then a summary line; the exit code is 1 if any
check failed, else 0 (2 for bad arguments). The same lines go to a JSON file (--json, rewritten after
each line, so a rental that ends early keeps what was measured; a new file, never an earlier one).
Every run's folder is deleted when the
run ends; the runs that are not about checkpoints write none (checkpoint.enabled=false), so disk use is
bounded by the save group's two checkpoints of the 1B model, stated at the start. On a machine without
a usable GPU it says so and exits 0 (nothing to check). --device cpu --tiny runs the groups that need no
CUDA of their own on 2 CPU processes (gloo, DeepSpeed's CPU accelerator) with tiny shapes: it shows the
code paths run, not what a GPU would measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/gpu_checks.py` from anywhere

from benchmarks.gpu.checklist import fits, listing, select
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
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: skip each group whose estimate would pass this (default: no budget)")
    parser.add_argument("--json", default=None, help="the lines as JSON, a new file (default: "
                                                      "gpu_checks-<UTC time>.json here)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.list:
        print("\n".join(listing()))
        return 0
    args.json = args.json or time.strftime("gpu_checks-%Y%m%d-%H%M%S.json", time.gmtime())
    if Path(args.json).exists():  # an earlier run's results are never overwritten
        print(f"gpu_checks: {args.json} exists; pass a new --json path", file=sys.stderr)
        return 2
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
          f"{', '.join(c.name for c in checks) or 'no check selected'}"
          f"{f'; budget {args.budget:.0f} s' if args.budget is not None else ''}", flush=True)
    print(f"gpu_checks: {disk_line(cpu)}", flush=True)
    report = Report(Path(args.json), {"device": "cpu (tiny)" if cpu else f"{gpus} GPU(s)", "budget_s": args.budget,
                                      "versions": versions()})
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_checks") as tmp:
        setup = Setup(gpus=gpus, tmp=Path(tmp), device=args.device)
        for check in checks:
            used = time.monotonic() - t0
            if not fits(check, used, args.budget):
                report.add(check.name, Result(check.name, True, f"~{check.seconds} s on one H200 would pass the "
                                                                f"budget of {args.budget:.0f} s ({used:.0f} s used)",
                                              skip=True))
                continue
            print(f"gpu_checks: group {check.name} (~{check.seconds} s on one H200): {check.what}", flush=True)
            g0 = time.monotonic()
            for r in check.run(setup):
                report.add(check.name, r)
            report.took(check.name, check.seconds, time.monotonic() - g0)
            print(f"gpu_checks: group {check.name} took {time.monotonic() - g0:.0f} s (estimate ~{check.seconds} s "
                  f"on one H200)", flush=True)
    line = summary(report.results) + f" in {time.monotonic() - t0:.0f} s; the lines as JSON in {args.json}"
    report.finish(line)
    print(line, flush=True)
    return exit_code(report.results)


class Report:
    """The lines as they come: printed (flushed) and kept in a JSON file, rewritten whole after each."""

    def __init__(self, path: Path, head: dict):
        self.path, self.head = path, head
        self.results: list[Result] = []
        self.rows: list[dict] = []
        self.groups: list[dict] = []
        self.write()

    def add(self, group: str, r: Result) -> None:
        print(r.line(), flush=True)
        self.results.append(r)
        self.rows.append({"group": group, "check": r.check, "status": r.line().split()[0], "detail": r.detail})
        self.write()

    def took(self, group: str, estimate_s: int, seconds: float) -> None:
        self.groups.append({"group": group, "estimate_s": estimate_s, "seconds": round(seconds, 1)})
        self.write()

    def finish(self, line: str) -> None:
        self.head["summary"] = line
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({**self.head, "groups": self.groups, "results": self.rows}, indent=1))
        os.replace(tmp, self.path)


def disk_line(cpu: bool) -> str:
    """Where the runs write and the most they hold at once: the save group's two checkpoints of the 1B
    shape (fp32 weights and AdamW's two moments: 12 bytes a parameter, as docs/checkpoints.md counts)."""
    from benchmarks.gpu.one_gpu import _shape
    from benchmarks.gpu.runner import ROOT
    from zerodp.config import load_config
    from zerodp.models import param_count

    model, _, _ = _shape(Setup(gpus=0, tmp=Path("."), device="cpu" if cpu else "cuda"))
    n = param_count(load_config(str(ROOT / "configs/tiny.yaml"), model).model)
    return (f"disk: each run's folder under {tempfile.gettempdir()} is deleted when the run ends; at most two "
            f"checkpoints at once (the save group), about {2 * 12 * n / 1e9:.1f} GB for {n / 1e9:.2f}B parameters")


def versions() -> dict:
    import torch

    try:
        import deepspeed

        ds = deepspeed.__version__
    except Exception:  # a machine without DeepSpeed still runs the non-ZeRO groups
        ds = None
    return {"torch": torch.__version__, "deepspeed": ds, "python": sys.version.split()[0]}


if __name__ == "__main__":
    sys.exit(main())
