"""The rows of the plan: which layouts, each one's estimate (its micro batch searched when a global batch is
given), and the pick among them. Pure arithmetic, no torch (zerodp/planner/__init__.py)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from zerodp.errors import UserError
from zerodp.models.chunking import CHECKPOINTING
from zerodp.planner.hardware import Cluster
from zerodp.planner.memory import estimate
from zerodp.planner.types import Checkpointing, Layout, MemoryEstimate, ModelSpec, Workload
from zerodp.strategies.catalog import planned, spec


def variants() -> list[tuple[str, bool, bool, bool]]:
    """(strategy, offload_optimizer, offload_params, hybrid) of every row, in order of preference: each
    strategy of the catalog (in its planner order), then the hybrid rows (several nodes only: HSDP, ZeRO++),
    then the offload rows, those offloading less first."""
    order = planned()
    plain = [(s.name, False, False, False) for s in order]
    hybrid = [(s.name, False, False, True) for s in order if s.hybrid_row]
    offload = [(s.name, oo, op, False) for s in order for oo, op in s.offload_variants]
    return plain + hybrid + sorted(offload, key=lambda v: v[1] + v[2])  # stable: planner order within a count
TIE = 0.03
"""Rows predicted within this fraction of the fastest are ties, and the simpler one is chosen."""
CLOSE = 0.005
"""Micro batches within this fraction of a row's best tokens/s are ties; the largest is shown (the constant
MFU does not capture that kernels run better on more tokens per micro batch)."""


def offloads(r: MemoryEstimate) -> bool:
    return r.offload_optimizer or r.offload_params


def layouts(cluster: Cluster, workload: Workload) -> list[Layout]:
    """The rows of the table, in order of preference; on one GPU a strategy may run as another (ddp as
    single: the catalog's `on_one_device`)."""
    out = []
    for strategy, oo, op, hybrid in variants():
        if oo and not cluster.gpu.cuda:
            continue  # a CPU device has no faster memory to offload to
        if hybrid and cluster.nodes == 1:
            continue  # within one node there is nothing slower to avoid
        if cluster.world_size == 1:
            strategy = spec(strategy).on_one_device or strategy
        out.append(Layout(strategy, cluster, workload, oo, op, hybrid=hybrid))
    return out


def row(model: ModelSpec, base: Layout, requested: Optional[bool | str]) -> MemoryEstimate:
    """The estimate for one variant: checkpointing as requested, or the first of off, selective, full that
    fits (full when none does)."""
    if requested is not None:
        return estimate(model, dataclasses.replace(base, activation_checkpointing=requested))
    for mode in CHECKPOINTING:
        r = estimate(model, dataclasses.replace(base, activation_checkpointing=mode))
        if r.fits or (r.total_bytes <= r.usable_bytes and r.cpu_fits is not False):
            return r  # fits, or only its start-up peak does not: checkpointing shrinks activations alone
    return r


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model: ModelSpec, base: Layout, requested: Optional[bool | str],
            global_batch: int) -> tuple[MemoryEstimate, list[MemoryEstimate]]:
    """Every micro batch that divides the global batch per rank, with checkpointing off, selective and full
    (or as requested): (the one with the highest predicted tokens/s that fits, everything tried). When none
    fits, the smallest: micro batch 1, checkpointing full unless another mode was requested."""
    per_rank = global_batch // base.cluster.world_size
    pairs = base.workload.objective == "dpo"  # a micro batch of whole preference pairs: even
    if pairs and per_rank % 2:
        raise UserError(f"train.objective=dpo: {global_batch} sequences over {base.cluster.world_size} ranks is "
                        f"{per_rank} a rank, which would split a preference pair; give a global batch of an even "
                        f"number of sequences per rank (e.g. {2 * per_rank * base.cluster.world_size})")
    tried = []
    for b in (d for d in divisors(per_rank) if d % 2 == 0 or not pairs):
        w = dataclasses.replace(base.workload, micro_batch=b, grad_accum_steps=per_rank // b)
        for ac in (CHECKPOINTING if requested is None else (Checkpointing(requested),)):
            tried.append(estimate(model, dataclasses.replace(base, workload=w, activation_checkpointing=ac)))
    fitting = [e for e in tried if e.fits]
    if not fitting:
        smallest = "full" if requested is None else Checkpointing(requested)
        return next(e for e in tried if e.micro_batch == (2 if pairs else 1)
                    and e.activation_checkpointing == smallest), tried
    return best(fitting), tried


def best(fitting: list[MemoryEstimate]) -> MemoryEstimate:
    """The highest predicted tokens/s; within CLOSE of it, the least recomputation (off, selective, full) and
    the largest micro batch."""
    top = max(e.tokens_per_s_per_gpu for e in fitting)
    close = [e for e in fitting if e.tokens_per_s_per_gpu >= top * (1 - CLOSE)]
    return max(close, key=lambda e: (-e.activation_checkpointing.rank, e.micro_batch))


def pick(rows: list[MemoryEstimate], exact_only: bool = False) -> Optional[MemoryEstimate]:
    """The fastest row that fits (with `exact_only` none that changes the numerics), the simplest (first in
    `rows`: offload rows come last) within TIE of it. An offload row is chosen when its predicted step, CPU
    optimizer step and PCIe copies included, is the fastest: the cost of offloading is in step_s."""
    pool = [r for r in rows if r.fits and (r.exact or not exact_only)]
    if not pool:
        return None
    fastest = max(r.tokens_per_s_per_gpu for r in pool)
    return next(r for r in pool if r.tokens_per_s_per_gpu * (1 + TIE) >= fastest)


