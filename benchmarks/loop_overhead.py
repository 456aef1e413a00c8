"""What does the whole `zerodp train` loop cost over a loop its user would write by hand on the same
engine? Timed from outside the processes: each command runs under torchrun, and the time a step takes
is read off the moments its log lines reach this script (the line of step W after warm-up and the line
of the last step N: (t_N - t_W) / (N - W)), so start-up, the final checkpoint and the exit are out, and
everything the loop does per step, data loading, metrics, host syncs, stragglers, heartbeat, is in.

The hand-written loops (plain DDP, deepspeed.initialize for ZeRO-1/2/3, fully_shard) train the same GPT
(zerodp.models) on the same batch with the same AdamW, read a batch as nanoGPT does (random windows of
the token tensor), set the cosine learning rate and print the loss every --log-every steps (.item()
only then), as torchtitan does. Each runs twice: with the engine's default settings, and with the
settings zerodp gives the engine (its DeepSpeed config, DDP's gradient_as_bucket_view, FSDP's root
kept gathered after forward). Runs alternate in order over the rounds.

Two clocks per run, both read over the same timed steps: wall seconds, and the CPU seconds (user + system)
of the rank processes, read from /proc/<pid>/stat at the moments those two step lines arrive. On a
machine shared with other jobs wall time swings by tens of percent between rounds, while the work the
ranks do is much steadier: the CPU-seconds ratio is the one that resolves a few percent there (a
collective's wait does not count: gloo blocks rather than spins). On GPUs the wall ratio is the one
that matters (the host's CPU time there is mostly launch and waiting).

    python benchmarks/loop_overhead.py                                  # every strategy, 2 processes
    python benchmarks/loop_overhead.py --strategies ddp,fsdp --rounds 2 --steps 30
    python benchmarks/loop_overhead.py --against zerodp --rounds 7    # only the loops with zerodp's settings
    python benchmarks/loop_overhead.py --device cuda                    # one process per GPU (2)

Prints, per strategy, seconds per step of each (median over rounds) and zerodp / hand-written (1.00 = no
overhead) by CPU seconds and by wall time: the ratio of the medians, with a 90% bootstrap interval
(rounds resampled) and the range of the per-round ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from zerodp.errors import OneLineParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LINE = re.compile(r"step (\d+)/(\d+): loss")
# A GPT whose step takes about half a second on 2 CPU processes: the loop's fixed costs are measured
# against a step of realistic length, not against microseconds.
MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.block_size=256", "model.vocab_size=256",
         "train.global_batch_size=16", "train.micro_batch_size=8", "data.max_bytes=1000000", "optim.warmup_steps=5"]
VARIANTS = ("zerodp", "default", "zerodp-settings")
AGAINST = {"both": VARIANTS, "default": ("zerodp", "default"), "zerodp": ("zerodp", "zerodp-settings")}
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100



def parse_args():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps per run (N)")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed ones (W, a log step)")
    p.add_argument("--log-every", type=int, default=10, help="train.log_every, and the plain loops' print interval")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--against", choices=tuple(AGAINST), default="both",
                   help="the hand-written loops to run: with the engines' default settings, with zerodp's, or both")
    p.add_argument("--plain", help=argparse.SUPPRESS)  # a worker: the hand-written loop of this strategy
    p.add_argument("--settings", choices=("default", "zerodp"), help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="zerodp config overrides for the model and batch")
    args = p.parse_args()
    for name in args.strategies.split(","):
        if name not in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            p.error(f"--strategies: unknown strategy {name!r}; choose from ddp,zero1,zero2,zero3,fsdp")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: run at least one round")
    if not 0 < args.warmup < args.steps or args.warmup % args.log_every or args.steps % args.log_every:
        p.error(f"--warmup {args.warmup} and --steps {args.steps} must be multiples of --log-every "
                f"{args.log_every}, with 0 < warmup < steps")
    return args


# ---- from outside: run the commands, time their lines --------------------------------------------

def environment(device: str, nproc: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    if device == "cpu":  # DeepSpeed's CPU accelerator, no GPU, and the cores shared out
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))))
    return env


def torchrun(nproc: int) -> list[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def ranks_cpu_seconds(launcher: int) -> float | None:
    """User + system CPU seconds of every process below `launcher` (torchrun's ranks and whatever they
    started; each process's figure holds all its threads, finished ones included), from /proc; None
    where there is no /proc."""
    if not os.path.isdir(f"/proc/{launcher}"):
        return None
    total, todo = 0, _children(launcher)
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue  # exited in between
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
        todo += _children(pid)
    return total / CLK_TCK


def step_costs(cmd: list[str], env: dict, warmup: int, steps: int) -> tuple[float, float | None, float]:
    """Run `cmd`; time its step lines as they arrive. Returns (wall seconds per step, (t_steps - t_warmup)
    / (steps - warmup); the ranks' CPU seconds per step over the same steps, or None without /proc;
    seconds for the whole command)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, float] = {}
    cpu: dict[int, float | None] = {}
    tail: list[str] = []

    def read():
        for line in proc.stdout:
            now = time.perf_counter()
            tail.append(line)
            m = STEP_LINE.search(line)
            if m and int(m.group(1)) not in seen:
                seen[int(m.group(1))] = now
                if int(m.group(1)) in (warmup, steps):
                    cpu[int(m.group(1))] = ranks_cpu_seconds(proc.pid)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join()
    whole = time.perf_counter() - t0
    if code != 0 or warmup not in seen or steps not in seen:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: error: {' '.join(cmd)} exited {code} (steps seen: "
                         f"{sorted(seen)}):\n{''.join(tail[-30:])}")
    used = None if cpu[warmup] is None or cpu[steps] is None else (cpu[steps] - cpu[warmup]) / (steps - warmup)
    return (seen[steps] - seen[warmup]) / (steps - warmup), used, whole


