"""GPU checks (issue 12, item 7): what the CPU test suite cannot show, run on this machine's GPUs.

    python benchmarks/gpu_checks.py               # every check the visible GPUs allow (< 5 min on one H200)
    python benchmarks/gpu_checks.py --gpus 1      # only the 1-GPU checks on a bigger machine

One line per check, `PASS <check>: <what was measured>` or `FAIL <check>: <what differed>`, then a
summary line; the exit code is 1 if any check failed, else 0. On a machine without a usable GPU it
says so and exits 0 (nothing to check).

On 1 GPU (world 1; fsdp and zero3; a 12 x 768 GPT with a 50304-token head, 1024-token rows, on the
built-in corpus; train.deterministic=true throughout):
  resume <strategy> <precision>   bf16 and fp16: 4 steps straight, and 2 steps then a resume to 4:
                                  steps 3 and 4 have bit-identical losses
  determinism                     fsdp bf16 run again in a fresh process: bit-identical losses
  memory <strategy>               torch.cuda.max_memory_allocated after setup <= the planner's
                                  startup_bytes, over the run and its final save <= total_bytes (both
                                  less the planner's overhead_bytes, the CUDA context, which the
                                  allocator does not count), and the end-of-run sample's peak <= the
                                  training peak
On 2+ GPUs (world 2, nccl):
  equivalence <strategy>          ddp, zero1, zero2, zero3, fsdp in fp32 against single on 1 GPU: losses
                                  and final weights within 1e-4 after 8 steps (tests/distributed/test_equivalence.py)
  killed rank                     torchrun --max-restarts 1, ddp; one worker SIGKILLed after step 3: the
                                  run restarts, resumes and ends with the losses and weights of the
                                  uninterrupted ddp run, bit for bit
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
GIB = 2**30
EQUIVALENCE_TOLERANCE = 1e-4

COMMON = ["data.max_bytes=1000000", "data.prefetch=0", "train.eval_every=0", "train.progress=false",
          "train.deterministic=true", "optim.warmup_steps=2", "checkpoint.keep_last=2"]
# GPT-2 124M's shape: its states (2 GB at 16 bytes a parameter) and activations dwarf the allocator's noise.
GPT2 = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.vocab_size=50304",
        "model.block_size=1024", "train.micro_batch_size=4", "train.global_batch_size=4", "train.sample_tokens=0"]
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64", "model.vocab_size=256",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.max_steps=8", "train.precision=fp32",
        "train.sample_tokens=0", "optim.lr=1e-3", "optim.min_lr=1e-4", "checkpoint.every=2"]


# ---- verdicts (pure) -----------------------------------------------------------------------------------

@dataclass
class Result:
    check: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.check}: {self.detail}"


def exit_code(results: list[Result]) -> int:
    """1 if any check failed (or none ran), else 0."""
    return 0 if results and all(r.ok for r in results) else 1


def summary(results: list[Result]) -> str:
    failed = sum(not r.ok for r in results)
    return f"gpu_checks: {len(results) - failed} passed, {failed} failed"


def same_losses(check: str, got: list[float], want: list[float], tolerance: float = 0.0) -> Result:
    """Equal lengths and every loss within `tolerance` (0: bit-identical)."""
    if len(got) != len(want):
        return Result(check, False, f"{len(got)} losses against {len(want)}")
    worst = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not abs(a - b) <= tolerance]
    if bad:
        i = bad[0]
        return Result(check, False, f"loss {i} is {got[i]!r}, expected {want[i]!r} (max |diff| {worst:.3g}"
                                    f"{', tolerance %g' % tolerance if tolerance else ''})")
    what = "bit-identical" if tolerance == 0 else f"max |diff| {worst:.2g} <= {tolerance:g}"
    return Result(check, True, f"{len(got)} losses {what}")


def within(check: str, figures: list[tuple[str, float, float]]) -> Result:
    """figures: (what, measured, limit) in bytes; passes when every measured <= its limit."""
    parts = [f"{w} {m / GIB:.2f} GiB {'<=' if m <= lim else '>'} {lim / GIB:.2f} GiB" for w, m, lim in figures]
    return Result(check, all(m <= lim for _, m, lim in figures), "; ".join(parts))


# ---- the worker: zerodp.trainer.loop.train in this process, observed -----------------------------------------

def worker(spec_path: str, out_path: str) -> None:
    """Run each of spec's runs with zerodp.trainer.loop.train in one process group; rank 0 writes per run the
    losses, (weights), and the CUDA allocator's peaks: after strategy.setup, before the end-of-run
    sample (training and the final save), and over the sample."""
    import torch

    import zerodp.trainer.loop as zt
    from zerodp.config import load_config
    from zerodp.distributed.process_group import shutdown

    spec = json.loads(Path(spec_path).read_text())
    peaks: dict = {}
    real_make, real_sample = zt.make_strategy, zt.sample

    def make_strategy(name):
        strategy = real_make(name)
        real_setup = strategy.setup

        def setup(*args, **kwargs):
            real_setup(*args, **kwargs)
            peaks["setup"] = torch.cuda.max_memory_allocated()

        strategy.setup = setup
        return strategy

    def sample(*args, **kwargs):
        peaks["train"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        text = real_sample(*args, **kwargs)
        peaks["sample"] = torch.cuda.max_memory_allocated()
        return text

    zt.make_strategy, zt.sample = make_strategy, sample
    results = []
    for run in spec["runs"]:
        peaks.clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cfg = load_config(str(ROOT / "configs/tiny.yaml"), run["overrides"])
        s = zt.train(cfg, fresh=run["fresh"], return_weights=run.get("weights", False))
        peaks.setdefault("train", torch.cuda.max_memory_allocated())
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        results.append({"losses": [s["losses"][k] for k in sorted(s["losses"])], "peaks": dict(peaks),
                        "weights": {n: t.cpu() for n, t in s.get("weights", {}).items()},
                        "device_memory": props.total_memory, "device_name": props.name})
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_path)
    shutdown()


def launch(runs: list[dict], world: int, tmp: Path, timeout: float = 240) -> list[dict]:
    """The worker on `world` GPUs (torchrun when world > 1); its results, or RuntimeError with its log."""
    import torch

    spec, out = tmp / f"spec{time.monotonic_ns()}.json", tmp / f"out{time.monotonic_ns()}.pt"
    spec.write_text(json.dumps({"runs": runs}))
    me = [str(Path(__file__).resolve()), "--worker", str(spec), str(out)]
    cmd = [sys.executable, *me] if world == 1 else [TORCHRUN, "--standalone", f"--nproc-per-node={world}", *me]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result within {timeout:.0f} s") from None
    if r.returncode != 0 or not out.exists():
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {r.returncode}: " + " | ".join(tail))
    return torch.load(out, weights_only=True)


# ---- the checks ----------------------------------------------------------------------------------------

def _run(overrides: list[str], out: Path, steps: int, fresh: bool = True, **extra) -> dict:
    return {"overrides": [*overrides, f"train.out_dir={out}", f"train.max_steps={steps}"], "fresh": fresh, **extra}


def one_gpu(tmp: Path) -> list[Result]:
    results: list[Result] = []
    first = {}
    for strategy in ("fsdp", "zero3"):
        base = COMMON + GPT2 + [f"strategy.name={strategy}", "checkpoint.every=2"]
        runs = []
        for precision in ("bf16", "fp16"):
            over = base + [f"train.precision={precision}"]
            straight = over + (["train.sample_tokens=16"] if precision == "bf16" else [])
            runs += [_run(straight, tmp / f"{strategy}-{precision}-a", 4),
                     _run(over, tmp / f"{strategy}-{precision}-b", 2),
                     _run(over, tmp / f"{strategy}-{precision}-b", 4, fresh=False)]
        try:
            got = launch(runs, 1, tmp)
        except RuntimeError as e:
            results.append(Result(f"resume/memory {strategy}", False, str(e)))
            continue
        first[strategy] = got[0]
        for i, precision in enumerate(("bf16", "fp16")):
            a, resumed = got[3 * i], got[3 * i + 2]
            results.append(same_losses(f"resume {strategy} {precision}", resumed["losses"], a["losses"][2:]))
        results.append(memory_check(strategy, base + ["train.precision=bf16"], got[0]))
    if "fsdp" in first:
        over = COMMON + GPT2 + ["strategy.name=fsdp", "checkpoint.every=2", "train.precision=bf16",
                                "train.sample_tokens=16"]
        try:
            again = launch([_run(over, tmp / "determinism", 4)], 1, tmp)[0]
            results.append(same_losses("determinism fsdp bf16 (a second process)", again["losses"],
                                       first["fsdp"]["losses"]))
        except RuntimeError as e:
            results.append(Result("determinism", False, str(e)))
    return results


def memory_check(strategy: str, overrides: list[str], run: dict) -> Result:
    from zerodp.config import load_config
    from zerodp.planner import plan_for_training

    cfg = load_config(str(ROOT / "configs/tiny.yaml"), overrides)
    plan = plan_for_training(cfg, 1, run["device_memory"], run["device_name"])
    row = next((e for e in plan.estimates if e.name == strategy), None)
    if row is None or "setup" not in run["peaks"] or "sample" not in run["peaks"]:
        return Result(f"memory {strategy}", False, f"no planner row or no measurement: {run['peaks']}")
    p, context = run["peaks"], row.overhead_bytes
    return within(f"memory {strategy} bf16", [
        ("after setup", p["setup"], row.startup_bytes - context),
        ("training and final save", p["train"], row.total_bytes - context),
        ("end-of-run sample", p["sample"], p["train"])])


def two_gpus(tmp: Path) -> list[Result]:
    results: list[Result] = []
    base = COMMON + TINY
    try:
        (reference,) = launch([_run(base + ["strategy.name=single"], tmp / "single", 8, weights=True)], 1, tmp)
        names = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
        got = launch([_run(base + [f"strategy.name={n}"], tmp / f"eq-{n}", 8, weights=True) for n in names], 2, tmp)
    except RuntimeError as e:
        return [Result("equivalence", False, str(e))]
    for name, run in zip(names, got):
        r = same_losses(f"equivalence {name} (world 2)", run["losses"], reference["losses"], EQUIVALENCE_TOLERANCE)
        worst = max(float((run["weights"][n] - w).abs().max()) for n, w in reference["weights"].items())
        if r.ok and worst > EQUIVALENCE_TOLERANCE:
            r = Result(r.check, False, f"weights differ by up to {worst:.3g} > {EQUIVALENCE_TOLERANCE:g}")
        results.append(Result(r.check, r.ok, r.detail + (f"; weights within {worst:.2g}" if r.ok else "")))
    results.append(killed_rank(base + ["strategy.name=ddp"], tmp / "killed", got[0]))
    return results


def killed_rank(overrides: list[str], out: Path, uninterrupted: dict, kill_after: int = 3) -> Result:
    """torchrun's restart after a SIGKILLed worker ends where the uninterrupted run ended."""
    from safetensors.torch import load_file

    check = "killed rank (nccl, torchrun restart)"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "-m", "zerodp", "train",
           "configs/tiny.yaml", *overrides, f"train.out_dir={out}", "train.max_steps=8"]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while agent.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    if not workers:
        agent.kill()
        return Result(check, False, f"no worker to kill (agent exit {agent.poll()})")
    os.kill(int(workers[-1]), signal.SIGKILL)
    try:
        log = agent.communicate(timeout=240)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        return Result(check, False, "the restarted run did not finish within 240 s")
    if agent.returncode != 0 or "resuming from" not in log:
        tail = " | ".join(log.strip().splitlines()[-3:])
        seen = "seen" if "resuming from" in log else "not seen"
        return Result(check, False, f"exit {agent.returncode}, restart {seen}: {tail}")
    losses = [json.loads(x)["loss"] for x in metrics.read_text().splitlines()]
    r = same_losses(check, losses, uninterrupted["losses"])
    latest = (out / "checkpoints" / "latest").read_text().strip()
    weights = load_file(out / "checkpoints" / latest / "model.safetensors")
    differ = [n for n, w in uninterrupted["weights"].items() if not bool((weights[n] == w).all())]
    if r.ok and differ:
        return Result(check, False, f"weights differ from the uninterrupted run: {', '.join(differ[:3])}")
    return Result(check, r.ok, r.detail + ("; final weights bit-identical" if r.ok else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="use at most this many GPUs (default: all visible)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    from zerodp.distributed.devices import count_gpus

    gpus = count_gpus(args.gpus)
    if gpus == 0:
        print("gpu_checks: no usable GPU on this machine (CUDA_VISIBLE_DEVICES, a CPU build of torch or no "
              "driver): nothing to check")
        return 0
    print(f"gpu_checks: {gpus} GPU(s)", flush=True)
    results: list[Result] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_checks") as tmp:
        steps = [one_gpu] + ([two_gpus] if gpus >= 2 else [])
        for step in steps:
            for r in step(Path(tmp)):
                print(r.line(), flush=True)
                results.append(r)
    print(summary(results) + f" in {time.monotonic() - t0:.0f} s")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
