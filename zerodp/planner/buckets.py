"""The DeepSpeed bucket sizes zerodp runs ZeRO with, and the bytes they hold: one rule for the generated
DeepSpeed config (zerodp.strategies.deepspeed_config) and the planner's memory model. Pure arithmetic.

With `strategy.bucket_size_mb` unset each stage gets what DeepSpeed's authors chose for it:

* zero1/2: `reduce_bucket_size` and `allgather_bucket_size` at DeepSpeed's own default, 5e8 elements
  (deepspeed/runtime/zero/config.py, and the stage 1/2 templates of its autotuner), but never more than
  the model's own elements: DeepSpeed allocates the bucket whole, and one larger than every gradient
  together holds nothing more.
* zero3: `reduce_bucket_size` hidden^2 and `stage3_prefetch_bucket_size` 0.9 hidden^2, as DeepSpeed's
  autotuner sets them for stage 3 from the model's hidden size (deepspeed/autotuning/autotuner.py), the
  reduce bucket at least the largest parameter (`deepspeed_buckets`). Its
  third such rule, `stage3_param_persistence_threshold` 10 hidden, is not taken: DeepSpeed's default 1e5
  stays, with the traffic the planner counts for it.

A `strategy.bucket_size_mb` the user sets is kept for every stage: MiB over the compute element size.
"""

from __future__ import annotations

from typing import Optional

DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default reduce_bucket_size and allgather_bucket_size (elements)."""
ALLREDUCE_FALLBACK_ELEMENTS = 500_000_000
"""The engine's MEMORY_OPT_ALLREDUCE_SIZE: what BF16_Optimizer's all-reduce flattens at a time."""


def deepspeed_buckets(stage: int, hidden: int, params: int, precision: str, bucket_mb: Optional[int] = None,
                      largest_param: int = 0) -> dict[str, int]:
    """The zero_optimization keys of the buckets: elements, as DeepSpeed counts them. ZeRO-3's reduce bucket
    is never smaller than `largest_param`: with bf16 gradients reduced in fp32, DeepSpeed 0.19.8's ZeRO-3
    stalled in the backward (2 CPU ranks, gloo) when one parameter was larger than the bucket."""
    if bucket_mb is not None:
        elements = bucket_mb * 2**20 // (4 if precision == "fp32" else 2)
        if stage == 3:
            return {"reduce_bucket_size": max(elements, largest_param), "allgather_bucket_size": elements}
        return {"reduce_bucket_size": elements, "allgather_bucket_size": elements}
    if stage == 3:
        return {"reduce_bucket_size": max(hidden * hidden, largest_param),
                "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden)}
    elements = min(DEEPSPEED_BUCKET_ELEMENTS, params + params % 2)  # all-gather buckets: a multiple of 2
    return {"reduce_bucket_size": elements, "allgather_bucket_size": elements}


def bf16_optimizer(stage: int, precision: str, grad_reduce_dtype: str) -> bool:
    """Whether DeepSpeed runs this as its BF16_Optimizer instead of its ZeRO optimizer: bf16 parameters with
    fp32 gradient accumulation under stage 1 (engine.py, `_do_optimizer_sanity_check`), without offload."""
    return stage == 1 and precision == "bf16" and grad_reduce_dtype == "fp32"


def bucket_bytes(stage: int, hidden: int, params: int, precision: str, grad_reduce_dtype: str,
                 offload_optimizer: bool, bucket_mb: Optional[int] = None, largest_param: int = 0,
                 trainable: Optional[int] = None) -> int:
    """Bytes the reduction buffers hold at their peak on one rank (world size > 1):

    * zero1/2 (DeepSpeedZeroOptimizer): two reduce buckets (one fills while the other is reduced,
      overlap_comm), allocated in each backward: in the accumulation dtype under zero1, in the 16-bit
      gradients' under zero2;
    * zero1 as BF16_Optimizer: no buckets; at the boundary the engine all-reduces the fp32 gradients
      through flat copies of at most 5e8 elements;
    * zero3: one reduce bucket in the communication dtype.

    The buckets are sized from `params`, as zerodp.strategies.deepspeed_config sizes them; BF16_Optimizer's
    flat copies hold gradients, of the `trainable` parameters only (a LoRA run's adapters; None: `params`)."""
    elements = deepspeed_buckets(stage, hidden, params, precision, bucket_mb, largest_param)["reduce_bucket_size"]
    fp32 = precision == "fp32" or grad_reduce_dtype == "fp32"
    if bf16_optimizer(stage, precision, grad_reduce_dtype) and not offload_optimizer:
        return 4 * min(params if trainable is None else trainable, ALLREDUCE_FALLBACK_ELEMENTS)
    if stage == 3:
        return elements * (4 if fp32 else 2)
    # ZeRO-1 stages the fp32 accumulator in its buckets, ZeRO-2 the 16-bit gradients (stage_1_and_2.py)
    return 2 * elements * (4 if precision == "fp32" or (stage == 1 and fp32) else 2)


def grad_bytes(precision: str, grad_reduce_dtype: str) -> int:
    """Bytes per element of ZeRO's accumulated and reduced gradients: 4 in fp32 and with bf16 reduced in
    fp32 (DeepSpeed's data_types.grad_accum_dtype and communication_data_type), else 2."""
    return 4 if precision == "fp32" or (precision == "bf16" and grad_reduce_dtype == "fp32") else 2