def seconds_per_step(cmd: list[str], env: dict, warmup: int, steps: int) -> tuple[float, float]:
    """Run `cmd`; time its step lines as they arrive: ((t_steps - t_warmup) / (steps - warmup), seconds
    for the whole command)."""
    wall, _, whole = step_costs(cmd, env, warmup, steps)
    return wall, whole


def ratio_spread(ours: list[float], theirs: list[float], draws: int = 2000) -> tuple[float, float, float, float, float]:
    """median(ours) / median(theirs), its 90% bootstrap interval (each side's rounds resampled), and the
    lowest and highest ratio of one round's pair (the runs of a round ran next to each other)."""
    rng = random.Random(0)
    med = statistics.median
    boot = sorted(med(rng.choices(ours, k=len(ours))) / med(rng.choices(theirs, k=len(theirs)))
                  for _ in range(draws))
    paired = [a / b for a, b in zip(ours, theirs)]
    return med(ours) / med(theirs), boot[int(0.05 * draws)], boot[int(0.95 * draws) - 1], min(paired), max(paired)


def command(variant: str, strategy: str, args, out_dir: str) -> list[str]:
    over = MODEL + args.overrides
    if variant == "zerodp":
        return torchrun(args.nproc) + [
            "-m", "zerodp", "train", "configs/tiny.yaml", *over, f"strategy.name={strategy}",
            f"train.max_steps={args.steps}", f"train.log_every={args.log_every}", f"train.device={args.device}",
            "train.progress=false", "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0",
            f"train.out_dir={out_dir}", "--fresh"]
    settings = "default" if variant == "default" else "zerodp"
    return torchrun(args.nproc) + [
        os.path.abspath(__file__), "--plain", strategy, "--settings", settings, "--device", args.device,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--log-every", str(args.log_every), *over]


def main_outside(args) -> None:
    env = environment(args.device, args.nproc)
    strategies = args.strategies.split(",")
    variants = AGAINST[args.against]
    wall = {(s, v): [] for s in strategies for v in variants}
    cpu = {(s, v): [] for s in strategies for v in variants}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for s in strategies:
                k = r % len(variants)
                for v in variants[k:] + variants[:k]:  # each variant goes first in turn
                    run = lambda: step_costs(command(v, s, args, os.path.join(tmp, f"{s}-{r}")), env,  # noqa: E731
                                             args.warmup, args.steps)
                    try:
                        t, c, _ = run()
                    except SystemExit as failed:  # a shared machine's flake (a rank aborted): said, and run again
                        print(str(failed).splitlines()[0] + " -- running it again", file=sys.stderr, flush=True)
                        t, c, _ = run()
                    wall[(s, v)].append(t)
                    cpu[(s, v)].append(c)
                    said = f", {c:.4f} CPU s/step" if c is not None else ""
                    print(f"round {r + 1}/{args.rounds} {s:6s} {v:16s} {t:.4f} s/step{said}", file=sys.stderr,
                          flush=True)
    load_after = os.getloadavg()
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"{args.nproc} processes on {args.device} ({os.cpu_count()} cores; load average (1, 5, 15 min) "
          f"{', '.join(f'{x:.2f}' for x in load_before)} at the start, "
          f"{', '.join(f'{x:.2f}' for x in load_after)} at the end), model/batch: {' '.join(MODEL + args.overrides)}; "
          f"steps {args.warmup + 1}..{args.steps} timed from outside, log/sync every {args.log_every}; "
          f"{args.rounds} alternating rounds")
    clocks = [("CPU", cpu), ("wall", wall)] if all(c is not None for c in sum(cpu.values(), [])) else [("wall", wall)]
    print("seconds per step, median of the rounds (CPU: the ranks' CPU seconds summed):")
    print(f"{'strategy':8s} {'clock':5s} " + " ".join(f"{v:>16s}" for v in variants))
    for s in strategies:
        for name, clock in clocks:
            print(f"{s:8s} {name:5s} " + " ".join(f"{statistics.median(clock[(s, v)]):16.4f}" for v in variants))
    print("zerodp / hand-written: ratio of the medians [90% bootstrap interval] (range of the per-round ratios):")
    print(f"{'strategy':8s} {'clock':5s} " + " ".join(f"{'vs ' + v:>38s}" for v in variants[1:]))
    for s in strategies:
        for name, clock in clocks:
            cells = []
            for v in variants[1:]:
                m, lo, hi, pmin, pmax = ratio_spread(clock[(s, "zerodp")], clock[(s, v)])
                cells.append(f"{m:.3f} [{lo:.3f}, {hi:.3f}] ({pmin:.3f}-{pmax:.3f})")
            print(f"{s:8s} {name:5s} " + " ".join(f"{c:>38s}" for c in cells))


