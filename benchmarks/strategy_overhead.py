"""What does zerodp's strategy layer cost? zerodp's training step against a minimal hand-written loop
on the same raw engine (plain DDP, plain deepspeed.initialize, plain fully_shard): same model, batch,
precision and optimizer, alternating in one run so both see the same machine state.

    python benchmarks/strategy_overhead.py                       # every strategy, 2 GPUs (or 2 CPU processes)
    python benchmarks/strategy_overhead.py --nproc 2 --strategies ddp,zero2 --steps 10 --rounds 6
    python benchmarks/strategy_overhead.py --device cpu          # on the CPU, GPUs or not

Prints the median step time of each and the ratio zerodp / raw per strategy (1.00 = no overhead).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time

from zerodp.errors import OneLineParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def parse_args():
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="processes: default one per GPU, at most 2 (python -m zerodp.distributed.devices count), "
                        "else 2 on the CPU")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when a GPU is usable (one per process), else the CPU")
    p.add_argument("--strategies", default="ddp,zero1,zero2,zero3,fsdp")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each loop per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds; the loop that goes first alternates")
    p.add_argument("--precision", default="fp32")
    p.add_argument("overrides", nargs="*", help="zerodp config overrides for the model/batch")
    return p, p.parse_args()


DEFAULT_MODEL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=128",
                 "train.micro_batch_size=4", "data.max_bytes=400000", "optim.warmup_steps=0"]


def placement(device: str, nproc: int | None, gpus: int) -> tuple[str, int]:
    """(device, processes) for --device and --nproc on a machine offering `gpus` GPUs; ValueError says why not."""
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    if device == "cuda":
        nproc = nproc or min(gpus, 2)
        if gpus == 0:
            raise ValueError("--device cuda but no GPU is usable here; pass --device cpu")
        if nproc > gpus:
            raise ValueError(f"--nproc {nproc} on --device cuda needs {nproc} GPUs, this machine offers {gpus}; "
                             f"pass --nproc {gpus}")
        return device, nproc
    return device, nproc or 2


def launch(args, parser) -> None:
    """Re-run this script on --nproc processes (as torchrun would), on --device, and wait."""
    from zerodp.distributed.devices import count_gpus

    if args.nproc is not None and args.nproc < 1:
        parser.error(f"--nproc must be 1 or more, got {args.nproc}")
    try:
        device, nproc = placement(args.device, args.nproc, count_gpus())
    except ValueError as e:
        parser.error(str(e))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=ROOT)
        if device == "cpu":  # DeepSpeed's CPU accelerator, and the cores shared out
            env["DS_ACCELERATOR"] = "cpu"
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        procs.append(subprocess.Popen([sys.executable, *sys.argv, "--device", device], env=env))
    sys.exit(max(p.wait() for p in procs))


# ---- the raw loops: what a user would write by hand on each engine --------------------------------

def adamw_step(model, opt, lr: float, clip: float):
    """The hand-written step both raw DDP and raw FSDP loops end with; returns the pre-clip grad norm."""
    import torch

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def raw_ddp(model, cfg, ctx):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerodp.optim import adamw_kwargs, param_groups

    ddp = DDP(model, bucket_cap_mb=cfg.strategy.bucket_size_mb, gradient_as_bucket_view=True)  # as zerodp's
    opt = torch.optim.AdamW(param_groups(model, cfg), **adamw_kwargs(cfg))

    def step(micro_batches, lr):
        for i, (x, y) in enumerate(micro_batches):
            with ddp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                loss = ddp(x, y)
                (loss / len(micro_batches)).backward()
        return loss.item(), float(adamw_step(model, opt, lr, cfg.optim.grad_clip))
    return step


def raw_deepspeed(stage):
    def build(model, cfg, ctx):
        import deepspeed
        import torch

        from zerodp.optim import adamw_kwargs, param_groups
        from zerodp.strategies.zero import deepspeed_config

        opt = torch.optim.AdamW(param_groups(model, cfg), **adamw_kwargs(cfg))
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                          config=deepspeed_config(cfg, stage, ctx.grad_accum_steps, ctx.world_size))

        def step(micro_batches, lr):
            for g in engine.optimizer.param_groups:
                g["lr"] = lr
            for x, y in micro_batches:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            return loss.item(), float(engine.get_global_grad_norm() or 0.0)
        return step
    return build


def raw_fsdp(model, cfg, ctx):
    import torch
    from torch.distributed.fsdp import fully_shard

    from zerodp.optim import adamw_kwargs, param_groups

    for block in model.blocks():
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(param_groups(model, cfg), **adamw_kwargs(cfg))

    def step(micro_batches, lr):
        for i, (x, y) in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            loss = model(x, y)
            (loss / len(micro_batches)).backward()
        norm = adamw_step(model, opt, lr, cfg.optim.grad_clip)
        return loss.item(), float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return step


RAW = {"ddp": raw_ddp, "zero1": raw_deepspeed(1), "zero2": raw_deepspeed(2), "zero3": raw_deepspeed(3),
       "fsdp": raw_fsdp}


def worker(args) -> None:
    import torch

    from zerodp.config import load_config
    from zerodp.data.batches import TokenBatches, load_tokens
    from zerodp.distributed.process_group import init_distributed
    from zerodp.models import GPT
    from zerodp.strategies import RunContext, make_strategy
    from zerodp.trainer.loop import train_step

    env = init_distributed(args.device)  # the launcher resolved auto: cpu or cuda
    world = env.world_size
    base = DEFAULT_MODEL + [f"train.precision={args.precision}"] + args.overrides
    cfg0 = load_config(None, base)
    cfg = load_config(None, base + [f"train.global_batch_size={cfg0.train.micro_batch_size * world * 2}"])
    accum = cfg.check_batch_split(world)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    ctx = RunContext(cfg, env.rank, world, env.local_rank, env.device, accum)
    rows = []
    for name in args.strategies.split(","):
        torch.manual_seed(0)
        strategy = make_strategy(name)
        strategy.setup(GPT(cfg.model), ctx)
        torch.manual_seed(0)
        raw_step = RAW[name](GPT(cfg.model).to(env.device), cfg, ctx)
        # float(): the figures to the host, as the raw loops do with .item()
        loops = {"zerodp": lambda mb: [float(v) for v in train_step(strategy, mb, 1e-4, env.device)[:2]],
                 "raw": lambda mb: raw_step(mb, 1e-4)}
        times = {"zerodp": [], "raw": []}
        step = 0
        for which in ("zerodp", "raw"):  # warm-up: first steps allocate and build buffers
            loops[which](batches(data, cfg, 0, env, world))
        for r in range(args.rounds):
            order = ("zerodp", "raw") if r % 2 == 0 else ("raw", "zerodp")  # neither always goes first
            for _ in range(args.steps):
                mb = [(x.to(env.device), y.to(env.device)) for x, y in batches(data, cfg, step, env, world)]
                for which in order:  # alternate step by step: both see the same machine state
                    torch.distributed.barrier()
                    t0 = time.perf_counter()
                    loops[which](mb)
                    times[which].append(time.perf_counter() - t0)
                step += 1
        z, r = statistics.median(times["zerodp"]), statistics.median(times["raw"])
        rows.append((name, z, r))
    if env.rank == 0:
        print(f"\ncommand: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
        print(f"world {world}, precision {args.precision}, micro batch {cfg.train.micro_batch_size}, "
              f"accum {accum}, seq {cfg.model.block_size}, {args.rounds} rounds x {args.steps} steps of each, "
              f"alternating step by step; median step time")
        print(f"{'strategy':8s} {'zerodp s/step':>14s} {'raw s/step':>11s} {'ratio':>7s}")
        for name, z, r in rows:
            print(f"{name:8s} {z:14.4f} {r:11.4f} {z / r:7.3f}")


def batches(data, cfg, step, env, world):
    t = cfg.train
    return data.rank_micro_batches(step, t.global_batch_size, t.micro_batch_size, env.rank, world)


if __name__ == "__main__":
    parser, a = parse_args()
    if "RANK" not in os.environ:
        launch(a, parser)
    else:
        worker(a)
