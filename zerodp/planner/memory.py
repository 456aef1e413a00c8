"""The memory and time model: `estimate(model, layout) -> MemoryEstimate` for one strategy.

Every formula, with its source, is in docs/memory_model.md. Pure arithmetic: no process group,
no GPU, no torch. Which formula applies is read from the strategy's profile in the catalog
(zerodp/strategies/catalog.py), never from its name.
"""

from __future__ import annotations

import dataclasses
import math

from zerodp.planner.activations import (  # noqa: F401  (activations' formulas, imported from here too)
    FLEX_BLOCK,
    activation_bytes,
    compute_factor,
    document_mask_bytes,
    layer_activation_factor,
)
from zerodp.planner.buckets import bucket_bytes, grad_bytes
from zerodp.planner.lora import block_adapter_params, flops_per_token as lora_flops_per_token, frozen_bytes
from zerodp.planner.moe import expert_gather
from zerodp.planner.persistence import persistent_param_bytes
from zerodp.planner.preference import (
    avoidable_bytes as reference_avoidable,
    reference_bytes,
    reference_flops_per_token,
    reference_gather_sent,
    reference_offloaded,
    unreached_bytes as reference_unreached,
)
from zerodp.planner.traffic import Collective, collective_seconds, collectives, inter_node_sent
from zerodp.planner.types import (  # noqa: F401  (the types estimate takes and returns, imported from here too)
    ZERO3_KEEP_WINDOW,
    ZERO3_PERSISTENCE_THRESHOLD,
    Checkpointing,
    Layout,
    MemoryEstimate,
    ModelSpec,
    Workload,
)
from zerodp.planner.units import COMPUTE_BYTES
from zerodp.strategies.catalog import STATES, StrategySpec, spec

MARGIN = 0.10
"""Fraction of device memory kept free: allocator fragmentation, temporaries the model ignores."""
CUDA_OVERHEAD = 2**30
"""CUDA context, cuBLAS/NCCL workspaces: memory torch's allocator never sees (~1 GiB)."""
CPU_ADAM_PARAMS_PER_S = 4e9
"""DeepSpeed CPUAdam throughput per node, parameters per second (ZeRO-Offload paper: ~1B in 0.2-0.3 s)."""
PCIE_BYTES_PER_S = 20e9
"""Host<->GPU copy bandwidth per GPU for offloaded states."""




def model_states(params: int, world_size: int, strategy: str, precision: str) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per GPU, the ZeRO paper's accounting. Mixed precision:
    2-byte params and grads, K=12 optimizer bytes (fp32 master, Adam m and v); fp32: 4, 4, 8.
    A sharded figure is for the largest shard, ceil(P/N) elements."""
    return _per_gpu(params, world_size, spec(strategy), (4, 4, 8) if precision == "fp32" else (2, 2, 12))


def _per_gpu(params: int, world_size: int, s: StrategySpec, nbytes: tuple[int, int, int]) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per GPU at `nbytes` per element of each: the whole on every GPU, or
    ceil(P/N) elements for the states `s` shards."""
    shard = math.ceil(params / world_size)
    p, g, o = ((shard if state in s.shards else params) * b for state, b in zip(STATES, nbytes))
    return p, g, o


def engine_states(params: int, world_size: int, strategy: str, precision: str) -> tuple[int, int, int, int]:
    """(params, grads, optimizer, engine_master) bytes per GPU as zerodp's engines hold them, measured
    by tests/distributed/test_planner_validation.py. The first three always add up to `model_states`; mixed
    precision splits them differently per engine:

    * ddp/single: autocast over fp32 parameters, which are the master weights: 4P, 4P (fp32 grads), 8P.
    * fsdp: fp32 parameter shards (the master weights), fp32 gradient shards, moments: 4P/N, 4P/N, 8P/N;
      16-bit copies exist only while a unit is gathered (gathered_bytes).
    * zero1-3 (DeepSpeed): the paper's split, 16-bit params and grads, 12P/N fp32 master + moments.

    engine_master is the extra fp32 master copy DeepSpeed keeps in fp32 training (4P/N), beyond the
    paper's figure; 0 for every other case."""
    s = spec(strategy)
    if s.fp32_params:  # fp32 parameters, gradients and moments (sharded as the stage says) in any precision
        return (*_per_gpu(params, world_size, s, (4, 4, 8)), 0)
    master = 4 * math.ceil(params / world_size) if precision == "fp32" else 0
    return (*model_states(params, world_size, strategy, precision), master)


def autocasts(layout: Layout) -> bool:
    """Whether the engine keeps fp32 parameters and computes in 16 bits under torch.autocast (single, ddp):
    its residual stream is fp32 and it casts each weight once per forward."""
    s = layout.spec
    return layout.workload.precision != "fp32" and s.fp32_params and not s.gathers_in_forward