# ---- inside: the hand-written loops --------------------------------------------------------------

def plain_worker(args) -> None:
    """One rank of the hand-written loop of `args.plain` with `args.settings`."""
    import torch
    import torch.distributed as dist

    from zerodp.config import load_config
    from zerodp.data.batches import load_tokens
    from zerodp.models import build_model
    from zerodp.optim import adamw_kwargs, param_groups
    from zerodp.optim.schedules import lr_at

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), MODEL + args.overrides)
    t = cfg.train
    accum = t.global_batch_size // (t.micro_batch_size * world)
    stream = load_tokens(cfg)
    tokens = torch.as_tensor(stream[: len(stream) * 9 // 10].astype("int64"))
    gen = torch.Generator().manual_seed(1337 + rank)
    block = cfg.model.block_size

    def get_batch():  # nanoGPT's: random windows of the training tokens
        i = torch.randint(len(tokens) - block - 1, (t.micro_batch_size,), generator=gen)
        x = torch.stack([tokens[j:j + block] for j in i])
        y = torch.stack([tokens[j + 1:j + 1 + block] for j in i])
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    torch.manual_seed(1337)
    model = build_model(cfg.model, cfg.train.seed, device)
    zerodp_settings = args.settings == "zerodp"
    if args.plain == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        engine = DDP(model, gradient_as_bucket_view=True) if zerodp_settings else DDP(model)
        opt = torch.optim.AdamW(param_groups(model, cfg), **adamw_kwargs(cfg))
    elif args.plain == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks():
            fully_shard(b)
        fully_shard(model, reshard_after_forward=not zerodp_settings)
        engine = model
        opt = torch.optim.AdamW(param_groups(model, cfg), **adamw_kwargs(cfg))
    else:
        import deepspeed

        from zerodp.strategies.zero import deepspeed_config

        stage = int(args.plain[-1])
        opt = torch.optim.AdamW(param_groups(model, cfg), **adamw_kwargs(cfg))
        config = deepspeed_config(cfg, stage, accum, world) if zerodp_settings else {
            "train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": accum,
            "gradient_clipping": cfg.optim.grad_clip, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True}
        engine, opt, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    for step in range(args.steps):
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        for i in range(accum):
            x, y = get_batch()
            if args.plain.startswith("zero"):  # DeepSpeed's idiom: step() acts at the accumulation boundary
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            else:
                last = i == accum - 1
                if args.plain == "fsdp":
                    model.set_requires_gradient_sync(last)
                    sync = contextlib.nullcontext()
                else:
                    sync = contextlib.nullcontext() if last else engine.no_sync()
                with sync:
                    loss = engine(x, y)
                    (loss / accum).backward()
            loss_sum += loss.detach()
        if not args.plain.startswith("zero"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % args.log_every == 0 and rank == 0:
            print(f"plain: step {step + 1}/{args.steps}: loss {loss_sum.item() / accum:.4f}", flush=True)
    dist.barrier()  # no rank tears the group down while another still talks (ZeRO-3 aborted without it)
    dist.destroy_process_group()


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.plain:
        plain_worker(parsed)
    else:
        main_outside(parsed)
