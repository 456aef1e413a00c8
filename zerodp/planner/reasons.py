"""What the plan says: one sentence for the choice, one on its micro batch or checkpointing, one per other
row (why it does not fit, or its predicted step against the choice's), and what would fit when nothing
does."""

from __future__ import annotations

import dataclasses
from typing import Optional

from zerodp.planner.activations import SELECTIVE_RECOMPUTE
from zerodp.planner.hardware import Cluster
from zerodp.planner.memory import MARGIN, estimate
from zerodp.planner.plan import Plan
from zerodp.planner.rows import CLOSE, TIE, best, layouts, offloads
from zerodp.planner.types import Checkpointing, Layout, MemoryEstimate, ModelSpec, Workload
from zerodp.planner.units import gb, seconds
from zerodp.strategies.catalog import planned, spec


def _where(c: Cluster) -> str:
    nodes = f"{c.nodes} nodes x {c.gpus_per_node}" if c.nodes > 1 else f"{c.gpus_per_node}"
    return f"{nodes} x {gb(c.gpu.hbm_bytes)} {c.gpu.name}"


def _per_s(r: MemoryEstimate, device: str) -> str:
    return f"{r.tokens_per_s_per_gpu:,.0f} tokens/s per {device}"


def reasons(plan: Plan, chosen: Optional[MemoryEstimate]) -> list[str]:
    """One sentence for the choice, one on the micro batch or checkpointing, one per other row."""
    out: list[str] = []
    device = plan.cluster.device
    if chosen:
        ckpt = chosen.activation_checkpointing
        micro = (f", micro batch {chosen.micro_batch} x {chosen.grad_accum_steps} accumulation"
                 if plan.global_batch else "")
        why = ("the fastest predicted step that fits" + (" (its CPU optimizer step and PCIe copies included)"
                                                          if offloads(chosen) else "")
               + (f" (simplest within {TIE:.0%})" if _ties(plan, chosen) else ""))
        out.append(f"Choice: {chosen.name} with activation checkpointing {ckpt}{micro}: {gb(chosen.total_bytes)} "
                   f"of {gb(chosen.hbm_bytes)} per {device}, predicted {seconds(chosen.step_s)} per step "
                   f"({_per_s(chosen, device)}) at {chosen.scaling_efficiency:.0%} scaling efficiency: {why}.")
        if chosen.offloaded_bytes:
            checked = "" if plan.cluster.cpu_ram_bytes else " (not checked: pass --cpu-ram)"
            out.append(f"Offloading keeps {gb(chosen.cpu_bytes_per_node)} per node in CPU RAM{checked}; "
                       + suggest(plan.model, plan.cluster, plan.workload, plan.requested_checkpointing,
                                  without_offload=True))
        if plan.global_batch:
            out.append(_micro_sentence(plan, chosen))
        elif plan.requested_checkpointing is None:
            out.append(_mode_sentence(plan, chosen))
    else:
        out.append(f"Nothing fits on {_where(plan.cluster)} ({MARGIN:.0%} of memory kept free).")
    for r in plan.estimates:
        if chosen is None or r.name != chosen.name:
            out.append(f"{r.name}: {_why_not(r, chosen, plan)}")
    return out


COST = {"selective": f"recomputing the element-wise work adds ~{SELECTIVE_RECOMPUTE / 3:.0%} compute",
        "full": "recomputing the forward adds ~33% compute"}
"""What each checkpointing mode costs, in words (zerodp.planner.activations.compute_factor)."""


