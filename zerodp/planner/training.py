"""`plan_for_training`: what `strategy: auto` calls to pick a strategy for a training config."""

from __future__ import annotations

from typing import Optional

from zerodp.config.validation import dpo_reference
from zerodp.errors import UserError
from zerodp.models.chunking import checkpointing_mode
from zerodp.planner.choose import Plan, choose
from zerodp.planner.hardware import Cluster, gpu_from_device_name
from zerodp.planner.memory import estimate
from zerodp.planner.models import spec_from_model_config
from zerodp.planner.types import ZERO3_PERSISTENCE_THRESHOLD, Layout, MemoryEstimate, Workload
from zerodp.strategies.catalog import spec


def workload_from_config(cfg, world_size: int) -> Workload:
    """One step of `cfg` on `world_size` ranks: micro batch, block_size tokens, precision, buckets,
    document masking, and train's gradient accumulation (Config.check_batch_split): a global batch that does not split
    evenly over `world_size` raises the ConfigError `zerodp train` would stop with."""
    t = cfg.train
    reference = dpo_reference(cfg) if t.objective == "dpo" else None
    if t.micro_batch_size == "auto":  # searched by the planner: start from micro batch 1 (a DPO pair: 2)
        from zerodp.planner.choose import check_global_batch
        check_global_batch(t.global_batch_size, world_size, "train.global_batch_size")
        per_rank = t.global_batch_size // world_size
        micro = 2 if t.objective == "dpo" and per_rank % 2 == 0 else 1
        micro, accum = micro, per_rank // micro
    else:
        micro, accum = t.micro_batch_size, cfg.check_batch_split(world_size)
    s = cfg.strategy
    zero = (s.deepspeed or {}).get("zero_optimization", {})  # the DeepSpeed settings ZeRO-3's traffic depends on
    return Workload(micro, cfg.model.block_size, t.precision, accum, s.bucket_size_mb,
                    s.fsdp_defer_grad_reduce, s.reshard_after_forward,
                    int(zero.get("stage3_param_persistence_threshold", ZERO3_PERSISTENCE_THRESHOLD)),
                    int(max(zero.get("stage3_max_reuse_distance", 1e9), zero.get("stage3_prefetch_bucket_size", 5e7))),
                    s.grad_reduce_dtype, cfg.data.document_masking, cfg.model.document_attention,
                    cfg.model.loss_chunks, t.objective, reference)


def plan_for_training(cfg, world_size: int, device_memory_bytes: int, device_name: str = "cpu", *,
                      gpus_per_node: Optional[int] = None, allow_checkpointing: bool = True,
                      strategy: Optional[str] = None) -> Plan:
    """Choose how to train `cfg` (a zerodp.config.Config) on `world_size` ranks whose devices each
    have `device_memory_bytes` (torch.cuda.get_device_properties(i).total_memory, or the RAM share
    of a CPU rank) and are called `device_name` (torch.cuda.get_device_name(), or 'cpu').

    Returns a Plan whose `.choice` is 'single' (world_size 1) or ddp|zero1|zero2|zero3|fsdp, or None
    when nothing fits; the caller must also apply `.offload_optimizer`, `.offload_params` and
    `.activation_checkpointing`. model.activation_checkpointing=true forces checkpointing on;
    otherwise the planner turns it on only where that is what makes the model fit (unless
    `allow_checkpointing` is False). `gpus_per_node` defaults to world_size up to 8 ranks, else 8
    when it divides world_size. With train.micro_batch_size=auto the micro batch is searched too
    (`plan.micro_batch`), and `strategy` (the config's own, not auto) restricts the search to it.
    Rows that change the numerics (zero3+zero++) are never chosen. Imports neither torch nor deepspeed.

    Raises UserError for a world size or memory below 1, and train's ConfigError when the global
    batch does not split over `world_size` ranks.
    """
    cluster, note = _cluster(world_size, device_memory_bytes, device_name, gpus_per_node)
    mode = checkpointing_mode(cfg.model.activation_checkpointing)
    requested = mode if mode != "off" else (None if allow_checkpointing else "off")
    search = cfg.train.micro_batch_size == "auto"
    workload = workload_from_config(cfg, world_size)
    layouts = None
    if strategy is not None:
        layouts = [_layout(cfg, cluster, workload, strategy)]
    plan = choose(spec_from_model_config(cfg.model), cluster, workload, requested,
                  global_batch=cfg.train.global_batch_size if search else None, exact_only=strategy is None,
                  layouts=layouts)
    plan.async_save = cfg.checkpoint.async_save
    if note:
        plan.assumptions.append(note)
    if plan.activation_checkpointing and mode == "off" and plan.choice:
        plan.reasons.append(f"The config has model.activation_checkpointing=off; the plan turns it "
                            f"{plan.activation_checkpointing} (set it to {plan.activation_checkpointing} to make "
                            "this explicit).")
    return plan


def estimate_for_run(cfg, world_size: int, device_memory_bytes: int, device_name: str = "cpu", *,
                     gpus_per_node: Optional[int] = None) -> MemoryEstimate:
    """The planner's estimate for exactly the run `cfg` describes (its strategy, offload flags and
    activation checkpointing; cfg.strategy.name resolved, not auto) on `world_size` ranks: what
    `zerodp train` prints at the start and holds the measurement against at the end."""
    cluster, _ = _cluster(world_size, device_memory_bytes, device_name, gpus_per_node)
    layout = _layout(cfg, cluster, workload_from_config(cfg, world_size))
    return estimate(spec_from_model_config(cfg.model), layout)


def _layout(cfg, cluster: Cluster, workload: Workload, strategy: Optional[str] = None) -> Layout:
    """The row of `strategy` (default: the one `cfg` names, not auto), with the config's offload, hybrid
    and checkpointing settings."""
    s, run = cfg.strategy, spec(strategy or cfg.strategy.name)
    name = run.on_one_device or run.name if cluster.world_size == 1 else run.name
    hybrid = cluster.nodes > 1 and run.hybrid_shard and s.hybrid_shard
    zeropp = run.zeropp  # ZeRO++ as the config sets it (its hpZ group taken as one node)
    return Layout(name, cluster, workload, s.offload_optimizer, s.offload_params,
                  checkpointing_mode(cfg.model.activation_checkpointing), hybrid=hybrid,
                  hpz=zeropp and s.hpz_partition_size != 1,
                  qwz=zeropp and s.quantized_weights, qgz=zeropp and s.quantized_gradients)


def _cluster(world_size: int, device_memory_bytes: int, device_name: str,
             gpus_per_node: Optional[int]) -> tuple[Cluster, Optional[str]]:
    """The cluster of `world_size` ranks with these devices, and a note when the device is not known."""
    if world_size < 1:
        raise UserError(f"world_size={world_size} must be at least 1")
    if device_memory_bytes <= 0:
        raise UserError(f"device memory {device_memory_bytes} bytes must be positive")
    per_node = gpus_per_node or (8 if world_size > 8 and world_size % 8 == 0 else world_size)
    if world_size % per_node:
        raise UserError(f"world_size={world_size} is not a multiple of gpus_per_node={per_node}")
    gpu, note = gpu_from_device_name(device_name, device_memory_bytes)
    # CPU ranks share the node's RAM: pass it, so the start-up peak of all of them is checked against it
    node_ram = device_memory_bytes * per_node if not gpu.cuda else None
    return Cluster(gpu=gpu, gpus_per_node=per_node, nodes=world_size // per_node, cpu_ram_bytes=node_ram), note

