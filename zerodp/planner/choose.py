"""`choose(...) -> Plan`: which strategy to run, and why not the others.

The choice is the fastest predicted step among the rows that fit with MARGIN of memory to spare; within
TIE of the fastest the simpler row wins, in the order ddp (single on one GPU) < zero1 < zero2 < fsdp <
zero3 < fsdp+hybrid < zero3+zero++ (the last two on several nodes only) < the offload rows, whose CPU
optimizer step and PCIe copies are part of their predicted step. With a global batch the micro batch (a divisor
of the global batch per rank) and activation checkpointing are searched for every row, each row showing
its highest predicted tokens/s, accumulation following from the global batch as in `zerodp train`.
zerodp/planner/rows.py makes the rows and picks; zerodp/planner/reasons.py says why.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from zerodp.errors import UserError
from zerodp.planner.hardware import Cluster
from zerodp.planner.plan import Plan
from zerodp.planner.reasons import reasons, suggest
from zerodp.planner.rows import TIE, divisors, layouts as all_layouts, pick, row, search
from zerodp.planner.types import Checkpointing, Layout, MemoryEstimate, ModelSpec, Workload
from zerodp.strategies.catalog import spec

__all__ = ["Plan", "TIE", "check_global_batch", "choose", "pick"]


def check_global_batch(global_batch: int, world_size: int, flag: str = "--global-batch") -> None:
    """A global batch every rank can take an equal whole number of sequences of; else a UserError naming
    `flag` (the option or config key that set it)."""
    given = f"{flag}={global_batch}" if flag.startswith("train.") else f"{flag} {global_batch}"
    if global_batch < 1:
        raise UserError(f"{given} must be at least 1 sequence, e.g. {flag} 512")
    if global_batch % world_size:
        near = (global_batch // world_size + 1) * world_size
        ok = sorted(sorted(divisors(global_batch), key=lambda d: abs(d - world_size))[:4])
        raise UserError(f"{given} does not split over {world_size} GPUs: no micro batch divides "
                        f"{global_batch / world_size:g} sequences per GPU; use a multiple of {world_size} such "
                        f"as {near}, or a GPU count that divides it ({', '.join(map(str, ok))})")


def choose(model: ModelSpec, cluster: Cluster, workload: Workload,
           activation_checkpointing: Optional[bool | str] = None, *, global_batch: Optional[int] = None,
           exact_only: bool = False, layouts: Optional[list[Layout]] = None) -> Plan:
    """Estimate every strategy for `model` on `cluster` and pick one. `activation_checkpointing`
    (off, selective, full; true and false are full and off) None lets the planner turn it on where that is
    what makes a strategy fit, the least recomputing mode that does (or, with `global_batch`, where it is
    faster: a larger micro batch). `global_batch` (sequences per optimizer step) searches
    the micro batch for each row instead of taking the workload's; `exact_only` leaves out rows whose
    quantised collectives change the numerics (what `strategy: auto` may run). `layouts` replaces the
    rows (a training config's own strategy, to search its micro batch)."""
    estimates: list[MemoryEstimate] = []
    searched: dict[str, list[MemoryEstimate]] = {}
    if global_batch is not None:
        check_global_batch(global_batch, cluster.world_size)
    if activation_checkpointing is not None:
        activation_checkpointing = Checkpointing(activation_checkpointing)
    for layout in layouts or all_layouts(cluster, workload):
        if global_batch is None:
            estimates.append(row(model, layout, activation_checkpointing))
        else:
            top, tried = search(model, layout, activation_checkpointing, global_batch)
            estimates.append(top)
            searched[top.name] = tried
    chosen = pick(estimates, exact_only)
    plan = Plan(
        choice=chosen.strategy if chosen else None,
        offload_optimizer=bool(chosen and chosen.offload_optimizer),
        offload_params=bool(chosen and chosen.offload_params),
        activation_checkpointing=chosen.activation_checkpointing if chosen else Checkpointing(
            activation_checkpointing or "off"),
        estimates=estimates, reasons=[], model=model, cluster=cluster, workload=workload,
        requested_checkpointing=activation_checkpointing,
        hybrid=bool(chosen and chosen.name == spec(chosen.strategy).hybrid_row),
        global_batch=global_batch, search=searched, exact_only=exact_only,
    )
    plan.reasons = reasons(plan, chosen)
    if chosen is None:
        small = workload if global_batch is None else dataclasses.replace(
            workload, micro_batch=1, grad_accum_steps=global_batch // cluster.world_size)
        plan.suggestion = suggest(model, cluster, small, activation_checkpointing)
        plan.reasons.append(plan.suggestion)
    return plan


