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
