"""The strategies zerodp runs, and what each one is: the one list that config validation, the registry
(zerodp/strategies/__init__.py), the planner and the tests read.

Data only, torch-free: the planner and `zerodp plan` read it without importing any engine. A new
strategy is one `StrategySpec` here and one file beside this one; the planner's formulas read the
profile fields below, never a strategy's name.

Layer: beside zerodp.config (config validation reads it); imports nothing of zerodp.
"""

from __future__ import annotations

from dataclasses import dataclass

STATES = ("params", "grads", "optimizer")
"""What a rank can hold a shard of instead of the whole: parameters, gradients, optimizer states (the ZeRO
paper's P, G and OS)."""
LAYOUTS = ("canonical", "deepspeed", "dcp")
STARTUPS = ("fp32_module", "fp32_module_buckets", "16bit_module", "zero_init_partitions", "fp32_shards")
TRAFFIC = ("all_reduce", "reduce_then_gather", "gather_per_use", "gather_per_unit")


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """One strategy: what it shards, what it saves, and the profile the planner's memory and traffic model
    reads (docs/memory_model.md)."""

    name: str
    """strategy.name; also the class's `name`."""
    implementation: str
    """'module:Class' the registry builds (imported only then: `single` and `ddp` never import deepspeed)."""
    init: tuple[tuple[str, object], ...] = ()
    """Keyword arguments of the class's constructor, as (name, value) pairs."""
    zero_stage: int
    """The ZeRO stage its sharding is: 0 none, 1 optimizer states, 2 and gradients, 3 and parameters (fsdp
    is 3)."""
    layout: str
    """What `save` writes, one of LAYOUTS: 'canonical' (full fp32 tensors by name, any topology reads it),
    'deepspeed' or 'dcp'; recorded in meta.json."""
    gathers_in_forward: bool
    """The forward all-gathers sharded parameters (every rank's forward lasts as long as the slowest's)."""
    single_process: bool = False
    """Runs in one process only (no process group)."""

    # The planner's profile: which rows it offers, and which terms of its model apply.
    startup: str
    """One of STARTUPS, what a rank holds at its start-up peak (zerodp.planner.memory.startup_states):
    'fp32_module' (the full fp32 model), 'fp32_module_buckets' (and DDP's fp32 flat buckets), '16bit_module'
    (the model in the compute dtype, flattened through host RAM, and the fp32 master partition),
    'zero_init_partitions' (partitions made as zero.Init creates each module) or 'fp32_shards' (fully_shard
    on the meta model)."""
    traffic: str
    """One of TRAFFIC, what a step sends (zerodp.planner.traffic.collectives): 'all_reduce' (fp32 gradients
    once per step), 'reduce_then_gather' (gradients all-reduced, the updated 16-bit parameters all-gathered
    after the step), 'gather_per_use' (ZeRO-3: all-gathers by persistence threshold and reuse distance,
    reduce-scatters) or 'gather_per_unit' (FSDP2: all-gathers per unit, reduce-scatters fp32 gradients)."""
    preference: int = 0
    """Order among the planner's rows, simplest first (a tie within TIE goes to the lower); 0: not a row of
    its own."""
    on_one_device: str | None = None
    """What the planner's row of this strategy runs as on one GPU (ddp: single)."""
    offload_variants: tuple[tuple[bool, bool], ...] = ()
    """The planner's offload rows, as (offload_optimizer, offload_params)."""
    offload_together: bool = False
    """Offloading moves parameters, gradients and optimizer states together, whichever flag asks (FSDP2's
    CPUOffloadPolicy): one row, '<name>+offload'."""
    hybrid_shard: bool = False
    """Has strategy.hybrid_shard: across nodes it shards within a node and replicates across (HSDP); row
    '<name>+hybrid'."""
    zeropp: bool = False
    """Runs ZeRO++ (hpZ, int8 weights, int4 gradients); across nodes its row '<name>+zero++' runs all three."""
    fp32_params: bool = False
    """The fp32 parameters are the master weights, computed under autocast: fp32 gradients and 8 bytes of
    moments per parameter (each sharded as the stage says). False: DeepSpeed's split, 16-bit parameters and
    gradients and 12 bytes of fp32 master and moments, plus a separate fp32 master copy in fp32 training."""
    bucket_copies: bool = False
    """Keeps reduce and all-gather buckets beside the gradients (DeepSpeed), 2 x strategy.bucket_size_mb."""
    defer_grad_reduce: bool = False
    """Has strategy.fsdp_defer_grad_reduce: with accumulation it keeps the unsharded fp32 gradients (4P)."""
    frees_grads: bool = False
    """Frees its whole gradients after each optimizer step (zero_grad(set_to_none=True), no bucket holds
    them): without accumulation they do not exist while the forward's activations do."""

    def __post_init__(self):
        assert 0 <= self.zero_stage <= 3 and self.layout in LAYOUTS, self
        assert self.startup in STARTUPS and self.traffic in TRAFFIC, self

    @property
    def shards(self) -> tuple[str, ...]:
        """The states of STATES this strategy shards over the ranks (the rest every rank holds whole)."""
        return STATES[3 - self.zero_stage:]

    @property
    def hybrid_row(self) -> str | None:
        """The name of the planner's row across nodes: '<name>+hybrid' (HSDP), '<name>+zero++', or None."""
        if self.hybrid_shard:
            return f"{self.name}+hybrid"
        return f"{self.name}+zero++" if self.zeropp else None


