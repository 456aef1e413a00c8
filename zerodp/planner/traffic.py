"""What each GPU sends per optimizer step, collective by collective, as the engines send them (measured by
zerodp.telemetry.comm; docs/memory_model.md, "Communication per step"), and how long each takes on the cluster's
links. Pure arithmetic, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerodp.planner.buckets import grad_bytes
from zerodp.planner.hardware import Cluster
from zerodp.planner.lora import param_shapes, trainable_shapes
from zerodp.planner.types import Layout, ModelSpec
from zerodp.planner.units import COMPUTE_BYTES


@dataclass(frozen=True)
class Collective:
    """One kind of collective a step issues, as `comm_bytes` and the step time count it."""

    what: str
    group: str
    """'all' (every rank), 'node' (the ranks of one node) or 'replicas' (one rank per node, each node's
    GPUs in parallel groups)."""
    sent: float
    """Bytes each GPU sends in it per optimizer step (ring: an all-reduce 2(n-1)/n of its data, an
    all-gather, reduce-scatter or all-to-all (n-1)/n, n the group's size)."""
    overlappable: bool
    """Issued while compute runs (prefetch, bucketed reduction); False: the step waits for it."""


def collectives(model: ModelSpec, layout: Layout) -> list[Collective]:
    """What each GPU sends per optimizer step, as the engines send it (measured by zerodp.telemetry.comm;
    docs/memory_model.md, "Communication per step"). Sizes include each engine's padding; the few scalar
    all-reduces of a step (gradient norm, overflow check) are left out. A LoRA run reduces the adapters'
    gradients only, and DeepSpeed zero1/2 all-gather only the adapters they update; zero3 and fsdp gather the
    frozen base too (zerodp.planner.lora), zero3 its persistent parameters after every step as well."""
    c, w = layout.cluster, layout.workload
    n, g = c.world_size, c.gpus_per_node
    if n == 1:
        return []
    ring = lambda size: (size - 1) / size  # noqa: E731
    cb, acc, s = COMPUTE_BYTES[w.precision], w.grad_accum_steps, layout.spec
    T = model.trainable_params  # what gets gradients: every parameter, or a LoRA run's adapters
    gb = grad_bytes(w.precision, w.grad_reduce_dtype)  # ZeRO's gradient reduction (strategy.grad_reduce_dtype)
    if s.traffic == "all_reduce":  # once per step (no_sync while accumulating) during backward; zerodp's DDP
        # keeps fp32 gradients (autocast over fp32 parameters)
        return [Collective("all-reduce fp32 gradients", "all", 2 * ring(n) * 4 * T, True)]
    if s.traffic == "reduce_then_gather":  # DeepSpeed all-reduces the gradients
        # (use_multi_rank_bucket_allreduce), each rank keeping its partition: at the boundary (zero1) or every
        # micro batch (zero2, whose gradients are partitioned); after the step it all-gathers the updated 16-bit
        # flat groups.
        reduces = acc if "grads" in s.shards else 1
        # (bf16 with fp32 accumulation: zero1 is DeepSpeed's BF16_Optimizer, which all-reduces its fp32
        # gradients at the boundary, the same volume)
        return [Collective("all-reduce gradients", "all", 2 * ring(n) * gb * T * reduces, True),
                Collective("all-gather updated parameters", "all",
                           ring(n) * cb * _deepspeed_flat_elements(_shapes(model, trainable_only=True), n), False)]
    if s.traffic == "gather_per_use":  # ZeRO-3, every micro batch: reduce-scatter everything, all-gather
        # the parameters above the persistence threshold in forward, and in backward again those released in
        # between (reuse distance); the persistent ones are gathered once per step, after the optimizer step
        persistent, gathered, regathered = _zero3_elements(model, n, w.zero3_persistence_threshold,
                                                           w.zero3_keep_window)
        reduced = persistent + gathered  # what gets gradients: under LoRA the adapters' elements alone
        if model.lora is not None:
            a_persistent, a_gathered, _ = _zero3_elements(model, n, w.zero3_persistence_threshold,
                                                          w.zero3_keep_window, trainable_only=True)
            reduced = a_persistent + a_gathered
        # after the optimizer step DeepSpeed gathers every persistent parameter again (stage3's _post_step),
        # the frozen ones of a LoRA run too, though the step did not change them
        after_step = Collective("all-gather persistent parameters", "all", ring(n) * cb * persistent, False)
        hpz, qwz, qgz = layout.zeropp
        # ZeRO++: the forward all-gather in int8 (qwZ; one fp32 scale per block, counted per 2048 elements: an
        # upper bound, DeepSpeed 0.19 quantises blocks of up to ~8k), the backward one
        # from the secondary partition within the node (hpZ), gradients quantised to int4 and reduced by an
        # all-to-all within the node and then one across the nodes on 1/g of them (qgZ)
        weights = (1 + 4 / 2048) if qwz else cb
        out = [Collective("all-gather parameters (forward)", "all", ring(n) * weights * acc * gathered, True),
               Collective("all-gather parameters (backward)" + (" within the node, hpZ" if hpz else ""),
                          "node" if hpz else "all", ring(g if hpz else n) * cb * acc * regathered, True)]
        if qgz:
            out += [Collective("all-to-all int4 gradients within the node", "node",
                               ring(g) * 0.5 * acc * reduced, True),
                    Collective("all-to-all int4 gradients across nodes", "replicas",
                               ring(c.nodes) * 0.5 * acc * reduced / g, True)]
        else:
            out.append(Collective("reduce-scatter gradients", "all", ring(n) * gb * acc * reduced, True))
        return out + [after_step]
    assert s.traffic == "gather_per_unit", s.traffic
    # FSDP2: every micro batch all-gathers each unit in forward (compute dtype) and, where resharded after
    # forward (the blocks; the root unit stays gathered), again in backward; reduce-scatters fp32 gradients
    # every micro batch (once per step with fsdp_defer_grad_reduce). Hybrid: the same within the node
    # (shard group = the node), then the fp32 gradient shard is all-reduced across the nodes.
    shard = g if layout.hybrid else n
    every, blocks = _fsdp_elements(model, shard)
    gathered = every + (blocks if w.fsdp_reshard_after_forward else 0)
    if model.lora is not None:  # the reduce-scatter carries the adapters' gradients only
        every, _ = _fsdp_elements(model, shard, trainable_only=True)
    reduces = 1 if w.fsdp_defer_grad_reduce else acc
    group = "node" if layout.hybrid else "all"
    out = [Collective("all-gather parameters (forward, backward)", group, ring(shard) * acc * cb * gathered, True),
           Collective("reduce-scatter fp32 gradients", group, ring(shard) * reduces * 4 * every, True)]
    if layout.hybrid:
        out.append(Collective("all-reduce fp32 gradient shards across nodes", "replicas",
                              2 * ring(c.nodes) * reduces * 4 * every / g, True))
    return out


def comm_bytes(model: ModelSpec, layout: Layout) -> tuple[int, int]:
    """(overlappable, exposed) bytes each GPU sends per optimizer step: `collectives` added up."""
    parts = collectives(model, layout)
    return (int(sum(x.sent for x in parts if x.overlappable)),
            int(sum(x.sent for x in parts if not x.overlappable)))


def collective_seconds(x: Collective, cluster: Cluster) -> float:
    """How long one collective kind takes per step. Over every rank it runs at the slowest hop's speed
    (a node's NICs carry what one GPU sends: one share per ring crosses each node boundary); within a
    node at the GPUs' link; across the nodes the node's g parallel groups share its NICs."""
    if x.group == "node":
        return x.sent / cluster.intra_bandwidth
    if x.group == "replicas":
        return x.sent * cluster.gpus_per_node / cluster.inter_bandwidth
    return x.sent / cluster.ring_bandwidth


def inter_node_sent(x: Collective, cluster: Cluster) -> float:
    """Bytes per step that one node sends to other nodes in `x`."""
    if cluster.nodes == 1 or x.group == "node":
        return 0.0
    return x.sent * (cluster.gpus_per_node if x.group == "replicas" else 1)


def _shapes(model: ModelSpec, trainable_only: bool = False) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape (a LoRA run's adapters included; `trainable_only`: the adapters alone); for
    a --params guess (no architecture) one flat tensor per transformer block and the rest as one tensor."""
    if trainable_only and model.lora is not None:
        return trainable_shapes(model)
    if model.arch is not None:
        return param_shapes(model)
    blocks = {f"blocks.{i}": (model.largest_block_params,) for i in range(model.n_layer)}
    return {**blocks, "rest": (max(0, model.params - model.n_layer * model.largest_block_params),)}


def _fsdp_elements(model: ModelSpec, n: int, trainable_only: bool = False, part: str = "") -> tuple[int, int]:
    """(all parameters, the blocks' parameters) as FSDP2 gathers them: dim 0 padded to a multiple of N;
    `trainable_only`: of a LoRA run's adapters alone; `part`: of the parameters whose names contain it."""
    pad = lambda shape: -(-shape[0] // n) * n * math.prod(shape[1:]) if shape else 1  # noqa: E731
    shapes = {name: s for name, s in _shapes(model, trainable_only).items() if part in name}
    prefix = model.arch.block_prefix + "." if model.arch is not None else "blocks."
    return (sum(pad(s) for s in shapes.values()),
            sum(pad(s) for name, s in shapes.items() if name.startswith(prefix)))


def _zero3_elements(model: ModelSpec, n: int, threshold: int, keep_window: int,
                    trainable_only: bool = False, part: str = "") -> tuple[int, int, int]:
    """(persistent, gathered, regathered) elements as ZeRO-3 partitions them, each parameter padded to a
    multiple of N. Parameters of at most `threshold` elements persist (stay gathered between uses).
    A block's others are released after its forward, and gathered again in backward, when the elements
    fetched in between (the later blocks forward and backward, and what is not in a block) exceed
    `keep_window`; otherwise they stay gathered until backward. What is not in a block (embeddings,
    final norm, head) is counted as used before the first block, an upper bound for the head.
    `trainable_only`: the counts of a LoRA run's adapters alone, `part`: of the parameters whose names
    contain it (the reuse distances still the whole model's)."""
    shapes = _shapes(model)
    wanted = _shapes(model, trainable_only) if trainable_only else shapes
    wanted = {name: s for name, s in wanted.items() if part in name}
    prefix = model.arch.block_prefix + "." if model.arch is not None else "blocks."
    persistent = 0
    blocks: dict[int, int] = {}  # block index -> its non-persistent elements
    counted: dict[int, int] = {}  # ... of those wanted
    rest = counted_rest = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        padded = -(-numel // n) * n
        counts = padded if name in wanted else 0
        if numel <= threshold:
            persistent += counts
        elif name.startswith(prefix):
            index = int(name[len(prefix):].split(".")[0])
            blocks[index] = blocks.get(index, 0) + padded
            counted[index] = counted.get(index, 0) + counts
        else:
            rest += padded
            counted_rest += counts
    regathered, later = 0, 0
    for index in sorted(blocks, reverse=True):
        if 2 * later + rest > keep_window:
            regathered += counted[index]
        later += blocks[index]
    if 2 * later + rest > keep_window:
        regathered += counted_rest
    return persistent, sum(counted.values()) + counted_rest, regathered


def _deepspeed_flat_elements(shapes: dict[str, tuple[int, ...]], n: int) -> int:
    """Elements of DeepSpeed zero1/2's flat 16-bit groups: zerodp.optim.param_groups' two groups
    (decayed matrices, the rest), each padded to a multiple of 2N (nccl_start_alignment_factor x N)."""
    groups = [0, 0]
    for name, shape in shapes.items():
        embedding = name.endswith(("wte.weight", "wpe.weight", "embed_tokens.weight"))
        groups[0 if len(shape) >= 2 and not embedding else 1] += math.prod(shape)
    return sum(-(-g // (2 * n)) * 2 * n for g in groups)