def _mode_sentence(plan: Plan, chosen: MemoryEstimate) -> str:
    """Why the chosen row checkpoints as it does, when the planner decided (no global batch)."""
    mode, device = chosen.activation_checkpointing, plan.cluster.device
    if not mode:
        return (f"Activation checkpointing left off: it fits without it, and selective would add "
                f"~{SELECTIVE_RECOMPUTE / 3:.0%} compute, full ~33%.")
    less = [estimate(plan.model, Layout(chosen.strategy, plan.cluster, plan.workload, chosen.offload_optimizer,
                                        chosen.offload_params, m, hybrid=plan.hybrid))
            for m in ("off", "selective")[:mode.rank]]
    why = "; ".join(f"{r.activation_checkpointing}, it needs {gb(r.total_bytes)} per {device}" for r in less)
    return (f"Activation checkpointing {mode}: the least recomputation that fits ({why}, over the "
            f"{gb(chosen.usable_bytes)} usable); {COST[mode]}, included in the step time.")


def _ties(plan: Plan, chosen: MemoryEstimate) -> bool:
    """Whether a row after the choice is predicted faster (within TIE)."""
    return any(r.fits and r.tokens_per_s_per_gpu > chosen.tokens_per_s_per_gpu
               and (r.exact or not plan.exact_only) for r in plan.estimates)


def _micro_sentence(plan: Plan, chosen: MemoryEstimate) -> str:
    """Why this micro batch and checkpointing setting, from the search of the chosen row."""
    tried = plan.search.get(chosen.name, [])
    ac, device = chosen.activation_checkpointing, plan.cluster.device
    fit = sorted({e.micro_batch for e in tried if e.fits and e.activation_checkpointing == ac})
    listed = ", ".join(map(str, fit)) if len(fit) <= 6 else f"{len(fit)} of them, {fit[0]} to {fit[-1]}"
    head = (f"Micro batch {chosen.micro_batch} of the divisors of {plan.global_batch // plan.cluster.world_size} "
            f"sequences per {device} (global batch {plan.global_batch}): ")
    same = [e for e in tried if e.fits and e.activation_checkpointing == chosen.activation_checkpointing]
    if len(fit) > 1 and max(e.tokens_per_s_per_gpu for e in same) < chosen.tokens_per_s_per_gpu * (1 + CLOSE) \
            and min(e.tokens_per_s_per_gpu for e in same) * (1 + CLOSE) >= chosen.tokens_per_s_per_gpu:
        head += f"those that fit ({listed}) predict the same tokens/s, and the largest is taken"
    else:
        head += f"the highest predicted tokens/s among those that fit ({listed})"
    other = [e for e in tried if e.fits and e.activation_checkpointing != chosen.activation_checkpointing]
    mode = chosen.activation_checkpointing
    if plan.requested_checkpointing is not None:
        tail = f"; checkpointing {mode}, as requested"
    else:
        tail = f"; checkpointing {mode}" + "".join(
            f"; {m}: " + (f"micro batch {best(rows).micro_batch} at most, {_per_s(best(rows), device)}" if rows
                          else "no micro batch fits")
            for m in ("off", "selective", "full") if m != mode
            for rows in [[e for e in other if e.activation_checkpointing == m]])
    return head + tail + "."


def _startup_device(r: MemoryEstimate) -> str:
    """What the row holds on the GPU at its start-up peak (memory.startup_states), in words."""
    master = "" if r.offload_optimizer else " and the fp32 master partition"
    z3 = "a reduce bucket" if r.offload_optimizer else "the fp32 master and gradient partitions, a reduce bucket"
    return {
        "fp32_module": "fp32 parameters, 4P",
        "fp32_module_buckets": "fp32 parameters and DDP's gradient buckets, 8P",
        "16bit_module": f"the 16-bit module{master}",
        "zero_init_partitions": f"the partitions, {z3}, one module created in fp32",
        "fp32_shards": "fp32 shards, 4P/N",
    }[spec(r.strategy).startup]


def _startup_host(r: MemoryEstimate, cluster: Cluster) -> str:
    if not cluster.gpu.cuda:
        return "every rank's start-up peak, the device being host memory"
    parts = ["one fp32 checkpoint tensor being loaded per rank"]
    if spec(r.strategy).startup == "16bit_module":
        parts.append("DeepSpeed staging each rank's 16-bit module to flatten it")
    if r.offload_optimizer or r.offload_params:
        parts.append("the states offloaded from the start")
    return ", ".join(parts)


