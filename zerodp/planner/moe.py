"""A mixture of experts in the planner (qwen3_moe, mixtral, qwen2_moe: `Arch.n_experts` > 0), priced
apart from the dense formulas (docs/memory_model.md, "Mixture of experts"):

* states: every expert is held (`ModelSpec.params` counts all E of every sparse block); compute follows
  the active parameters (`ModelSpec.active_params`: k of E experts, `Arch.flops_per_token`);
* activations (`routed_bytes_per_token`): a sparse block keeps what a dense SwiGLU MLP of width k x the
  expert's width keeps (counted by zerodp.planner.activations), plus the k copies of each token routed
  to its experts (their inputs, the experts' outputs and the weighted outputs, zerodp.models.moe.Experts),
  the router's fp32 probabilities and the routing indices;
* communication (`expert_gather`): zero3 and fsdp gather every expert of every sparse block, forward and
  backward, whatever the routing: its bytes per step and seconds, and their share of the all-gathers
  (what expert parallelism would keep local).

Torch-free; reads the planner's types and the traffic model only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.planner.traffic import _fsdp_elements, _zero3_elements, collective_seconds, collectives
from zerodp.planner.types import Layout, MemoryEstimate, ModelSpec
from zerodp.planner.units import COMPUTE_BYTES, human_count, seconds

EXPERTS = ".mlp.experts."
"""What the stacked expert tensors' names contain (`<block>.mlp.experts.gate_up_proj`, `down_proj`)."""


def sparse_layers(m: ModelSpec) -> int:
    """Blocks whose MLP is a mixture of experts; 0 for a dense model or a --params guess."""
    a = m.arch
    if a is None or not a.n_experts:
        return 0
    return sum(1 for i in range(a.n_layer) if a.is_moe_layer(i))


def routed_bytes_per_token(m: ModelSpec, precision: str, autocast: bool = False) -> float:
    """Bytes per token one sparse block keeps for backward beyond a dense SwiGLU MLP of width k x I (which
    `layer_activation_factor` counts through `ModelSpec.ffn_hidden`), as zerodp.models.moe runs it
    (measured: tests/unit/test_planner.py, test_moe_block_keeps_what_the_planner_counts): in the compute
    dtype (c bytes) the k routed copies of the token's input, the k expert outputs and the k weighted
    outputs (3 k h), and the k routing weights gathered by expert; in fp32 the router's probabilities (E)
    and, with norm_topk_prob, the top k and their sum; the top-k expert indices and the (token, expert)
    pairs' token and sort order, int64 (3 k). Under `autocast` one 16-bit copy of the input less: the
    router casts it once, where a dense MLP's gate and up projections each cast it. 0 for a dense model."""
    a = m.arch
    if not sparse_layers(m):
        return 0.0
    c, k = COMPUTE_BYTES[precision], a.experts_per_token
    router = 4 * a.n_experts + (4 * k + 4 if a.norm_topk_prob else 0)
    casts = -2 * m.hidden if autocast and precision != "fp32" else 0
    return c * (3 * k * m.hidden + k) + router + 8 * 3 * k + casts


@dataclass(frozen=True)
class ExpertGather:
    """What zero3 and fsdp spend gathering the experts' weights, per GPU and optimizer step."""

    sent: float
    """Bytes each GPU sends in the all-gathers of expert weights (every expert of every sparse block,
    forward and backward, each micro batch)."""
    seconds: float
    """Their time on the cluster's links (`collective_seconds`), hidden behind compute or not."""
    share: float
    """Of all the parameter all-gathers' bytes: what expert parallelism would no longer gather."""


NO_GATHER = ExpertGather(0.0, 0.0, 0.0)


def expert_gather(m: ModelSpec, layout: Layout) -> ExpertGather:
    """The experts' part of the parameter all-gathers of `layout`: ZeRO-3's forward and backward gathers
    (the reuse distance deciding which blocks are gathered again, zerodp.planner.traffic._zero3_elements)
    and FSDP's per-block gathers, each scaled by the experts' share of its elements. NO_GATHER for a dense
    model, a strategy that does not gather parameters, or one GPU."""
    w, n = layout.workload, layout.cluster.world_size
    if not sparse_layers(m) or not layout.spec.gathers_in_forward or n == 1:
        return NO_GATHER
    parts = collectives(m, layout)
    if layout.spec.traffic == "gather_per_use":  # zero3: forward, backward
        args = (w.zero3_persistence_threshold, w.zero3_keep_window)
        _, gathered, regathered = _zero3_elements(m, n, *args)
        _, e_gathered, e_regathered = _zero3_elements(m, n, *args, part=EXPERTS)
        shares = (e_gathered / max(gathered, 1), e_regathered / max(regathered, 1))
    else:  # fsdp: one all-gather kind, forward and (resharded) backward
        shard = layout.cluster.gpus_per_node if layout.hybrid else n
        every, blocks = _fsdp_elements(m, shard)
        e_every, e_blocks = _fsdp_elements(m, shard, part=EXPERTS)
        again = w.fsdp_reshard_after_forward
        shares = ((e_every + (e_blocks if again else 0)) / max(every + (blocks if again else 0), 1),)
    gathers = parts[:len(shares)]
    sent = sum(x.sent * s for x, s in zip(gathers, shares))
    total = sum(x.sent for x in gathers)
    return ExpertGather(sent, sum(collective_seconds(x, layout.cluster) * s for x, s in zip(gathers, shares)),
                        sent / total if total else 0.0)


def block_expert_elements(m: ModelSpec) -> int:
    """Elements of the largest sparse block's experts: what zero3 and fsdp gather whole for it, every time."""
    per_block: dict[str, int] = {}
    for name, shape in m.arch.param_shapes().items():
        if EXPERTS in name:
            block = name.split(EXPERTS)[0]
            per_block[block] = per_block.get(block, 0) + math.prod(shape)
    return max(per_block.values(), default=0)


def gather_lines(m: ModelSpec, rows: list[MemoryEstimate], precision: str) -> list[str]:
    """What `zerodp plan` prints under a mixture of experts' table: the experts per block and per token, a
    block's experts in the compute dtype, and for each row that gathers parameters (zero3, fsdp) the bytes
    and seconds per step of gathering every expert, and their share of its all-gathers (one row per
    strategy); nothing for a dense model."""
    a = m.arch
    if not sparse_layers(m):
        return []
    gathering = {}  # per strategy its first row: the offload variants gather the same
    for e in rows:
        if e.expert_gather_bytes:
            gathering.setdefault(e.strategy, e)
    block = COMPUTE_BYTES[precision] * block_expert_elements(m)
    lines = [f"Experts: {a.n_experts} per sparse block ({sparse_layers(m)} of {a.n_layer} blocks, "
             f"{block / 1e9:.2f} GB of {precision} experts each), {a.experts_per_token} per token: memory holds "
             f"every expert ({human_count(m.params)}), compute follows the active parameters "
             f"({human_count(m.active_params)} per token)."]
    if gathering:
        lines.append("Gathering every expert of every sparse block, forward and backward, whatever the routing "
                     "(per GPU per step; expert parallelism would keep them local):")
        lines += [f"  {e.name}: {e.expert_gather_bytes / 1e9:.1f} GB in {seconds(e.expert_gather_s)}, "
                  f"{e.expert_gather_share:.0%} of its parameter all-gathers"
                  for e in gathering.values()]
    return lines
