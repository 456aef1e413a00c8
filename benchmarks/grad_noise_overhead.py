"""What does the gradient noise scale (train.grad_noise_scale, docs/grad_noise.md) cost? Whole `zerodp
train` commands, timed from outside with it on and off: the wall time of the command, and the seconds
per step read off the moments its step lines reach this script ((t_N - t_W) / (N - W): start-up and
exit out, everything the loop does per step in). The two settings alternate in order over the rounds;
the median of the rounds counts.

    python benchmarks/grad_noise_overhead.py                             # ddp,zero2,zero3,fsdp, 2 processes
    python benchmarks/grad_noise_overhead.py --strategies ddp --rounds 5 train.micro_batch_size=4
    python benchmarks/grad_noise_overhead.py --direct --steps 30    # one process, steps interleaved

On a machine shared with other jobs the commands' times vary by more than the effect; `--direct`
then measures the same thing inside one process: two `single` strategies over the same model and
batch (micro batch 8 of global 16: 2 micro batches, the estimate on in one and off in the other) take
their steps in turn, ABBA, on one thread, timed in this process's CPU seconds (which other jobs on
the machine do not inflate, as they do wall time); the median of each one's step times (forward,
backward, hooks, fetching the norm, optimizer), their ratio, and the hooks' own work timed alone.

Prints, per strategy, seconds per step and per command with the estimate on and off, and the ratios
on / off (1.000 = no overhead; the target is under 1.01).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

# benchmarks/loop_overhead.py's GPT (a step of about half a second on 2 CPU processes, against which one
# norm per parameter per micro batch is measured), environment, launch and step-line timer
from loop_overhead import MODEL, ROOT, environment, seconds_per_step, torchrun

from zerodp.errors import OneLineParser

SETTINGS = ("true", "false")


def parse_args():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,zero2,zero3,fsdp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps per run (N)")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed ones (W, a log step)")
    p.add_argument("--log-every", type=int, default=10, help="train.log_every")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--direct", action="store_true", help="time interleaved steps inside one process instead")
    p.add_argument("overrides", nargs="*", help="zerodp config overrides for the model and batch")
    args = p.parse_args()
    for name in args.strategies.split(","):
        if name not in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            p.error(f"--strategies: unknown strategy {name!r}; choose from ddp,zero1,zero2,zero3,fsdp")
    if not 0 < args.warmup < args.steps or args.warmup % args.log_every or args.steps % args.log_every:
        p.error(f"--warmup {args.warmup} and --steps {args.steps} must be multiples of --log-every "
                f"{args.log_every}, with 0 < warmup < steps")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: run at least one round, e.g. --rounds 3")
    return args


def command(strategy: str, setting: str, args, out_dir: str) -> list[str]:
    return torchrun(args.nproc) + [
        "-m", "zerodp", "train", "configs/tiny.yaml", *MODEL, *args.overrides, f"strategy.name={strategy}",
        f"train.grad_noise_scale={setting}", f"train.max_steps={args.steps}", f"train.log_every={args.log_every}",
        f"train.device={args.device}", "train.progress=false", "train.eval_every=0", "train.sample_tokens=0",
        "checkpoint.every=0", f"train.out_dir={out_dir}", "--fresh"]


def direct(args) -> None:
    """--direct: the estimate's cost per step, on and off in turn inside one process (see the docstring)."""
    import torch

    from zerodp.config import load_config
    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy
    from zerodp.trainer.loop import train_step

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # CPU seconds of one thread: what the step costs, whatever else runs
    runs = {}
    for v in SETTINGS:
        cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"),
                          MODEL + args.overrides + ["strategy.name=single", f"train.grad_noise_scale={v}"])
        strategy = make_strategy("single")
        strategy.setup(build_model(cfg.model, device="meta"), RunContext(cfg, 0, 1, 0, cpu, cfg.check_batch_split(1)))
        runs[v] = strategy
    t = cfg.train
    shape = (t.micro_batch_size, cfg.model.block_size + 1)
    batches = [torch.randint(0, cfg.model.vocab_size, shape) for _ in range(t.global_batch_size // t.micro_batch_size)]
    micro = [(b[:, :-1], b[:, 1:]) for b in batches]
    times = {v: [] for v in SETTINGS}
    for i in range(args.steps):
        for v in (SETTINGS if i % 2 == 0 else SETTINGS[::-1]):  # ABBA: a drift in load falls on both
            t0 = time.process_time()
            _, norm, _, local = train_step(runs[v], micro, 1e-4, cpu)
            torch.stack([norm, local if local is not None else norm]).tolist()  # what the sync point reads
            times[v].append(time.process_time() - t0)
    on, off = (statistics.median(times[v][2:]) for v in SETTINGS)  # the first steps allocate
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"one process on cpu, model/batch: {' '.join(MODEL + args.overrides)}; {args.steps} steps each, "
          f"interleaved ABBA on one thread, CPU seconds, median of steps 3..{args.steps}")
    print(f"on {on:.4f} CPU s/step, off {off:.4f} CPU s/step, ratio {on / off:.4f}")
    # The hooks' own work, timed alone: one norm per parameter gradient of one micro batch. On a busy
    # machine the step ratios above vary by more than this; this figure does not depend on the load.
    model = runs["false"].model
    model(*micro[0]).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = []
    for _ in range(20):
        t0 = time.process_time()
        total = torch.zeros(())
        for g in grads:
            total.add_(torch.linalg.vector_norm(g, dtype=torch.float32).square())
        norms.append(time.process_time() - t0)
    per_micro = statistics.median(norms)
    micro_per_step = len(micro)
    print(f"the hooks' work alone: {len(grads)} norms per micro batch, {per_micro * 1e3:.2f} ms; "
          f"x {micro_per_step} micro batches = {per_micro * micro_per_step / off:.3%} of the off step")


def main() -> None:
    args = parse_args()
    if args.direct:
        direct(args)
        return
    env = environment(args.device, args.nproc)
    strategies = args.strategies.split(",")
    times = {(s, v): [] for s in strategies for v in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for s in strategies:
                for v in SETTINGS[r % 2:] + SETTINGS[:r % 2]:  # each setting goes first in turn
                    t = seconds_per_step(command(s, v, args, os.path.join(tmp, f"{s}-{v}-{r}")), env, args.warmup,
                                         args.steps)
                    times[(s, v)].append(t)
                    print(f"round {r + 1}/{args.rounds} {s:6s} grad_noise_scale={v:5s} {t[0]:.4f} s/step, "
                          f"{t[1]:.1f} s command", file=sys.stderr, flush=True)
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"{args.nproc} processes on {args.device}, model/batch: {' '.join(MODEL + args.overrides)}; steps "
          f"{args.warmup + 1}..{args.steps} timed from outside, log/sync every {args.log_every}; median of "
          f"{args.rounds} alternating rounds")
    print(f"{'strategy':8s} {'on s/step':>10s} {'off s/step':>11s} {'ratio':>7s} {'on command s':>13s} "
          f"{'off command s':>14s} {'ratio':>7s}")
    for s in strategies:
        on, off = ([statistics.median(t[i] for t in times[(s, v)]) for i in (0, 1)] for v in SETTINGS)
        print(f"{s:8s} {on[0]:10.4f} {off[0]:11.4f} {on[0] / off[0]:7.3f} {on[1]:13.1f} {off[1]:14.1f} "
              f"{on[1] / off[1]:7.3f}")


if __name__ == "__main__":
    main()