def _slower_because(r: MemoryEstimate, chosen: MemoryEstimate, device: str) -> str:
    """The term of the step-time model that makes `r` slower than the choice."""
    causes = []
    if r.compute_s > chosen.compute_s * 1.001:
        mode = r.activation_checkpointing
        causes.append(f"activation checkpointing {mode} ({COST[mode]})"
                      if mode.rank > chosen.activation_checkpointing.rank
                      else f"{seconds(r.compute_s)} of compute vs {seconds(chosen.compute_s)}")
    if r.exposed_comm_s > chosen.exposed_comm_s:
        inter = f", {gb(r.inter_node_bytes)} of it across nodes per node" if r.inter_node_bytes else ""
        causes.append(f"{seconds(r.exposed_comm_s)} of communication is not hidden behind compute "
                      f"(vs {seconds(chosen.exposed_comm_s)}; it sends {gb(r.comm_bytes)} per {device} per "
                      f"step{inter})")
    if r.offload_s > chosen.offload_s:
        causes.append(f"{seconds(r.offload_s)} of CPU optimizer step and PCIe copies for offloaded states "
                      f"(vs {seconds(chosen.offload_s)})")
    return "; ".join(causes) or "its predicted step is longer"


def _why_not(r: MemoryEstimate, chosen: Optional[MemoryEstimate], plan: Plan) -> str:
    cluster, device = plan.cluster, plan.cluster.device
    if r.cpu_fits is False:
        return (f"needs {gb(r.cpu_bytes_per_node)} of CPU RAM per node for offloaded states, "
                f"more than --cpu-ram allows.")
    if r.total_bytes > r.usable_bytes:
        big = max((r.model_states_bytes, "model states"), (r.activations_bytes, "activations"),
                  (r.gathered_bytes, "gathered layers"),
                  (r.unsharded_grads_bytes, "unsharded gradients kept while accumulating"))
        smallest = " even at micro batch 1" if plan.global_batch else ""
        return (f"does not fit{smallest}: needs {gb(r.total_bytes)} per {device} ({big[1]} {gb(big[0])}), "
                f"over the {gb(r.usable_bytes)} usable.")
    if r.startup_bytes > r.usable_bytes:
        return (f"does not fit at start-up: start-up peak {gb(r.startup_bytes)} per {device} "
                f"({_startup_device(r)}) > {gb(r.usable_bytes)} usable, though training "
                f"would then need {gb(r.total_bytes)}.")
    if r.startup_host_fits is False:
        return (f"does not fit at start-up in host RAM: start-up peak {gb(r.startup_host_bytes_per_node)} of "
                f"host RAM per node ({_startup_host(r, cluster)}) > {gb(cluster.cpu_ram_bytes)} per node.")
    fits = f"fits ({gb(r.total_bytes)}" + (f", micro batch {r.micro_batch}" if plan.global_batch else "") + ")"
    if not r.exact and plan.exact_only:
        return (f"{fits}, predicted {seconds(r.step_s)} per step, but its int8 weight all-gather and int4 "
                "gradient reduction change the numerics, so strategy: auto does not choose it; set "
                "strategy.name=zero3 with strategy.hpz_partition_size, quantized_weights and "
                "quantized_gradients to run it.")
    if chosen is None:
        return f"{fits}."
    speed = f"predicted {seconds(r.step_s)} per step vs {seconds(chosen.step_s)} for {chosen.name}"
    ratio = chosen.tokens_per_s_per_gpu / r.tokens_per_s_per_gpu
    if ratio > 1 + TIE:
        how = f"{ratio - 1:.0%} slower" if ratio < 2 else f"{ratio:.1f}x as long"
        return f"{fits}, but slower: {speed}, {how}: {_slower_because(r, chosen, device)}."
    if ratio < 1:
        return (f"{fits}, {speed}: {1 / ratio - 1:.1%} faster, within {TIE:.0%}, so the simpler {chosen.name} "
                f"is kept ({_order(plan)}).")
    return f"{fits}, {speed}: within {TIE:.0%}, and {chosen.name} is simpler ({_order(plan)})."


