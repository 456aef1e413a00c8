"""What does the replica check (train.check_replicas_every, docs/operations.md) cost? Inside the training
processes: each strategy trains configs/tiny.yaml with a check after every step (check_replicas_every=1,
log_every=1), and each rank times every train_step and every check that compared (hash and all-gather,
after a barrier so that a peer's lateness is not counted), and under zero3 and fsdp the hashing of the
gathered parameters inside each step's forwards (CPU: the hash runs as it is called); rank 0 prints the
medians after the warm-up steps, the check (with that hashing) against the step without it, and that
share at the default interval (one check every 100 steps).

    python benchmarks/replica_check_cost.py                           # ddp,zero2 on 2 CPU processes
    python benchmarks/replica_check_cost.py --strategies ddp --steps 60 train.micro_batch_size=4

It launches itself under torchrun (`--nproc` processes) and prints one line per strategy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from loop_overhead import ROOT, environment, torchrun

from zerodp.errors import OneLineParser

DEFAULT_EVERY = 100  # train.check_replicas_every's default


def parse_args():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,zero2")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--out", default=None, help="(set by the launch) the folder of the runs")
    p.add_argument("overrides", nargs="*", help="zerodp config overrides for the model and batch")
    args = p.parse_args()
    for name in args.strategies.split(","):
        if name not in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            p.error(f"--strategies: unknown strategy {name!r}; choose from ddp,zero1,zero2,zero3,fsdp")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    return args


def timed_run(strategy: str, args) -> tuple[list[float], list[float], int, int]:
    """One run of `strategy` in this rank: (step seconds, check seconds, tensors compared, their elements)."""
    import torch
    import torch.distributed as dist

    from zerodp.config import load_config
    from zerodp.resilience import replicas
    from zerodp.trainer import loop

    steps, checks, hashing, size = [], [], [], [0, 0]
    original_step, original_check, original_hash = loop.train_step, replicas.ReplicaCheck.check, replicas.bits_hash
    in_step = [0.0, False]  # seconds hashing inside this step's forwards, whether a step runs

    def bits_hash(t):
        t0 = time.perf_counter()
        out = original_hash(t)
        if in_step[1]:
            in_step[0] += time.perf_counter() - t0
        return out

    def sync(device):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    def train_step(strategy_, micro_batches, lr, device):
        in_step[:] = [0.0, True]
        t0 = time.perf_counter()
        out = original_step(strategy_, micro_batches, lr, device)
        sync(device)
        steps.append(time.perf_counter() - t0 - in_step[0])
        hashing.append(in_step[0])
        in_step[1] = False
        return out

    def check(self, step, saving):
        if not self.due(step, saving):
            return original_check(self, step, saving)
        tensors = replicas.replicated_tensors(self.strategy, self.spec_name)
        size[:] = [len(tensors), sum(t.numel() for t in tensors.values())]
        if self.gathered is not None:  # the gathered parameters' sums: the hashing was in the forwards
            model = getattr(self.strategy, "module", None) or self.strategy.model
            size[:] = [len(self.gathered.sums), sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())]
        dist.barrier()
        t0 = time.perf_counter()
        found = original_check(self, step, saving)
        checks.append(time.perf_counter() - t0)  # the all-gather's results were read on the host: synced
        return found

    loop.train_step, replicas.ReplicaCheck.check, replicas.bits_hash = train_step, check, bits_hash
    try:
        cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), args.overrides + [
            f"strategy.name={strategy}", "train.check_replicas_every=1", "train.log_every=1",
            f"train.max_steps={args.steps}", f"train.device={args.device}", "train.progress=false",
            "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0", "checkpoint.keep_last=1",
            f"train.out_dir={os.path.join(args.out, strategy)}"])
        loop.train(cfg, fresh=True)
    finally:
        loop.train_step, replicas.ReplicaCheck.check, replicas.bits_hash = original_step, original_check, original_hash
    return steps, [c + h for c, h in zip(checks, hashing)], *size


def worker(args) -> None:
    import torch.distributed as dist

    lines = []
    for strategy in args.strategies.split(","):
        steps, checks, tensors, elements = timed_run(strategy, args)
        mine = (statistics.median(steps[args.warmup:]), statistics.median(checks[args.warmup:]))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        step_s, check_s = max(s for s, _ in every), max(c for _, c in every)  # the slowest rank's medians
        share = check_s / step_s
        lines.append(f"{strategy:6s} {tensors} tensors ({elements / 1e6:.1f}M elements) a check: "
                     f"{check_s * 1e3:.1f} ms against a step of {step_s * 1e3:.0f} ms ({share:.1%} with a check "
                     f"every step); at the default interval of {DEFAULT_EVERY} steps {share / DEFAULT_EVERY:.3%} "
                     f"of step time")
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} processes on {args.device}, configs/tiny.yaml {' '.join(args.overrides)}; "
              f"medians of steps {args.warmup + 1}..{args.steps}, the slowest rank's", flush=True)
        print("\n".join(lines), flush=True)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = torchrun(args.nproc) + [os.path.abspath(__file__), *sys.argv[1:], "--out", tmp]
        print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}", flush=True)
        sys.exit(subprocess.run(cmd, env=environment(args.device, args.nproc), cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
