"""How much memory does each rank hold once start-up is over? Measured from outside the processes.

`zerodp train` runs under torchrun on N CPU processes (gloo). Rank 0 prints
`zerodp: strategy <name> on <N> process(es), ...` once the model is built, sharded and initialised
(and any checkpoint loaded); when that line arrives on the stderr stream read here, every rank
process (the launcher's descendants that carry RANK in their environment) has its peak resident set,
`VmHWM` in /proc/<pid>/status, read. The same is measured for a tiny model (same strategy, world size
and precision): the difference is the growth during setup, compared with the full fp32 model
(4 bytes x parameters) and with the planner's start-up prediction per rank (MemoryEstimate.startup_bytes,
"n/a" where the planner has none).

    python benchmarks/startup_memory.py                                   # 24 x 2048 GPT, 1.2B params, 4.8 GB fp32
    python benchmarks/startup_memory.py --layers 12 --width 1024 --strategies zero3,fsdp --precision fp32,bf16
    python benchmarks/startup_memory.py --layers 12 --width 1024 --to-end  # also run the 2 steps

By default a run is stopped (its processes killed) once measured: the steps are not what is measured,
and a 1.2B-parameter model's optimizer state on 2 ranks does not fit a 24 GiB machine. With --to-end
the 2 steps run and the command's whole wall time is printed as well as the time to the line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
MB = 10**6
GUARD_BYTES = 3 * 2**30
"""A run is killed when the machine's MemAvailable falls below this: a benchmark too large for the
machine stops with an error instead of waking the kernel's OOM killer."""

# One training step of a small batch, nothing else: no eval, sample, checkpoint or progress bar.
RUN = ["model.vocab_size=256", "model.block_size=64", "data.max_bytes=200000", "data.prefetch=0",
       "train.micro_batch_size=1", "train.global_batch_size=2", "train.max_steps=2", "train.eval_every=0",
       "train.sample_tokens=0", "train.progress=false", "checkpoint.every=0"]
BASELINE = ["model.n_layer=1", "model.n_embd=64", "model.n_head=1"]


def model_overrides(layers: int, width: int, heads: int) -> list[str]:
    return [f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}"]


# ---- the rank processes, from /proc -----------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc/*/stat (the command name in field 2 may hold spaces and parentheses)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def rank_processes(launcher_pid: int) -> dict[int, int]:
    """rank -> pid: the launcher's topmost descendants with RANK in their environment (a rank's own
    children inherit RANK too, so the walk stops at the first process that has it)."""
    children, ranks, todo = _children(), {}, [launcher_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            rank = _environ(pid).get("RANK")
            if rank is None:
                todo.append(pid)
            elif b"zerodp" in _cmdline(pid):
                ranks[int(rank)] = pid
    return ranks


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def status_bytes(pid: int, key: str) -> int:
    """A `kB` line of /proc/<pid>/status (VmHWM, VmRSS) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


# ---- one measured run ----------------------------------------------------------------------------

@dataclass
class Measured:
    """Peak RSS (VmHWM) of each rank when rank 0 printed the strategy line, and the wall times."""

    peak: dict[int, int]
    line: str
    startup_s: float
    """Launch to the strategy line."""
    total_s: float | None = None
    """Launch to exit (runs taken to the end only)."""
    log: list[str] = field(default_factory=list)


def measure(overrides: list[str], nproc: int = 2, to_end: bool = False, timeout: float = 1800) -> Measured:
    """Launch `torchrun -m zerodp train configs/tiny.yaml RUN OVERRIDES` in a fresh out_dir; read each
    rank's VmHWM when the strategy line arrives. Raises RuntimeError when the line never comes, when
    not exactly `nproc` ranks are found, or (to_end) when the run fails."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.setdefault("ZERODP_CACHE", str(Path(tempfile.gettempdir()) / "zerodp-test-cache"))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # set by the launcher for its ranks only: how the ranks are told apart
    with tempfile.TemporaryDirectory(prefix="startup-memory-") as out:
        cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--standalone", "-m", "zerodp", "train",
               str(ROOT / "configs/tiny.yaml"), *RUN, *overrides, f"train.out_dir={out}/run"]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: deque[str] = deque(maxlen=60)
        result = None
        guard = _MemoryGuard(proc)
        try:
            for line in proc.stdout:
                tail.append(line)
                if result is None and line.startswith("zerodp: strategy ") and "process(es)" in line:
                    startup_s = time.perf_counter() - t0
                    ranks = rank_processes(proc.pid)
                    peak = {r: status_bytes(pid, "VmHWM") for r, pid in ranks.items()}
                    result = Measured(peak, line.strip(), startup_s)
                    if sorted(peak) != list(range(nproc)):
                        raise RuntimeError(f"found ranks {sorted(peak)} under the launcher, not 0..{nproc - 1}")
                    if not to_end:
                        _stop(proc, ranks)
                        break
            proc.wait(timeout=timeout)
        finally:
            guard.done.set()
            if proc.poll() is None:
                _stop(proc, rank_processes(proc.pid))
        if guard.fired:
            raise RuntimeError(f"stopped: MemAvailable fell below {GUARD_BYTES / 2**30:.0f} GiB; use a smaller model")
        if result is None:
            raise RuntimeError(f"no strategy line (exit {proc.returncode}):\n{''.join(tail)}")
        if to_end:
            if proc.returncode != 0:
                raise RuntimeError(f"the run exited with {proc.returncode}:\n{''.join(tail)}")
            result.total_s = time.perf_counter() - t0
        result.log = list(tail)
        return result


