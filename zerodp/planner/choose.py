"""`choose(...) -> Plan`: which strategy to run, and why not the others.

Preference, among the strategies that fit with MARGIN of memory to spare: no offload before
offload (a CPU optimizer step is seconds), then no activation checkpointing before checkpointing
when the user left it to the planner (+33% compute), then the order of least communication:
ddp < zero1 < zero2 < fsdp < zero3 < offload variants. Step times are predicted for every row,
so the table shows what each choice costs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from zerodp.planner.hardware import Cluster
from zerodp.planner.memory import MARGIN, Layout, MemoryEstimate, Workload, activation_bytes, estimate
from zerodp.planner.models import ModelSpec
from zerodp.planner.units import gb, seconds

# (strategy, offload_optimizer, offload_params), in order of preference.
VARIANTS = (
    ("ddp", False, False),
    ("zero1", False, False),
    ("zero2", False, False),
    ("fsdp", False, False),   # before zero3: same memory (without accumulation), torch-native
    ("zero3", False, False),
    ("zero2", True, False),
    ("zero3", True, False),
    ("fsdp", True, True),
    ("zero3", True, True),
)


@dataclass
class Plan:
    """The planner's answer. `choice` is single|ddp|zero1|zero2|zero3|fsdp, or None if nothing fits."""

    choice: Optional[str]
    offload_optimizer: bool
    offload_params: bool
    activation_checkpointing: bool
    estimates: list[MemoryEstimate]
    reasons: list[str]
    model: ModelSpec
    cluster: Cluster
    workload: Workload
    requested_checkpointing: Optional[bool] = None
    suggestion: Optional[str] = None
    assumptions: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> Optional[MemoryEstimate]:
        """The chosen row of `estimates`, or None."""
        return next((e for e in self.estimates if self.choice and e.name == self.choice_name), None)

    @property
    def choice_name(self) -> Optional[str]:
        """The chosen row's name, e.g. 'zero3+offload_optimizer'; 'single' stays 'single'."""
        if self.choice is None:
            return None
        return Layout(self.choice, self.cluster, self.workload, self.offload_optimizer, self.offload_params).name

    def table(self) -> str:
        from zerodp.planner.report import render_table
        return render_table(self)

    def to_dict(self) -> dict:
        from zerodp.planner.report import plan_dict
        return plan_dict(self)


def _layouts(cluster: Cluster, workload: Workload) -> list[Layout]:
    """The rows of the table, in order of preference; on one GPU 'ddp' is plain 'single'."""
    out = []
    for strategy, oo, op in VARIANTS:
        if oo and not cluster.gpu.cuda:
            continue  # a CPU device has no faster memory to offload to
        if strategy == "ddp" and cluster.world_size == 1:
            strategy = "single"
        out.append(Layout(strategy, cluster, workload, oo, op))
    return out


def _rank(r: MemoryEstimate, requested: Optional[bool]) -> tuple[bool, bool]:
    """Sort key before the preference order: offloading last, then planner-chosen checkpointing."""
    return (r.offload_optimizer or r.offload_params, r.activation_checkpointing and requested is None)


def _row(model: ModelSpec, base: Layout, requested: Optional[bool]) -> MemoryEstimate:
    """The estimate for one variant: checkpointing as requested, or off unless only on fits."""
    if requested is not None:
        return estimate(model, dataclasses.replace(base, activation_checkpointing=requested))
    off = estimate(model, base)
    if off.fits or (off.total_bytes <= off.usable_bytes and off.cpu_fits is not False):
        return off  # fits, or only its start-up peak does not: checkpointing shrinks activations alone
    return estimate(model, dataclasses.replace(base, activation_checkpointing=True))


def choose(model: ModelSpec, cluster: Cluster, workload: Workload,
           activation_checkpointing: Optional[bool] = None) -> Plan:
    """Estimate every strategy for `model` on `cluster` and pick one. `activation_checkpointing`
    None lets the planner turn it on where that is what makes a strategy fit."""
    rows = [_row(model, layout, activation_checkpointing) for layout in _layouts(cluster, workload)]
    ranked = sorted((_rank(r, activation_checkpointing), i) for i, r in enumerate(rows) if r.fits)
    chosen = rows[ranked[0][1]] if ranked else None
    plan = Plan(
        choice=chosen.strategy if chosen else None,
        offload_optimizer=bool(chosen and chosen.offload_optimizer),
        offload_params=bool(chosen and chosen.offload_params),
        activation_checkpointing=bool(chosen.activation_checkpointing if chosen else activation_checkpointing),
        estimates=rows, reasons=[], model=model, cluster=cluster, workload=workload,
        requested_checkpointing=activation_checkpointing,
    )
    plan.reasons = _reasons(plan, chosen)
    if chosen is None:
        plan.suggestion = _suggest(model, cluster, workload, activation_checkpointing)
        plan.reasons.append(plan.suggestion)
    return plan


