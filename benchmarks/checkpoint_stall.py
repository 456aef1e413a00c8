"""How long does a checkpoint stop training, synchronous against background (checkpoint.async_save)?

Runs `zerodp train` on 2 CPU processes (gloo, DeepSpeed's CPU accelerator) for every strategy, once with
synchronous saves and once with background ones, and measures from outside the ranks, polling every few
milliseconds: the moment each step's line lands in metrics.jsonl (train.log_every=1), the moment each
checkpoint's `.tmp` folder is renamed to its final name (published), and the resident memory (VmRSS from
/proc) of both rank processes.

* stall: the seconds training was stopped by one save: the interval between the save step's line and
  the next one, less the run's median step interval (intervals holding a save left out). Sequences
  of 16 tokens keep a step short beside a save, so that the step-to-step noise of a shared machine
  stays small beside the stall.
* save: the save's total time, from the save step's line to its folder's publication.
* host: the host memory the saves took, both ranks together: the peak RSS after the first save began
  less the RSS when it began (a background save keeps its host copy from save to save).
* run: from step 2's line to the last step's, every save but the last inside: what a background writer
  competing with training for the same cores costs beyond the stall.

Saves every --every steps; the figures are medians over the saves before the last step (the run's last
save is always waited for, in both modes).

    python benchmarks/checkpoint_stall.py                             # ~302M parameters: 24 x 1024, vocab 256
    python benchmarks/checkpoint_stall.py --layers 6 --strategies ddp,fsdp --every 3 --saves 3

Parameters: 12 x layers x width^2 (blocks) + (256 + 16) x width (embeddings, tied head) + norms.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerodp.errors import OneLineParser  # noqa: E402

MARKER = ".checkpoint_stall"
"""Marks a --out folder as this benchmark's: a rerun may replace the run folders in it."""

GOAL = 0.15
"""A background save's stall at most this fraction of the synchronous save's time."""


def parse_args():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp")
    p.add_argument("--layers", type=int, default=24, help="model.n_layer (default 24: ~302M parameters)")
    p.add_argument("--width", type=int, default=1024, help="model.n_embd (default 1024)")
    p.add_argument("--every", type=int, default=3, help="checkpoint.every (default 3)")
    p.add_argument("--saves", type=int, default=3, help="saves measured per run (default 3), then 2 steps more")
    p.add_argument("--out", default=None, help="run folders, logs and each run's observations (JSON) here "
                                               "(default: a temporary folder, deleted)")
    p.add_argument("overrides", nargs="*", help="more zerodp config overrides")
    args = p.parse_args()
    for flag in ("layers", "width", "every", "saves"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be 1 or more, got {getattr(args, flag)}")
    unknown = set(args.strategies.split(",")) - {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    if unknown:
        p.error(f"--strategies: unknown {', '.join(sorted(unknown))}; choose among ddp,zero1,zero2,zero3,fsdp")
    # the runs' folders are replaced and their checkpoints deleted: only in a folder this script made
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())) and not (out / MARKER).exists():
        p.error(f"--out {args.out}: exists and is not a folder this benchmark made (nor an empty one); "
                "name a new or empty folder")
    return args


