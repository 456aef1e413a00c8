"""What the chunked loss and the checkpointing modes save: one process's peak resident memory and step time
training a 128k-vocabulary model on the CPU at micro batch 4 x 512, the whole logits against the chunked
loss (model.loss_chunks), under activation checkpointing off, selective and full, beside the planner's
prediction for the same run.

Each row is a real `zerodp train` (one process, strategy single, fp32, the built-in data), run as a
subprocess; its peak resident set (VmHWM in /proc/<pid>/status) is read from outside when the metrics row
of its last step appears (before the final checkpoint save). The step time is the median of the rows'
`step_time_s` after the first step, and beside it the process's own CPU seconds per step (user + system,
/proc/<pid>/stat, between consecutive metrics rows): on a shared machine the wall time moves with the
load, the CPU seconds far less. The planner's figure is `estimate_for_run` for the same config
on a CPU rank: it counts the model states, activations, head and loss, not the Python and torch runtime
the resident set also holds (the `runtime` row: the same model at micro batch 1 x 16 tokens, whose
activations are negligible, measures that floor).

    python benchmarks/loss_memory.py                       # 4 layers x 256 wide, vocab 128,256, 4 steps
    python benchmarks/loss_memory.py --chunks 16 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def model_overrides(args) -> list[str]:
    return ["model.arch=llama", f"model.n_layer={args.layers}", f"model.n_embd={args.width}", "model.n_head=8",
            "model.n_kv_head=4", f"model.vocab_size={args.vocab}", f"model.block_size={args.seq}",
            "model.tie_embeddings=true", "train.precision=fp32", "strategy.name=single", "train.eval_every=0",
            "train.sample_tokens=0", "train.log_every=1", "data.max_bytes=2000000"]


def vm_hwm(pid: int) -> int:
    """Peak resident set of process `pid` so far, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_row(overrides: list[str], steps: int, out: Path) -> tuple[int, float, float]:
    """(peak RSS at the last step's metrics row, median step time after the first, median CPU seconds per
    step after the first) of one `zerodp train`."""
    cmd = [sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", *overrides, f"train.max_steps={steps}",
           f"train.out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, peak, cpu = out / "metrics.jsonl", 0, []
    while proc.poll() is None:
        peak = max(peak, vm_hwm(proc.pid))
        done = sum(1 for _ in metrics.open()) if metrics.exists() else 0
        if done > len(cpu):
            cpu.append(cpu_seconds(proc.pid))  # at the end of step `done`
        if done >= steps:
            break  # the last step is done: what follows is the final save
        time.sleep(0.02)
    _, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"row failed ({' '.join(cmd)}):\n{err[-2000:]}")
    rows = [json.loads(line) for line in metrics.open()]
    per_step = [b - a for a, b in zip(cpu, cpu[1:])]
    return peak, statistics.median(r["step_time_s"] for r in rows[1:]), statistics.median(per_step or [0.0])


def predicted(overrides: list[str]) -> int:
    """The planner's total for this run on one CPU rank (bytes)."""
    from zerodp.config import load_config
    from zerodp.planner.training import estimate_for_run

    cfg = load_config(str(ROOT / "configs/tiny.yaml"), overrides)
    return estimate_for_run(cfg, 1, 64 * 2**30, "cpu").total_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8, help="model.loss_chunks of the chunked rows")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    base = model_overrides(args)
    batch = [f"train.micro_batch_size={args.micro}", f"train.global_batch_size={args.micro}"]
    print(f"llama {args.layers} x {args.width}, vocab {args.vocab:,}, micro batch {args.micro} x {args.seq}, fp32, "
          f"one CPU process, {args.steps} steps; peak RSS at the last step (VmHWM, from outside)")
    print(f"{'row':28s} {'peak RSS GB':>11s} {'planner GB':>10s} {'step s':>7s} {'CPU s/step':>10s}")
    with tempfile.TemporaryDirectory() as tmp:
        floor = base[:] + ["model.block_size=16", "train.micro_batch_size=1", "train.global_batch_size=1"]
        rss, step, cpu = run_row(floor + ["model.loss_chunks=0"], 3, Path(tmp) / "runtime")
        print(f"{'runtime (micro 1 x 16)':28s} {rss / GB:11.2f} {predicted(floor) / GB:10.2f} {step:7.2f} {cpu:10.2f}")
        for loss, chunks in (("whole", 0), ("chunked", args.chunks)):
            for mode in ("off", "selective", "full"):
                over = base + batch + [f"model.loss_chunks={chunks}", f"model.activation_checkpointing={mode}"]
                rss, step, cpu = run_row(over, args.steps, Path(tmp) / f"{loss}-{mode}")
                label = f"{loss} ({chunks} chunks), {mode}" if chunks else f"{loss}, {mode}"
                print(f"{label:28s} {rss / GB:11.2f} {predicted(over) / GB:10.2f} {step:7.2f} {cpu:10.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