class _MemoryGuard:
    """Polls /proc/meminfo every 20 ms while a run lasts; kills it when memory runs short."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.done, self.fired = proc, threading.Event(), False
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self.done.wait(0.02):
            if available_bytes() < GUARD_BYTES:
                self.fired = True
                _stop(self.proc, rank_processes(self.proc.pid), close=False)
                return


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def _stop(proc: subprocess.Popen, ranks: dict[int, int], close: bool = True) -> None:
    """Kill the ranks, then the launcher, each by its pid (measured; the steps are not wanted)."""
    for pid in ranks.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()
    if close and proc.stdout:
        proc.stdout.close()


# ---- the figures it is compared with ---------------------------------------------------------------

def model_figures(overrides: list[str], nproc: int, strategy: str) -> tuple[int, int | None]:
    """(fp32 bytes of the whole model, the planner's start-up bytes per rank or None)."""
    sys.path.insert(0, str(ROOT))
    from zerodp.config import load_config
    from zerodp.models import param_count
    from zerodp.planner import plan_for_training

    cfg = load_config(ROOT / "configs/tiny.yaml", [*RUN, *overrides, f"strategy.name={strategy}"])
    fp32 = 4 * param_count(cfg.model)
    plan = plan_for_training(cfg, nproc, 64 * 2**30, "cpu")
    row = next((e for e in plan.estimates if e.name == strategy), None)
    return fp32, getattr(row, "startup_bytes", None)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default="zero3,fsdp", help="comma list of zerodp strategies")
    p.add_argument("--precision", default="fp32", help="comma list of fp32, bf16")
    p.add_argument("--to-end", action="store_true", help="let the 2 steps run (needs the steps' memory too)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    model = model_overrides(args.layers, args.width, args.heads)
    print(f"model {args.layers} x {args.width} ({args.heads} heads), vocab 256, block 64, {args.nproc} processes")
    for precision in args.precision.split(","):
        for strategy in args.strategies.split(","):
            common = [f"strategy.name={strategy}", f"train.precision={precision}"]
            fp32, predicted = model_figures(model + common, args.nproc, strategy)
            base = measure(BASELINE + common, args.nproc)
            big = measure(model + common, args.nproc, to_end=args.to_end)
            times = f"start-up {big.startup_s:.1f} s" + (f", whole command {big.total_s:.1f} s" if big.total_s else "")
            print(f"\n{strategy} {precision}: fp32 model {fp32 / MB:,.0f} MB; {times} (baseline start-up "
                  f"{base.startup_s:.1f} s)\n  {big.line}")
            print(f"  {'rank':>4} {'peak RSS MB':>12} {'baseline MB':>12} {'growth MB':>10} {'/ fp32':>7} "
                  f"{'predicted MB':>13} {'measured/pred':>14}")
            for rank in sorted(big.peak):
                growth = big.peak[rank] - base.peak[rank]
                pred = f"{predicted / MB:,.0f}" if predicted else "n/a"
                ratio = f"{growth / predicted:.2f}" if predicted else "n/a"
                print(f"  {rank:>4} {big.peak[rank] / MB:>12,.0f} {base.peak[rank] / MB:>12,.0f} "
                      f"{growth / MB:>10,.0f} {growth / fp32:>7.2f} {pred:>13} {ratio:>14}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