CATALOG: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec(name="single", implementation="zerodp.strategies.single:SingleStrategy", zero_stage=0,
                 layout="canonical", gathers_in_forward=False, single_process=True, fp32_params=True, frees_grads=True,
                 startup="fp32_module", traffic="all_reduce"),
    StrategySpec(name="ddp", implementation="zerodp.strategies.ddp:DDPStrategy", zero_stage=0,
                 layout="canonical", gathers_in_forward=False, preference=1, on_one_device="single",
                 fp32_params=True, startup="fp32_module_buckets", traffic="all_reduce"),
    StrategySpec(name="zero1", implementation="zerodp.strategies.zero:ZeroStrategy", zero_stage=1,
                 layout="deepspeed", gathers_in_forward=False, init=(("stage", 1),), preference=2,
                 bucket_copies=True, startup="16bit_module", traffic="reduce_then_gather"),
    StrategySpec(name="zero2", implementation="zerodp.strategies.zero:ZeroStrategy", zero_stage=2,
                 layout="deepspeed", gathers_in_forward=False, init=(("stage", 2),), preference=3,
                 offload_variants=((True, False),), bucket_copies=True, startup="16bit_module",
                 traffic="reduce_then_gather"),
    # after fsdp among the planner's rows: the same memory (without accumulation), and fsdp is torch-native
    StrategySpec(name="zero3", implementation="zerodp.strategies.zero:ZeroStrategy", zero_stage=3,
                 layout="deepspeed", gathers_in_forward=True, init=(("stage", 3),), preference=5,
                 offload_variants=((True, False), (True, True)), zeropp=True, bucket_copies=True,
                 startup="zero_init_partitions", traffic="gather_per_use"),
    StrategySpec(name="fsdp", implementation="zerodp.strategies.fsdp:FSDPStrategy", zero_stage=3,
                 layout="dcp", gathers_in_forward=True, preference=4, offload_variants=((True, True),),
                 offload_together=True, hybrid_shard=True, fp32_params=True, defer_grad_reduce=True,
                 startup="fp32_shards", traffic="gather_per_unit"),
)}
"""Every strategy by name, in the order messages list them."""


def spec(name: str) -> StrategySpec:
    """The catalog's entry for strategy `name` (resolved: not auto); ValueError for another name."""
    if name not in CATALOG:
        raise ValueError(f"unknown strategy {name!r}")
    return CATALOG[name]


def planned() -> list[StrategySpec]:
    """The strategies the planner makes rows of, in its order of preference (simplest first)."""
    return sorted((s for s in CATALOG.values() if s.preference), key=lambda s: s.preference)
