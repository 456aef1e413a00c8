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
from dataclasses import dataclass, field
from typing import Optional

from zerodp.errors import UserError
from zerodp.planner.activations import Checkpointing
from zerodp.planner.hardware import Cluster
from zerodp.planner.memory import Layout, MemoryEstimate, Workload
from zerodp.planner.models import ModelSpec
from zerodp.planner.reasons import reasons, suggest
from zerodp.planner.rows import TIE, divisors, layouts as all_layouts, pick, row, search
from zerodp.strategies.catalog import spec

__all__ = ["Plan", "TIE", "check_global_batch", "choose", "pick"]


@dataclass
class Plan:
    """The planner's answer. `choice` is single|ddp|zero1|zero2|zero3|fsdp, or None if nothing fits."""

    choice: Optional[str]
    offload_optimizer: bool
    offload_params: bool
    activation_checkpointing: Checkpointing
    """off, selective or full: a str, false when off (zerodp.planner.activations.Checkpointing)."""
    estimates: list[MemoryEstimate]
    reasons: list[str]
    model: ModelSpec
    cluster: Cluster
    workload: Workload
    requested_checkpointing: Optional[Checkpointing] = None
    suggestion: Optional[str] = None
    assumptions: list[str] = field(default_factory=list)
    hybrid: bool = False
    """The choice is fsdp+hybrid (strategy.hybrid_shard) or zero3+zero++."""
    global_batch: Optional[int] = None
    """Sequences per optimizer step when the micro batch was searched; None: the workload's micro batch."""
    search: dict[str, list[MemoryEstimate]] = field(default_factory=dict)
    """Per row name, every (micro batch, checkpointing) tried when searching."""
    exact_only: bool = False
    """Rows that change the numerics (zero3+zero++) were not eligible (strategy: auto)."""
    async_save: bool = False
    """checkpoint.async_save (or --async-save): the table shows each row's snapshot host memory per node."""
    full_fine_tuning: Optional[list[MemoryEstimate]] = None
    """A LoRA plan's rows for the same model fully fine-tuned, shown beside them (`zerodp plan`); None
    otherwise."""

    def snapshot_bytes_per_node(self, e: MemoryEstimate) -> int:
        """Host memory per node of one copy of each rank's checkpoint (checkpoint.async_save) for row `e`: a
        LoRA checkpoint holds the adapters and their optimizer state only."""
        from zerodp.planner.snapshot import host_bytes_per_node

        c = self.cluster
        return host_bytes_per_node(self.model.trainable_params, e.strategy, c.world_size, c.gpus_per_node,
                                   self.workload.precision, hybrid=e.name == spec(e.strategy).hybrid_row)

    @property
    def chosen(self) -> Optional[MemoryEstimate]:
        """The chosen row of `estimates`, or None."""
        return next((e for e in self.estimates if self.choice and e.name == self.choice_name), None)

    @property
    def choice_name(self) -> Optional[str]:
        """The chosen row's name, e.g. 'zero3+offload_optimizer', 'fsdp+hybrid'; 'single' stays 'single'."""
        if self.choice is None:
            return None
        return Layout(self.choice, self.cluster, self.workload, self.offload_optimizer, self.offload_params,
                      hybrid=self.hybrid).name

    @property
    def micro_batch(self) -> Optional[int]:
        """The chosen row's micro batch (searched or given), or None when nothing fits."""
        return self.chosen.micro_batch if self.chosen else None

    def table(self) -> str:
        from zerodp.planner.report import render_table
        return render_table(self)

    def to_dict(self) -> dict:
        from zerodp.planner.report import plan_dict
        return plan_dict(self)


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


