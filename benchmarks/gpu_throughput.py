"""Tokens/s per GPU, MFU and peak memory of real model shapes under every strategy, beside the planner.

On the GPUs of this machine (all of them, one process each, through torchrun): a GPT-2-XL-shaped 1.5B
model (48 layers, width 1600, 25 heads, sequence 1024) and a Llama-3.2-1B-shaped model (16 layers,
width 2048, 32 query / 8 key-value heads, FFN 8192, vocabulary 128256, tied, sequence 2048), in bf16,
under each strategy the planner says fits, with and without `train.compile`. Each run is the whole
`zerodp train` command; the figures come from what it writes (metrics.jsonl: tokens/s per device and MFU
of the steps after the warm-up; its end-of-run report: the allocator's peak), and the planner's
prediction for the same run (zerodp.planner.training.estimate_for_run) is printed beside them.

    python benchmarks/gpu_throughput.py                         # every model x strategy x compile that fits
    python benchmarks/gpu_throughput.py --models llama-1b --strategies fsdp,zero2 --steps 30
    python benchmarks/gpu_throughput.py --tiny                  # what runs without a GPU: tiny models on 2 CPU
                                                                # processes (the test suite runs one row)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "gpt2-xl": ["model.arch=gpt2", "model.n_layer=48", "model.n_embd=1600", "model.n_head=25",
                "model.vocab_size=50304", "model.block_size=1024"],
    "llama-1b": ["model.arch=llama", "model.n_layer=16", "model.n_embd=2048", "model.n_head=32", "model.n_kv_head=8",
                 "model.intermediate_size=8192", "model.vocab_size=128256", "model.block_size=2048",
                 "model.tie_embeddings=true", "model.rope_theta=500000"],
}
TINY = {
    "gpt2-xl": ["model.arch=gpt2", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.vocab_size=256",
                "model.block_size=64"],
    "llama-1b": ["model.arch=llama", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_kv_head=2",
                 "model.intermediate_size=128", "model.vocab_size=256", "model.block_size=64"],
}
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
PEAK = re.compile(r"peak allocated per rank: predicted (\S+ \S+), measured (\S+ \S+)")


def gpus() -> tuple[int, str, int]:
    """(count, name, memory bytes) of the visible GPUs; (0, 'cpu', RAM share) without one."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        props = torch.cuda.get_device_properties(0)
        return torch.cuda.device_count(), props.name, props.total_memory
    return 0, "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def overrides(model: list[str], strategy: str, compiled: bool, steps: int, micro: int, world: int, precision: str,
              out: Path) -> list[str]:
    return [*model, f"strategy.name={strategy}", f"train.compile={str(compiled).lower()}", f"train.max_steps={steps}",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * world}",
            f"train.precision={precision}", "train.eval_every=0", "train.sample_tokens=0", "train.progress=false",
            "checkpoint.every=0", "data.source=builtin", f"train.out_dir={out}"]


def planned(over: list[str], world: int, memory: int, device: str):
    """The planner's estimate for exactly this run (None when it does not fit)."""
    from zerodp.config import load_config
    from zerodp.planner.training import estimate_for_run

    cfg = load_config(str(ROOT / "configs/tiny.yaml"), over)
    e = estimate_for_run(cfg, world, memory, device)
    return e if e.fits else None, e


def run(over: list[str], world: int, warmup: int, timeout: float) -> dict:
    """Train through torchrun; the steps after `warmup` from metrics.jsonl, the peak from the report."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", ""))
    if not env["DS_ACCELERATOR"]:
        env.pop("DS_ACCELERATOR")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", "29617",
           "-m", "zerodp", "train", "configs/tiny.yaml", *over, "--fresh"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:160], "wall_s": wall}
    out = Path(next(o.split("=", 1)[1] for o in over if o.startswith("train.out_dir=")))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][warmup:]
    peak = PEAK.search(p.stderr)
    mfus = [r["mfu"] for r in records if r.get("mfu") is not None]
    return {"tokens_per_s_per_device": statistics.median(r["tokens_per_s_per_device"] for r in records),
            "mfu": statistics.median(mfus) if mfus else None,
            "step_s": statistics.median(r["wall_step_s"] for r in records),  # the time between steps included
            "peak": peak.group(2) if peak else None, "wall_s": wall}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list (default: all five)")
    p.add_argument("--compile", default="off,on", help="off, on or off,on (default: both)")
    p.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (default 5)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per GPU per step (default 4, tiny 2)")
    p.add_argument("--tiny", action="store_true", help="tiny models on 2 CPU processes (what runs without a GPU)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it counts as failed")
    args = p.parse_args(argv)
    n, device, memory = gpus()
    tiny = args.tiny or n == 0
    world = 2 if tiny else n
    if tiny:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    shapes = TINY if tiny else MODELS
    micro = args.micro_batch or (2 if tiny else 4)
    precision = "fp32" if tiny else "bf16"
    steps, warmup = (max(args.steps, 4), min(args.warmup, 2)) if tiny else (args.steps, args.warmup)
    print(f"{'tiny models on ' if tiny else ''}{world} x {device}, {precision}, micro batch {micro} per "
          f"{'process' if tiny else 'GPU'}, {steps} steps (medians after {warmup})", flush=True)
    print("| model | strategy | compile | tokens/s per GPU | MFU | step s | peak allocated | planned: fits, "
          "step s, tokens/s per GPU, memory |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        for model in args.models.split(","):
            for strategy in args.strategies.split(","):
                fitting, e = planned(overrides(shapes[model], strategy, False, steps, micro, world, precision,
                                               Path(tmp)), world, memory, device)
                plan = (f"{'yes' if fitting else 'NO'}, {e.step_s:.3g}, {e.tokens_per_s_per_gpu:,.0f}, "
                        f"{e.total_bytes / 2**30:.1f} GiB")
                for compiled in [c == "on" for c in args.compile.split(",")]:
                    label = f"| {model} | {strategy} | {'on' if compiled else 'off'} |"
                    if not fitting and not tiny:
                        print(f"{label} skipped: the planner says it does not fit | | | | {plan} |", flush=True)
                        continue
                    out = Path(tmp) / f"{model}-{strategy}-{int(compiled)}"
                    got = run(overrides(shapes[model], strategy, compiled, steps, micro, world, precision, out),
                              world, warmup, args.timeout)
                    if "error" in got:
                        print(f"{label} failed: {got['error']} | | | | {plan} |", flush=True)
                        continue
                    mfu = f"{got['mfu']:.1%}" if got["mfu"] is not None else "n/a"
                    print(f"{label} {got['tokens_per_s_per_device']:,.0f} | {mfu} | {got['step_s']:.3f} | "
                          f"{got['peak'] or 'n/a (CPU)'} | {plan} |", flush=True)


if __name__ == "__main__":
    main()
