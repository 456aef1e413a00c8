"""The DeepSpeed config a ZeRO run gets, generated from zerodp's own config by the pure
`deepspeed_config`: the keys zerodp owns (batch, stage, precision, clipping, optimizer, ZeRO++) come from
zerodp's settings, and the user's `strategy.deepspeed` deep-merges over the rest; a key that contradicts
a zerodp setting is refused, naming the zerodp setting to change instead. Needs no DeepSpeed."""

from __future__ import annotations

import copy

from zerodp.config import Config
from zerodp.errors import UserError
from zerodp.planner.buckets import deepspeed_buckets
from zerodp.planner.models import spec_from_model_config
from zerodp.strategies.zeropp import hpz_partition_size

# Keys zerodp sets from its own config: (path in the DeepSpeed config, the zerodp setting to change instead).
OWNED = {
    ("train_micro_batch_size_per_gpu",): "train.micro_batch_size",
    ("gradient_accumulation_steps",): "train.global_batch_size (accumulation = global / (micro x world))",
    ("train_batch_size",): "train.global_batch_size",
    ("zero_optimization", "stage"): "strategy.name (zero1 | zero2 | zero3)",
    ("bf16", "enabled"): "train.precision",
    ("bfloat16", "enabled"): "train.precision",
    ("fp16", "enabled"): "train.precision",
    ("gradient_clipping",): "optim.grad_clip",
    ("optimizer",): "optim.* (zerodp builds AdamW itself)",
    ("scheduler",): "optim.lr / warmup_steps / decay_steps (zerodp sets the lr every step)",
    ("zero_optimization", "zero_hpz_partition_size"): "strategy.hpz_partition_size",
    ("zero_optimization", "zero_quantized_weights"): "strategy.quantized_weights",
    ("zero_optimization", "zero_quantized_gradients"): "strategy.quantized_gradients",
    ("data_types", "grad_accum_dtype"): "strategy.grad_reduce_dtype",
    ("communication_data_type",): "strategy.grad_reduce_dtype",
}


# DeepSpeed defaults that change the numerics or the host syncs, set explicitly so that a DeepSpeed release
# that changes its default changes nothing here (0.19 turned bf16.check_grad_overflow on and made
# gradient_clipping default to 1.0, which zerodp sets from optim.grad_clip). Each is the value zerodp's
# equivalence with single and ddp was established with; tests/unit/test_deepspeed_config.py reads them
# back through DeepSpeed's own config parser.
ENGINE_PINNED = {
    "prescale_gradients": False,  # divide after the reduction (as ddp's mean), not before
    "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean",  # the mean over ranks, as every zerodp strategy reduces
    "torch_autocast": {"enabled": False},  # the engine holds 16-bit parameters itself; no autocast on top
    "managed_gradient_accumulation": True,  # DeepSpeed steps at the accumulation boundary zerodp's batch sets
}
BF16_PINNED = {
    # bf16 has fp32's range and no loss scale: the overflow check (on by default since 0.19, ZeRO-1/2)
    # would only bring a flag to the host every step (stage_1_and_2.py has_overflow: .item()).
    "check_grad_overflow": False,
    "immediate_grad_update": False,
    "bf16_master_weights_and_grads": False,  # fp32 master weights and gradients
    "bf16_optimizer_states": False,  # fp32 AdamW moments
}
ZERO_PINNED = {
    "compute_grad_norm": True,  # zerodp reports it every step, and clipping needs it
    "reduce_scatter": True,
    "allgather_partitions": True,
    "use_multi_rank_bucket_allreduce": True,
    "round_robin_gradients": False,
    "load_from_fp32_weights": True,  # resume from the fp32 master weights, not the 16-bit copy
    "enable_sanity_checks": False,  # its checks bring values to the host every step
    "zero_quantized_nontrainable_weights": False,
}


def reduce_dtypes(precision: str, grad_reduce_dtype: str) -> dict:
    """DeepSpeed's gradient accumulation and communication dtypes for `strategy.grad_reduce_dtype`. Both
    follow the parameter dtype unless set (engine.py: `get_data_types`, `communication_data_type`): bf16
    gets them in fp32 by default, as ddp and fsdp reduce. fp16 keeps DeepSpeed's loss-scaled fp16 path
    and fp32 has nothing to choose."""
    if precision != "bf16":
        return {}
    return {"data_types": {"grad_accum_dtype": grad_reduce_dtype}, "communication_data_type": grad_reduce_dtype}


