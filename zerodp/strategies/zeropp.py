"""ZeRO++ for zerodp's zero3 (DeepSpeed's hpZ, qwZ, qgZ): which settings can run and help where, and
what zerodp must do around DeepSpeed's hpZ state (its per-process group, the secondary partitions).

Plain functions for zerodp/strategies/zero.py; the checks need no process group (`--dry-run` runs them).
"""

from __future__ import annotations

import os

import torch

from zerodp.config import StrategyConfig, zeropp_refusal
from zerodp.distributed.process_group import LOCAL_WORLD_VARS, new_group
from zerodp.errors import UserError


def hpz_partition_size(s: StrategyConfig, stage: int, world_size: int, ranks_per_node: int | None) -> int:
    """DeepSpeed's zero_hpz_partition_size for `s` (0 resolved to `ranks_per_node`), after refusing the
    ZeRO++ settings that cannot help: any of them under zero1/2, an hpZ group that does not divide the
    world or spans all of it, hpZ or qgZ on one node (`ranks_per_node` None: not known, not checked)."""
    if refusal := zeropp_refusal(s, f"zero{stage}"):
        raise UserError(refusal)
    one_node = world_size == 1 or (ranks_per_node is not None and ranks_per_node >= world_size)
    where = "this run has one rank" if world_size == 1 else f"all {world_size} ranks are on one node"
    if s.quantized_gradients and one_node:
        raise UserError(f"strategy.quantized_gradients=true: qgZ quantizes only the gradient reduction between nodes, "
                        f"and {where}: DeepSpeed would reduce-scatter them unquantized; remove "
                        f"strategy.quantized_gradients, or use it on more than one node")
    size = s.hpz_partition_size
    if size == 1:
        return 1
    if one_node or size == world_size:
        why = where if one_node else f"its group of {size} ranks is the whole world"
        raise UserError(f"strategy.hpz_partition_size={size}: hpZ needs more than one node: {why}, and on one node "
                        f"every rank already gathers over the fast link; remove strategy.hpz_partition_size (or set "
                        f"it to 1), or set it to the ranks per node of a multi-node run")
    if size == 0:
        if ranks_per_node is None:
            raise UserError(f"strategy.hpz_partition_size=0 means the ranks of one node, and the launcher does not say "
                            f"how many that is ({' or '.join(LOCAL_WORLD_VARS)} unset); set "
                            f"strategy.hpz_partition_size to the ranks per node")
        size = ranks_per_node
    if world_size % size:
        raise UserError(f"strategy.hpz_partition_size={size} does not divide the world size {world_size}; set it to "
                        f"the ranks per node (a divisor of {world_size}), or 0 for the launcher's LOCAL_WORLD_SIZE")
    return size


def ranks_per_node(fallback: int | None = None) -> int | None:
    """The ranks of one node as the launcher tells them (LOCAL_WORLD_SIZE, LOCAL_SIZE, ...), which
    `--dry-run` sees too; else `fallback` (setup: the ranks sharing this rank's host name)."""
    for var in LOCAL_WORLD_VARS:
        if os.environ.get(var, "").strip():
            try:
                return int(os.environ[var])
            except ValueError:
                raise UserError(f"{var}={os.environ[var]!r} is not a number of ranks per node; unset it or fix "
                                f"the launcher") from None
    return fallback


def check_quantizer(s: StrategyConfig) -> None:
    """qwZ and qgZ run on DeepSpeed's quantizer kernels (QuantizerBuilder), which only its GPU
    accelerators build: DeepSpeed 0.19's CPU accelerator gives a NotImplementedBuilder whose load()
    raises "This op had not been implemented on CPU backend" (qwZ in zero.Init, qgZ at the first
    gradient reduction). Refused before either starts."""
    wanted = [key for key in ("quantized_weights", "quantized_gradients") if getattr(s, key)]
    if not wanted:
        return
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    builder = accel.get_op_builder("QuantizerBuilder")
    if builder is None or builder.__name__ == "NotImplementedBuilder":
        raise UserError(f"strategy.{wanted[0]}=true: DeepSpeed's {accel.device_name()} accelerator has no quantizer "
                        f"kernels (QuantizerBuilder), which ZeRO++'s quantized communication runs on; set "
                        f"strategy.{wanted[0]}=false here, or run zero3 on GPUs")


def hpz_group(size: int):
    """The process group hpZ splits each secondary partition over: `size` consecutive ranks (one node
    under torchrun's rank order), None without hpZ. DeepSpeed keeps one such group per process (a
    global of deepspeed.utils.groups), made by the first zero.Init that asks for it; a second zero.Init
    asking again fails an assert, and every later ZeRO-3 engine takes the group up, hpZ or not. So it
    is set here for each engine: cleared without hpZ, reused at the same size, made anew otherwise."""
    from deepspeed.utils import groups

    current = groups._get_zero_param_intra_parallel_group()
    if size > 1 and current is not None and torch.distributed.get_world_size(current) == size:
        return current
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    if size == 1:
        return None
    # DeepSpeed's groups._create_zero_param_parallel_group makes the same groups (consecutive ranks) with
    # dist.new_group(ranks) and no timeout, so torch's default would apply: made here with the run's own.
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    for first in range(0, world, size):  # collective: every rank makes every group
        group = new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = group
    return groups._get_zero_param_intra_parallel_group()


def drop_secondary_partitions(module) -> None:
    """hpZ (zero_hpz_partition_size > 1) keeps a second copy of each ZeRO-3 partition, split over the
    ranks of one node, built from the parameter when it was first partitioned; the next forward gathers
    from it. After zerodp wrote the primary partitions (`ds_tensor`) that copy is stale: dropped here for
    every parameter of `module` (DeepSpeed's own invalidate_secondary_tensor drops the optimizer's alone,
    and a LoRA run's frozen base would go on gathering the values of before zerodp wrote them), and
    rebuilt from the new values at the next gather. ZeRO-1/2 keep no copy."""
    for p in module.parameters():
        if getattr(p, "ds_secondary_tensor", None) is not None:
            p.ds_secondary_tensor = None