def startup_states(model: ModelSpec, layout: Layout) -> tuple[int, int]:
    """(device, host) bytes one rank holds at its start-up peak, overhead left out. Every strategy builds
    the model on the meta device and materialises only what the rank keeps, initialised in chunks of
    its own range (negligible); loading a checkpoint reads one full fp32 tensor at a time into host
    memory (4 * largest_param, counted for every row: a run may resume). A LoRA run's frozen base is
    materialised in the compute dtype, with no master copy, gradient or bucket (zerodp.planner.lora).
    docs/memory_model.md, "Start-up"."""
    P, T, s, w = model.params, model.trainable_params, layout.spec.startup, layout.workload
    n = layout.cluster.world_size
    c, shard, tshard = COMPUTE_BYTES[w.precision], math.ceil(P / n), math.ceil(T / n)
    frozen_shard = c * math.ceil(model.frozen_params / n)  # a LoRA run's base, in the compute dtype
    oo, op, load = layout.offload_optimizer, layout.offload_params, 4 * model.largest_param
    master = 4 * tshard  # DeepSpeed's fp32 master partition
    if s == "fp32_module":
        return 4 * T + c * model.frozen_params, load
    if s == "fp32_module_buckets":  # the reducer allocates its fp32 flat buckets when it wraps the model
        return 8 * T + c * model.frozen_params, load
    if s == "fp32_shards":  # fully_shard on the meta model, then to_empty: fp32 shards only (offload: on host)
        shards = 4 * tshard + frozen_shard
        return (0, load + shards) if oo or op else (shards, load)
    if s == "16bit_module":  # module built in the compute dtype; the optimizer's groups flattened through host RAM
        return c * P + (0 if oo else master), load + c * T + (master if oo else 0)
    assert s == "zero_init_partitions", s
    # partitions made as zero.Init creates each module (in fp32, then cast: one module at a time);
    # at initialize the engine copies them into one flat buffer (the old copies are freed), makes the
    # fp32 master partition (a separate copy, in fp32 too) and allocates its gradient partition buffer
    # (in the compute dtype) and a reduce bucket, all before the first step. Measured on CPU ranks:
    # benchmarks/startup_memory.py. With offload the partitions / master and gradients live on the host.
    part = 0 if op else c * shard
    dev_master, dev_grads = (0, 0) if oo else (master, grad_bytes(w.precision, w.grad_reduce_dtype) * tshard)
    bucket = bucket_bytes(3, model.hidden, P, w.precision, w.grad_reduce_dtype, oo, w.bucket_mb, model.largest_param)
    created = 4 * max(model.largest_block_params, model.largest_param)
    host = (c * shard if op else 0) + (master + 4 * tshard if oo else 0)
    return part + dev_master + dev_grads + bucket + created, load + host


