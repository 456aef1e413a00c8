"""`Plan`: the planner's answer, what `choose` returns: the chosen row, every row it weighed, and why.
zerodp/planner/choose.py makes it, zerodp/planner/reasons.py words it, zerodp/planner/report.py shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from zerodp.planner.hardware import Cluster
from zerodp.planner.types import Checkpointing, Layout, MemoryEstimate, ModelSpec, Workload
from zerodp.strategies.catalog import spec


@dataclass
class Plan:
    """The planner's answer. `choice` is single|ddp|zero1|zero2|zero3|fsdp, or None if nothing fits."""

    choice: Optional[str]
    offload_optimizer: bool
    offload_params: bool
    activation_checkpointing: Checkpointing
    """off, selective or full: a str, false when off (zerodp.planner.types.Checkpointing)."""
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
    sft: Optional[list[MemoryEstimate]] = None
    """A DPO plan's rows for the same run under train.objective=sft, shown beside them (`zerodp plan
    --objective dpo`); None otherwise."""

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