def generated_config(cfg: Config, stage: int, grad_accum_steps: int, world_size: int,
                     ranks_per_node: int | None = None) -> dict:
    """The DeepSpeed config implied by zerodp's config alone (before `strategy.deepspeed` overrides).
    `ranks_per_node`: the ranks of one node, where known (see `ranks_per_node`); ZeRO++ is checked
    against it."""
    s, t = cfg.strategy, cfg.train
    hpz = hpz_partition_size(s, stage, world_size, ranks_per_node)
    if s.offload_params and stage != 3:
        raise UserError(
            f"strategy.offload_params=true needs parameter sharding, which zero{stage} does not do; "
            "use strategy.name=zero3 (or fsdp), or set strategy.offload_params=false")
    model = spec_from_model_config(cfg.model)
    zero: dict = {
        "stage": stage,
        **deepspeed_buckets(stage, model.hidden, model.params, t.precision, s.bucket_size_mb, model.largest_param),
        "overlap_comm": s.overlap_comm,
        "contiguous_gradients": s.contiguous_gradients,
        "zero_hpz_partition_size": hpz,
        "zero_quantized_weights": s.quantized_weights,
        "zero_quantized_gradients": s.quantized_gradients,
        **ZERO_PINNED,
    }
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if s.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    fp16: dict = {"enabled": t.precision == "fp16"}
    if t.precision == "fp16":
        # Dynamic loss scaling with torch.amp.GradScaler's defaults: start at 2**16, halve on overflow,
        # double after 2000 clean steps.
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=2000, hysteresis=1,
                    consecutive_hysteresis=False, min_loss_scale=1)
    fp16.update(auto_cast=False, fp16_master_weights_and_grads=False)
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": t.micro_batch_size * grad_accum_steps * world_size,
        "gradient_clipping": cfg.optim.grad_clip,
        "bf16": {"enabled": t.precision == "bf16", **BF16_PINNED},
        "fp16": fp16,
        "zero_optimization": zero,
        **ENGINE_PINNED,
        # zerodp hands DeepSpeed torch's AdamW (or DeepSpeedCPUAdam when offloading, see `_optimizer`).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        **reduce_dtypes(t.precision, s.grad_reduce_dtype),
        # No timers: the throughput timer (on by default, synchronised) waits for the device at every
        # micro batch (deepspeed/utils/timer.py ThroughputTimer.start/stop); the breakdowns time each phase.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "memory_breakdown": False,
        "flops_profiler": {"enabled": False},
    }


def deepspeed_config(cfg: Config, stage: int, grad_accum_steps: int, world_size: int,
                     ranks_per_node: int | None = None) -> dict:
    """The generated config with `cfg.strategy.deepspeed` deep-merged over it.

    Raises UserError when a user key contradicts one zerodp sets itself (see OWNED), naming the key,
    both values and the zerodp setting to change instead."""
    generated = generated_config(cfg, stage, grad_accum_steps, world_size, ranks_per_node)
    extra = cfg.strategy.deepspeed or {}
    for path, instead in OWNED.items():
        found, user = _lookup(extra, path)
        if not found:
            continue
        key = ".".join(path)
        generates, ours = _lookup(generated, path)
        if not generates and path[0] in ("data_types", "communication_data_type"):
            continue  # zerodp chooses the gradient dtypes only in bf16; fp32 and fp16 keep DeepSpeed's keys
        if path[0] in ("optimizer", "scheduler"):
            raise UserError(f"strategy.deepspeed.{key} is not supported: zerodp owns the {key}; "
                            f"remove the key and set {instead}")
        if path[0] == "bfloat16":
            ours = generated["bf16"]["enabled"]
        if user != ours:
            raise UserError(f"strategy.deepspeed.{key}={user!r} contradicts zerodp's {key}={ours!r}; "
                            f"remove the key and set {instead}")
    if "offload_param" in extra.get("zero_optimization", {}) and stage != 3:
        raise UserError(f"strategy.deepspeed.zero_optimization.offload_param needs zero3, not zero{stage}; "
                        "use strategy.name=zero3 or remove the key")
    return _merge(generated, extra)


def _lookup(d: dict, path: tuple) -> tuple[bool, object]:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return False, None
        d = d[k]
    return True, d


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out
