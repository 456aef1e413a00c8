"""Rank functions for the runtime's tests (tests/distributed/test_runtime.py): subgroup timeouts, and
the devices of what each strategy's step returns."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp.config import load_config


def _timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def subgroup_timeouts(timeout_s: int) -> dict:
    """The timeouts of HSDP's mesh groups (fsdp with strategy.timeout_s=`timeout_s`, 2 ranks a shard
    group) and of hpZ's group (zero3's, of 2 ranks), beside the default group's and a plain new_group's."""
    from zerodp.strategies.base import RunContext
    from zerodp.strategies.fsdp import device_mesh
    from zerodp.strategies.zeropp import hpz_group

    cfg = load_config(None, ["strategy.name=fsdp", "strategy.hybrid_shard=true", "strategy.shard_group_size=2",
                             f"strategy.timeout_s={timeout_s}", "train.device=cpu"])
    world = dist.get_world_size()
    mesh = device_mesh(RunContext(cfg, dist.get_rank(), world, dist.get_rank(), torch.device("cpu"), 1, world))
    hpz = hpz_group(2)
    out = {"world": _timeout_s(dist.group.WORLD), "plain_new_group": _timeout_s(dist.new_group(list(range(world)))),
           "replicate": _timeout_s(mesh.get_group("replicate")), "shard": _timeout_s(mesh.get_group("shard")),
           "hpz": _timeout_s(hpz), "hpz_size": dist.get_world_size(hpz), "shard_size": mesh.size(1)}
    hpz_group(1)  # DeepSpeed's process-wide hpZ group cleared again
    return out


def step_output_devices(runs: list[list[str]]) -> list[dict]:
    """For each run's overrides: the device the strategy declares (ctx.device) and where the loss, grad
    norm and local gradient norm of one train_step are, and whether the loop can stack them."""
    from zerodp.distributed.process_group import init_distributed
    from zerodp.trainer.loop import set_up, train_step

    out = []
    for overrides in runs:
        cfg = load_config(None, overrides)
        env = init_distributed(cfg.train.device, cfg.strategy.timeout_s)
        t = cfg.train
        accum = t.global_batch_size // (t.micro_batch_size * env.world_size)
        strategy, _ = set_up(cfg, env, accum)
        g = torch.Generator().manual_seed(env.rank)
        shape = (t.micro_batch_size, cfg.model.block_size)
        batches = [(torch.randint(0, cfg.model.vocab_size, shape, generator=g),
                    torch.randint(0, cfg.model.vocab_size, shape, generator=g)) for _ in range(accum)]
        loss, norm, _, local_sq = train_step(strategy, batches, 1e-3, env.device)
        values = [v for v in (loss, norm, local_sq) if torch.is_tensor(v)]
        out.append({"declared": str(strategy.ctx.device), "loss": str(loss.device),
                    "grad_norm": str(norm.device) if torch.is_tensor(norm) else type(norm).__name__,
                    "local_sq": str(local_sq.device) if torch.is_tensor(local_sq) else repr(local_sq),
                    "shapes": [tuple(v.shape) for v in values],
                    "stacked": torch.stack([v.detach().float() for v in values]).tolist()})
    return out


def train_memory(overrides: list[str]) -> dict:
    """The summary's peaks and memory lines of a short run."""
    from zerodp.trainer.loop import train

    summary = train(load_config(None, overrides), fresh=True)
    return {"memory": summary["memory"], "planned": sorted(summary["planned"])}