def _where(c: Cluster) -> str:
    nodes = f"{c.nodes} nodes x {c.gpus_per_node}" if c.nodes > 1 else f"{c.gpus_per_node}"
    return f"{nodes} x {gb(c.gpu.hbm_bytes)} {c.gpu.name}"


def _reasons(plan: Plan, chosen: Optional[MemoryEstimate]) -> list[str]:
    """One sentence for the choice, one on checkpointing, one per rejected row."""
    out = []
    if chosen:
        ckpt = "on" if chosen.activation_checkpointing else "off"
        out.append(f"Choice: {chosen.name} with activation checkpointing {ckpt}: {gb(chosen.total_bytes)} of "
                   f"{gb(chosen.hbm_bytes)} per GPU, predicted {seconds(chosen.step_s)} per step at "
                   f"{chosen.scaling_efficiency:.0%} scaling efficiency.")
        if chosen.offloaded_bytes:
            checked = "" if plan.cluster.cpu_ram_bytes else " (not checked: pass --cpu-ram)"
            out.append(f"Offloading keeps {gb(chosen.cpu_bytes_per_node)} per node in CPU RAM{checked}; "
                       + _suggest(plan.model, plan.cluster, plan.workload, plan.requested_checkpointing,
                                  without_offload=True))
        if plan.requested_checkpointing is None:
            if chosen.activation_checkpointing:
                without = activation_bytes(plan.model, plan.workload, False)
                out.append(f"Activation checkpointing turned on: without it activations need {gb(without)} per GPU "
                           "and it does not fit; recomputing the forward adds ~33% compute, included in the step time.")
            else:
                out.append("Activation checkpointing left off: it fits without it, and it would add ~33% compute.")
    else:
        out.append(f"Nothing fits on {_where(plan.cluster)} ({MARGIN:.0%} of memory kept free).")
    for r in plan.estimates:
        if chosen is None or r.name != chosen.name:
            out.append(f"{r.name}: {_why_not(r, chosen, plan.cluster)}")
    return out


def _startup_device(r: MemoryEstimate) -> str:
    """What the row holds on the GPU at its start-up peak (memory.startup_states), in words."""
    master = "" if r.offload_optimizer else " and the fp32 master partition"
    z3 = "a reduce bucket" if r.offload_optimizer else "the fp32 master and gradient partitions, a reduce bucket"
    return {
        "single": "fp32 parameters, 4P",
        "ddp": "fp32 parameters and DDP's gradient buckets, 8P",
        "zero1": f"the 16-bit module{master}",
        "zero2": f"the 16-bit module{master}",
        "zero3": f"the partitions, {z3}, one module created in fp32",
        "fsdp": "fp32 shards, 4P/N",
    }[r.strategy]


def _startup_host(r: MemoryEstimate, cluster: Cluster) -> str:
    if not cluster.gpu.cuda:
        return "every rank's start-up peak, the device being host memory"
    parts = ["one fp32 checkpoint tensor being loaded per rank"]
    if r.strategy in ("zero1", "zero2"):
        parts.append("DeepSpeed staging each rank's 16-bit module to flatten it")
    if r.offload_optimizer or r.offload_params:
        parts.append("the states offloaded from the start")
    return ", ".join(parts)


def _why_not(r: MemoryEstimate, chosen: Optional[MemoryEstimate], cluster: Cluster) -> str:
    if r.cpu_fits is False:
        return (f"needs {gb(r.cpu_bytes_per_node)} of CPU RAM per node for offloaded states, "
                f"more than --cpu-ram allows.")
    if r.total_bytes > r.usable_bytes:
        big = max((r.model_states_bytes, "model states"), (r.activations_bytes, "activations"),
                  (r.gathered_bytes, "gathered layers"),
                  (r.unsharded_grads_bytes, "unsharded gradients kept while accumulating"))
        return (f"does not fit: needs {gb(r.total_bytes)} per GPU ({big[1]} {gb(big[0])}), "
                f"over the {gb(r.usable_bytes)} usable.")
    if r.startup_bytes > r.usable_bytes:
        return (f"does not fit at start-up: start-up peak {gb(r.startup_bytes)} per GPU "
                f"({_startup_device(r)}) > {gb(r.usable_bytes)} usable, though training "
                f"would then need {gb(r.total_bytes)}.")
    if r.startup_host_fits is False:
        return (f"does not fit at start-up in host RAM: start-up peak {gb(r.startup_host_bytes_per_node)} of "
                f"host RAM per node ({_startup_host(r, cluster)}) > {gb(cluster.cpu_ram_bytes)} per node.")
    fits = f"fits ({gb(r.total_bytes)})"
    slower = f"{seconds(r.step_s)} per step vs {seconds(chosen.step_s)}"
    if (r.offload_optimizer or r.offload_params) and not (chosen.offload_optimizer or chosen.offload_params):
        return f"{fits}, but the CPU optimizer step and PCIe copies of offloading make it slow: {slower}."
    if r.activation_checkpointing and not chosen.activation_checkpointing:
        return f"{fits} only with activation checkpointing, which recomputes the forward (+33% compute): {slower}."
    if r.comm_bytes > chosen.comm_bytes:
        speed = (f"predicted {seconds(r.step_s)} per step vs {seconds(chosen.step_s)} if its extra traffic hides "
                 f"fully behind compute" if r.step_s <= chosen.step_s else slower)
        return (f"{fits}, but {chosen.name} comes first: it sends {gb(chosen.comm_bytes)} per GPU per step "
                f"instead of {gb(r.comm_bytes)} ({speed}).")
    if r.strategy != chosen.strategy and r.comm_bytes == chosen.comm_bytes:
        return (f"{fits}, but {chosen.name} comes first: same communication, fewer states sharded "
                f"or offloaded, and its memory suffices.")
    return f"{fits}, but {chosen.name} comes first in the order: it shards or offloads less."