def train_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token at `seq_len`: 6 per parameter that multiplies (forward 2, backward 4;
    lookups excluded) plus attention's QK^T and AV, 12 * L * s * q_dim (PaLM, appendix B): the
    architecture's own count (`Arch.flops_per_token`, the MFU figure of `zerodp train`), or for a
    --params guess 6 P + the attention term."""
    if model.arch is not None:  # a LoRA run computes no weight gradient for its frozen base
        return lora_flops_per_token(model, float(model.arch.flops_per_token(seq_len)), seq_len)
    return 6.0 * model.active_params + 12.0 * model.n_layer * seq_len * model.q_dim


def estimate(model: ModelSpec, layout: Layout) -> MemoryEstimate:
    """Per-GPU memory and predicted step time of running `model` as `layout` says. Memory and the
    parameter all-gathers use every parameter (`model.params`); gradients, optimizer states, their
    reduction and the optimizer step the trained ones (`model.trainable_params`: a LoRA run's adapters,
    the frozen base priced apart, zerodp.planner.lora); compute uses `model.active_params`."""
    c, w = layout.cluster, layout.workload
    n, P, ac = c.world_size, model.params, layout.activation_checkpointing
    T = model.trainable_params  # P in full fine-tuning
    cb = COMPUTE_BYTES[w.precision]
    s = layout.spec
    hsdp = layout.hybrid and s.hybrid_shard  # shards over the node's GPUs only
    if hsdp:
        n = c.gpus_per_node
    params_b, grads_b, optim_b, master_b = engine_states(T, n, layout.strategy, w.precision)
    frozen_b = frozen_bytes(model, n, "params" in s.shards, w.precision)  # no gradient, no optimizer state
    params_b += frozen_b
    hpz, qwz, qgz = layout.zeropp
    secondary = cb * math.ceil(P / c.gpus_per_node) if hpz else 0

    offloaded = 0
    if s.offload_together and (layout.offload_optimizer or layout.offload_params):
        # CPUOffloadPolicy moves the fp32 parameter shards (the master weights), gradients and moments
        offloaded, params_b, grads_b, optim_b = params_b + grads_b + optim_b, 0, 0, 0
    elif layout.offload_optimizer:  # fp32 master + Adam moments and the fp32 gradient shard live on CPU
        offloaded += 16 * math.ceil(T / n)
        if s.zero_stage in (1, 2):  # DeepSpeedZeroOptimizer's host buffers beside them: the 16-bit copy of the
            # updated partition it sends back, one 16-bit gradient buffer the size of the largest parameter and,
            # while accumulating, each partition parameter's gradient in the accumulation dtype
            # (stage_1_and_2.py, cpu_offload; measured, tests/unit/test_planner.py)
            accumulating = grad_bytes(w.precision, w.grad_reduce_dtype) * math.ceil(T / n) \
                if w.grad_accum_steps > 1 else 0
            offloaded += cb * (math.ceil(T / n) + min(model.largest_param, T)) + accumulating
        elif s.zero_stage == 3:  # the fp32 partition's own gradient buffer beside the gradient partition (stage3.py)
            offloaded += 4 * math.ceil(T / n)
        # the gradients go to the host as each bucket is reduced, under ZeRO-1 too: none stay on the device
        optim_b, master_b, grads_b = 0, 0, 0
    if layout.offload_params and "params" in s.shards and not s.offload_together:
        offloaded += params_b  # the parameter partitions (fp32 too: DeepSpeed's master is a copy of its own)
        params_b = 0
    if (s.layout == "deepspeed" and w.precision == "bf16" and w.grad_reduce_dtype == "fp32"
            and not layout.offload_optimizer):  # fp32 accumulation:
        # zero1 a full fp32 buffer beside the bf16 gradients (BF16_Optimizer; with offload `grad_accum`),
        # zero2/3 their gradient partition in fp32 instead of bf16
        grads_b = grads_b + 4 * T if s.zero_stage == 1 else 2 * grads_b
    states = params_b + grads_b + optim_b
    # FSDP2 without gradient sync keeps every unit's unsharded fp32 gradient until the last micro batch.
    deferred = s.defer_grad_reduce and w.fsdp_defer_grad_reduce and w.grad_accum_steps > 1
    unsharded = 4 * T if deferred else 0

    sharded = s.gathers_in_forward
    # 2 units, and the gradients of one: under LoRA the unit's adapters beside its base, gradients for them only
    unit_lora = block_adapter_params(model)
    unit_grads = unit_lora if model.lora is not None else model.largest_unit_params
    gathered = ((model.largest_unit_params + unit_lora) * 2 * cb + unit_grads * cb) if sharded and n > 1 else 0
    # zerodp's DDP uses gradient_as_bucket_view: its buckets are the gradients, counted above.
    buckets = bucket_bytes(s.zero_stage, model.hidden, P, w.precision, w.grad_reduce_dtype, layout.offload_optimizer,
                           w.bucket_mb, model.largest_param, trainable=T) if s.bucket_copies and n > 1 else 0
    acts = activation_bytes(model, w, ac, c.gpu.cuda, autocasts(layout))
    overhead = CUDA_OVERHEAD if c.gpu.cuda else 0
    # Without accumulation an engine that frees its gradients after the step peaks either with the
    # activations and no gradients (the loss's backward) or with the gradients and (nearly) no activations.
    transient = max(acts, grads_b) - grads_b if s.frees_grads and w.grad_accum_steps == 1 else acts
    persistent = persistent_param_bytes(model, layout)
    # DPO (zerodp.planner.preference): a live reference's weights for the whole run; its forward runs under
    # no_grad before the policy's, its transient activations below the policy's peak; offloaded as the policy is.
    reference = reference_bytes(model, layout, w.dpo_reference)
    offloaded += reference_offloaded(model, layout, w.dpo_reference)
    total = (states + master_b + secondary + persistent + unsharded + gathered + buckets + transient + overhead
             + reference)
    usable = int(c.gpu.hbm_bytes * (1 - MARGIN))
    cpu_node = offloaded * c.gpus_per_node
    cpu_fits = None if not offloaded or c.cpu_ram_bytes is None else cpu_node <= c.cpu_ram_bytes
    start_dev, start_host = startup_states(
        model, dataclasses.replace(layout, cluster=dataclasses.replace(c, nodes=1)) if hsdp else layout)
    if not c.gpu.cuda:  # CPU ranks: the device is host memory, so its start-up peak holds both
        start_dev, start_host = start_dev + start_host, start_dev + start_host
    startup = start_dev + overhead
    startup_node = start_host * c.gpus_per_node
    startup_host_fits = None if c.cpu_ram_bytes is None else startup_node <= c.cpu_ram_bytes

    # Time: training FLOPs per token (6 per multiplying parameter + attention, `train_flops_per_token`),
    # more with recomputation (`compute_factor`: full a third, selective its element-wise share); a mixture
    # of experts counts the experts a token is routed to.
    tokens = w.micro_batch * w.seq_len * w.grad_accum_steps
    flops_per_token = train_flops_per_token(model, w.seq_len) * compute_factor(ac)
    redo = (compute_factor(ac) - 1) * 6  # the recomputed work, in units of 1/6 of a step without it
    peak = c.gpu.peak_flops_32 if w.precision == "fp32" else c.gpu.peak_flops_16
    # DPO: the reference's forward over every row (both sequences of each pair), a third of full fine-tuning's
    full_flops = float(model.arch.flops_per_token(w.seq_len)) if model.arch is not None else \
        6.0 * model.active_params + 12.0 * model.n_layer * w.seq_len * model.q_dim
    reference_s = reference_flops_per_token(full_flops, w.dpo_reference) * tokens / (c.mfu * peak)
    compute_s = flops_per_token * tokens / (c.mfu * peak) + reference_s
    parts = collectives(model, layout)
    gather = reference_gather_sent(model, layout, w.dpo_reference)
    if gather:
        parts.append(Collective("all-gather the DPO reference's weights", "all", gather, True))
    overlap_s = sum(collective_seconds(x, c) for x in parts if x.overlappable)
    waited_s = sum(collective_seconds(x, c) for x in parts if not x.overlappable)
    # Gradient reduction can only hide behind the backward; ZeRO-3/FSDP prefetch behind everything.
    window = compute_s if sharded else compute_s * (4 + redo) / (6 + redo)
    exposed_s = max(0.0, overlap_s - window) + waited_s
    offload_s = 0.0
    if offloaded:  # CPU Adam on this node's shards, plus gradients down and params up over PCIe
        offload_s = T / n * c.gpus_per_node / CPU_ADAM_PARAMS_PER_S + (4 + cb) * T / n / PCIE_BYTES_PER_S
        if layout.offload_params:  # each micro batch fetches the parameter shard, forward and backward
            offload_s += 2 * cb * P / n * w.grad_accum_steps / PCIE_BYTES_PER_S
    step_s = compute_s + exposed_s + offload_s
    experts = expert_gather(model, layout)

    return MemoryEstimate(
        name=layout.name, strategy=layout.strategy, offload_optimizer=layout.offload_optimizer,
        offload_params=layout.offload_params, activation_checkpointing=ac,
        params_bytes=params_b, grads_bytes=grads_b, optimizer_bytes=optim_b, model_states_bytes=states,
        frozen_bytes=0 if params_b == 0 else frozen_b,
        engine_master_bytes=master_b, unsharded_grads_bytes=unsharded, secondary_bytes=secondary,
        persistent_bytes=persistent,
        gathered_bytes=gathered, bucket_bytes=buckets, activations_bytes=acts, overhead_bytes=overhead,
        total_bytes=total, hbm_bytes=c.gpu.hbm_bytes, usable_bytes=usable, headroom_bytes=usable - total,
        offloaded_bytes=offloaded, cpu_bytes_per_node=cpu_node, cpu_fits=cpu_fits,
        startup_bytes=startup, startup_host_bytes_per_node=startup_node, startup_host_fits=startup_host_fits,
        fits=total <= usable and startup <= usable and cpu_fits is not False and startup_host_fits is not False,
        comm_bytes=int(sum(x.sent for x in parts)),
        inter_node_bytes=int(sum(inter_node_sent(x, c) for x in parts)),
        micro_batch=w.micro_batch, grad_accum_steps=w.grad_accum_steps,
        exact=not (qwz or qgz),
        compute_s=compute_s, comm_s=overlap_s + waited_s,
        exposed_comm_s=exposed_s, offload_s=offload_s, step_s=step_s,
        scaling_efficiency=compute_s / step_s, tokens_per_s_per_gpu=tokens / step_s,
        reference_bytes=reference, reference_avoidable_bytes=reference_avoidable(model, layout, w.dpo_reference),
        reference_unreached_bytes=reference_unreached(model, layout, w.dpo_reference), reference_s=reference_s,
        expert_gather_bytes=int(experts.sent), expert_gather_s=experts.seconds, expert_gather_share=experts.share,
    )
