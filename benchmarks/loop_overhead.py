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
kept gathered after forward). Runs alternate in order over the rounds; the median of the rounds counts.

    python benchmarks/loop_overhead.py                                  # every strategy, 2 processes
    python benchmarks/loop_overhead.py --strategies ddp,fsdp --rounds 2 --steps 30
    python benchmarks/loop_overhead.py --device cuda                    # one process per GPU (2)

Prints seconds per step of each and the ratio zerodp / hand-written per strategy (1.00 = no overhead).
"""

from __future__ import annotations

import argparse
import contextlib
import os
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



def parse_args():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps per run (N)")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timed ones (W, a log step)")
    p.add_argument("--log-every", type=int, default=10, help="train.log_every, and the plain loops' print interval")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plain", help=argparse.SUPPRESS)  # a worker: the hand-written loop of this strategy
    p.add_argument("--settings", choices=("default", "zerodp"), help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="zerodp config overrides for the model and batch")
    args = p.parse_args()
    for name in args.strategies.split(","):
        if name not in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            p.error(f"--strategies: unknown strategy {name!r}; choose from ddp,zero1,zero2,zero3,fsdp")
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


def seconds_per_step(cmd: list[str], env: dict, warmup: int, steps: int) -> tuple[float, float]:
    """Run `cmd`; time its step lines as they arrive: ((t_steps - t_warmup) / (steps - warmup), seconds
    for the whole command)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, float] = {}
    tail: list[str] = []

    def read():
        for line in proc.stdout:
            now = time.perf_counter()
            tail.append(line)
            m = STEP_LINE.search(line)
            if m:
                seen.setdefault(int(m.group(1)), now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join()
    whole = time.perf_counter() - t0
    if code != 0 or warmup not in seen or steps not in seen:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: error: {' '.join(cmd)} exited {code} (steps seen: "
                         f"{sorted(seen)}):\n{''.join(tail[-30:])}")
    return (seen[steps] - seen[warmup]) / (steps - warmup), whole


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
    times = {(s, v): [] for s in strategies for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for s in strategies:
                order = VARIANTS[r % 3:] + VARIANTS[:r % 3]  # each variant goes first in turn
                for v in order:
                    run = lambda: seconds_per_step(command(v, s, args, os.path.join(tmp, f"{s}-{r}")), env,  # noqa: E731
                                                   args.warmup, args.steps)[0]
                    try:
                        t = run()
                    except SystemExit as failed:  # a shared machine's flake (a rank aborted): said, and run again
                        print(str(failed).splitlines()[0] + " -- running it again", file=sys.stderr, flush=True)
                        t = run()
                    times[(s, v)].append(t)
                    print(f"round {r + 1}/{args.rounds} {s:6s} {v:16s} {t:.4f} s/step", file=sys.stderr, flush=True)
    print(f"\ncommand: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"{args.nproc} processes on {args.device}, model/batch: {' '.join(MODEL + args.overrides)}; steps "
          f"{args.warmup + 1}..{args.steps} timed from outside, log/sync every {args.log_every}; median of "
          f"{args.rounds} alternating rounds")
    print(f"{'strategy':8s} {'zerodp s/step':>14s} {'plain, engine defaults':>23s} {'plain, zerodp settings':>23s} "
          f"{'ratio (defaults)':>17s} {'ratio (settings)':>17s}")
    for s in strategies:
        z, d, k = (statistics.median(times[(s, v)]) for v in VARIANTS)
        print(f"{s:8s} {z:14.4f} {d:23.4f} {k:23.4f} {z / d:17.3f} {z / k:17.3f}")


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