def _sharded(workload: Workload) -> str:
    """The strategy whose memory shrinks most with more GPUs: fsdp, or zero3 when fsdp defers its
    gradient reduction while accumulating (it then keeps a 4P of unsharded gradients that no number of
    GPUs divides)."""
    return "zero3" if workload.fsdp_defer_grad_reduce and workload.grad_accum_steps > 1 else "fsdp"


def _min_gpus(model: ModelSpec, cluster: Cluster, workload: Workload, ac: bool) -> Optional[Cluster]:
    """The smallest cluster with more GPUs on which `_sharded(workload)` fits: up to a full node
    (8 GPUs unless --gpus says more) on one machine, then whole nodes. None when no size does."""
    node = max(cluster.gpus_per_node, 8) if cluster.nodes == 1 else cluster.gpus_per_node

    def at(n_nodes: int, per_node: int) -> Cluster:
        return dataclasses.replace(cluster, gpus_per_node=per_node, nodes=n_nodes)

    def fits(c: Cluster) -> bool:
        return estimate(model, Layout(_sharded(workload), c, workload, activation_checkpointing=ac)).fits

    for n in range(cluster.world_size + 1, node + 1):  # grow inside one node first
        if fits(at(1, n)):
            return at(1, n)
    lo, hi = max(1, cluster.world_size // node), max(2, cluster.world_size // node * 2)
    if not fits(at(1 << 14, node)):  # memory only shrinks as shards get smaller: the limit decides
        return None
    while not fits(at(hi, node)):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # bisect on the number of nodes
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(at(mid, node)) else (mid, hi)
    return at(hi, node)


def _gpus(c: Cluster) -> str:
    return f"{c.world_size} GPUs" + (f" ({c.nodes} nodes of {c.gpus_per_node})" if c.nodes > 1 else "")


def _suggest(model: ModelSpec, cluster: Cluster, workload: Workload, requested: Optional[bool],
             without_offload: bool = False) -> str:
    """What would fit: checkpointing, more GPUs (for fsdp or zero3), or a smaller micro batch."""
    ac, sharded = requested is not False, _sharded(workload)
    ckpt = " with activation checkpointing on" if ac and requested is None else ""
    if without_offload:
        c = _min_gpus(model, cluster, workload, ac)
        return (f"without offloading, {sharded} fits on {_gpus(c)}{ckpt}." if c else
                "without offloading, no number of GPUs fits this micro batch and sequence length.")
    if requested is False:
        for layout in _layouts(cluster, workload):
            r = estimate(model, dataclasses.replace(layout, activation_checkpointing=True))
            if r.fits:
                return (f"It would fit with activation checkpointing on ({r.name}, {gb(r.total_bytes)} per GPU): "
                        f"pass --activation-checkpointing on or set model.activation_checkpointing=true.")
    c = _min_gpus(model, cluster, workload, ac)
    if c:
        return f"Smallest that fits: {_gpus(c)} with {sharded}{ckpt.replace(' with', ' and')}."
    if requested is False and (c := _min_gpus(model, cluster, workload, True)):
        return (f"No number of GPUs fits without activation checkpointing; with it on "
                f"(--activation-checkpointing on), {sharded} fits on {_gpus(c)}.")
    huge = estimate(model, Layout(sharded, dataclasses.replace(cluster, nodes=1 << 14), workload,
                                  activation_checkpointing=ac))
    if huge.startup_host_fits is False:  # what no number of GPUs divides: one checkpoint tensor per rank
        return (f"No number of GPUs helps: at start-up each node needs {gb(huge.startup_host_bytes_per_node)} "
                f"of host RAM (loading a checkpoint reads one full fp32 tensor per rank), more than "
                f"{gb(cluster.cpu_ram_bytes)}; give the node more RAM (--cpu-ram) or fewer ranks per node.")
    return ("No number of GPUs helps: activations and gathered layers alone exceed the memory; "
            "reduce --micro-batch or --seq-len.")