def overrides(args, strategy: str, background: bool, out: Path) -> list[str]:
    heads = max(1, args.width // 64)
    return [f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={heads}",
            "model.block_size=16", "model.vocab_size=256", "data.max_bytes=200000", "data.prefetch=0",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.precision=fp32",
            f"train.max_steps={args.every * args.saves + 2}", "train.log_every=1", "train.eval_every=0",
            "train.sample_tokens=0", "train.progress=false", "optim.warmup_steps=0", f"strategy.name={strategy}",
            f"checkpoint.every={args.every}", "checkpoint.keep_last=2", f"checkpoint.async_save={background}",
            f"train.out_dir={out}", *args.overrides]


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(args, strategy: str, background: bool, out: Path) -> dict:
    """One training run on 2 processes, watched from here: step times, publications, RSS."""
    shutil.rmtree(out, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT),
               CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", *overrides(args, strategy, background, out)]
    logs = [open(out.parent / f"{out.name}.rank{r}.log", "w") for r in (0, 1)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in (0, 1)]
    steps: dict[int, float] = {}
    published: dict[int, float] = {}
    memory: list[tuple[float, int]] = []
    metrics, root = out / "metrics.jsonl", out / "checkpoints"
    while any(p.poll() is None for p in procs):
        now = time.perf_counter()
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.endswith("}"):
                    steps.setdefault(json.loads(line)["step"], now)
        if root.exists():
            for d in root.glob("step_*"):
                if not d.name.endswith(".tmp") and d.name[5:].isdigit():
                    published.setdefault(int(d.name[5:]), now)
        memory.append((now, sum(rss(p.pid) for p in procs)))
        time.sleep(0.003)
    for f in logs:
        f.close()
    text = (out.parent / f"{out.name}.rank0.log").read_text()
    if any(p.returncode for p in procs):
        sys.exit(f"checkpoint_stall: {strategy} ({'async' if background else 'sync'}) failed:\n{text[-3000:]}")
    params = int(re.search(r"([\d,]+) parameters", text).group(1).replace(",", ""))
    return {"steps": steps, "published": published, "memory": memory, "params": params}


def figures(args, watched: dict) -> dict:
    """stall, save and host (see the module's docstring) from one run's observations."""
    steps, published, memory = watched["steps"], watched["published"], watched["memory"]
    last = args.every * args.saves + 2
    saves = [args.every * k for k in range(1, args.saves + 1)]
    interval = {s: steps[s] - steps[s - 1] for s in range(3, last + 1)}  # steps 1-2: warm-up
    plain = statistics.median(v for s, v in interval.items() if s - 1 not in saves)
    # not the records' wall_step_s: the slowest rank's, it holds the wait for the rank still copying
    stall = statistics.median(interval[s + 1] - plain for s in saves)
    save = statistics.median(published[s] - steps[s] for s in saves)
    start = steps[saves[0]]
    before = max(m for t, m in memory if t <= start)
    peak = max(m for t, m in memory if start <= t <= published[saves[-1]])
    spread = statistics.pstdev(v for s, v in interval.items() if s - 1 not in saves)
    return {"stall": stall, "save": save, "host": peak - before, "step": plain, "spread": spread,
            "run": steps[last] - steps[2]}


def main() -> int:
    args = parse_args()
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="checkpoint_stall-"))
    base.mkdir(parents=True, exist_ok=True)
    (base / MARKER).touch()
    rows, params = [], None
    try:
        for strategy in args.strategies.split(","):
            got = {}
            for background in (False, True):
                name = f"{strategy}-{'async' if background else 'sync'}"
                watched = run(args, strategy, background, base / name)
                (base / f"{name}.json").write_text(json.dumps(watched))
                shutil.rmtree(base / name, ignore_errors=True)  # the checkpoints: GBs each
                params = watched["params"]
                got[background] = figures(args, watched)
                print(f"{strategy} {'async' if background else 'sync'}: {got[background]}", file=sys.stderr, flush=True)
            rows.append((strategy, got[False], got[True]))
    finally:
        if not args.out:
            shutil.rmtree(base, ignore_errors=True)
    print(f"{params:,} parameters ({args.layers} layers x {args.width}), 2 CPU processes, fp32, saves every "
          f"{args.every} steps, medians of {args.saves} saves; seconds, host memory in MiB (both ranks)")
    head = ("strategy", "step", "sync stall", "sync save", "sync host", "sync run", "async stall", "async save",
            "async host", "async run", "stall/sync", f"<= {GOAL:.0%}")
    table = [head]
    for strategy, sync, bg in rows:
        ratio = bg["stall"] / sync["save"]
        cells = [f"{sync['step']:.2f}±{sync['spread']:.2f}"]
        for got in (sync, bg):
            cells += [f"{got['stall']:.2f}", f"{got['save']:.2f}", f"{got['host'] / 2**20:,.0f}", f"{got['run']:.1f}"]
        table.append((strategy, *cells, f"{ratio:.0%}", "yes" if ratio <= GOAL else "NO"))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