def _order(plan: Plan) -> str:
    """The rows a tie can go to, simplest first, as this plan has them: 'single < zero1 < ... < zero3' on one
    GPU, 'ddp < ... < zero3+zero++' on several nodes, the offload rows last (see `pick`)."""
    return " < ".join(r.name for r in plan.estimates)


def _sharded(workload: Workload) -> str:
    """The strategy whose memory shrinks most with more GPUs: the first of the planner's order that shards
    every state (fsdp), passing over one that defers its gradient reduction while accumulating (it then
    keeps a 4P of unsharded gradients that no number of GPUs divides: zero3)."""
    deferring = workload.fsdp_defer_grad_reduce and workload.grad_accum_steps > 1
    return next(s.name for s in planned() if s.zero_stage == 3 and not (deferring and s.defer_grad_reduce))


def _min_gpus(model: ModelSpec, cluster: Cluster, workload: Workload, ac: bool | str) -> Optional[Cluster]:
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
    return f"{c.world_size} {c.device}s" + (f" ({c.nodes} nodes of {c.gpus_per_node})" if c.nodes > 1 else "")


def suggest(model: ModelSpec, cluster: Cluster, workload: Workload, requested: Optional[bool | str],
             without_offload: bool = False) -> str:
    """What would fit: checkpointing, more GPUs (for fsdp or zero3), or a smaller micro batch. `requested`:
    the checkpointing mode asked for, None when the planner decides (then full: what fits best)."""
    forced_off = requested is not None and not Checkpointing(requested)
    ac = Checkpointing("full" if requested is None else requested)
    sharded, device = _sharded(workload), cluster.device
    ckpt = " with activation checkpointing full" if requested is None else ""
    if without_offload:
        c = _min_gpus(model, cluster, workload, ac)
        return (f"without offloading, {sharded} fits on {_gpus(c)}{ckpt}." if c else
                f"without offloading, no number of {device}s fits this micro batch and sequence length.")
    if forced_off:
        for mode in ("selective", "full"):
            for layout in layouts(cluster, workload):
                r = estimate(model, dataclasses.replace(layout, activation_checkpointing=mode))
                if r.fits:
                    return (f"It would fit with activation checkpointing {mode} ({r.name}, {gb(r.total_bytes)} per "
                            f"{device}): pass --activation-checkpointing {mode} or set "
                            f"model.activation_checkpointing={mode}.")
    c = _min_gpus(model, cluster, workload, ac)
    if c:
        return f"Smallest that fits: {_gpus(c)} with {sharded}{ckpt.replace(' with', ' and')}."
    if forced_off and (c := _min_gpus(model, cluster, workload, True)):
        return (f"No number of {device}s fits without activation checkpointing; with it full "
                f"(--activation-checkpointing full), {sharded} fits on {_gpus(c)}.")
    huge = estimate(model, Layout(sharded, dataclasses.replace(cluster, nodes=1 << 14), workload,
                                  activation_checkpointing=ac))
    if huge.startup_host_fits is False:  # what no number of GPUs divides: one checkpoint tensor per rank
        return (f"No number of {device}s helps: at start-up each node needs "
                f"{gb(huge.startup_host_bytes_per_node)} of host RAM (loading a checkpoint reads one full fp32 "
                f"tensor per rank), more than {gb(cluster.cpu_ram_bytes)}; give the node more RAM (--cpu-ram) or "
                "fewer ranks per node.")
    return (f"No number of {device}s helps: activations and gathered layers alone exceed the memory; "
            "reduce --micro-batch or --seq-len.")
