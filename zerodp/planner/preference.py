"""DPO's reference model in the planner (train.objective=dpo, dpo.reference; zerodp.trainer.objective): what
it holds per rank, what its forward costs per step, what it gathers under zero3/fsdp. docs/memory_model.md,
"Preference tuning (DPO)".

* live: a second instance of the run's strategy holding the starting weights, never stepped. It holds what
  the engine holds of a model it sets up (measured, tests/distributed/test_planner_validation.py): the
  parameters as the engine stores them (fp32 under single/ddp/fsdp, whole or sharded; the compute dtype
  under zero1-3, sharded under zero3); DeepSpeed (zero1-3) also builds its optimizer's fp32 master
  partition (4P/N) and, where it allocates them at start-up, its gradient buffers (zero1 in bf16 with fp32
  accumulation: 4P; zero3: its gradient partition and a reduce bucket), none of which a frozen model
  needs (`avoidable_bytes`); ddp's reducer allocates its fp32 gradient buckets (4P) when it wraps the model.
  No gradient, no optimizer moment.
* adapters-off (model.lora): the policy with its adapters scaled by 0: nothing held.
* precomputed: one pass at step 0; then nothing held and no forward per step.

Per step, live and adapters-off run one more forward (no backward) over every row of every micro batch,
both sequences of each pair: 2 FLOPs per multiplying parameter per token plus attention's forward,
a third of full fine-tuning's figure. Under zero3/fsdp the live reference all-gathers its own shards once
per micro batch; adapters-off gathers the policy's base again for its extra forward. The forward runs
under no_grad before the policy's: its activations are transient (one layer's, and the logits), below the
policy's peak, so they add nothing to the peak as long as the policy's forward is the larger.

Torch-free; reads the planner's types, units and buckets only.
"""

from __future__ import annotations

import math
from typing import Optional

from zerodp.planner.buckets import bucket_bytes, grad_bytes
from zerodp.planner.persistence import persistent_param_bytes
from zerodp.planner.types import Layout, MemoryEstimate, ModelSpec
from zerodp.planner.units import COMPUTE_BYTES, aligned, side_by_side

REFERENCES = ("live", "adapters-off", "precomputed")
"""dpo.reference's values; None: no reference (SFT, or dpo.loss=simpo)."""


def reference_states(model: ModelSpec, layout: Layout, reference: Optional[str]) -> dict[str, int]:
    """Bytes per rank the reference holds for the whole run, by what they are: 'params' (its weights as the
    engine stores them), 'master' (DeepSpeed's fp32 master partition), 'grads' (gradient buffers DeepSpeed
    allocates at start-up), 'buckets' (ddp's reducer buckets, zero3's reduce bucket), 'offloaded' (what the
    engine's offload keeps in host memory instead). Every figure is 0 but
    for a live reference. The reference is the starting model without adapters (`model.frozen_params` +
    adapters would be a LoRA policy; a live reference is refused with model.lora)."""
    if reference != "live":
        return {"params": 0, "master": 0, "grads": 0, "buckets": 0, "offloaded": 0}
    s, w, n = layout.spec, layout.workload, layout.cluster.world_size
    P = model.params
    shard = math.ceil(P / n)
    held = shard if "params" in s.shards else P
    if s.fp32_params:  # single, ddp, fsdp: fp32 parameters are the engine's master weights
        buckets = 4 * P if s.traffic == "all_reduce" and n > 1 else 0  # DDP's reducer, at wrap time
        if s.offload_together and (layout.offload_optimizer or layout.offload_params):  # CPUOffloadPolicy
            return {"params": 0, "master": 0, "grads": 0, "buckets": buckets, "offloaded": 4 * held}
        return {"params": 4 * held, "master": 0, "grads": 0, "buckets": buckets, "offloaded": 0}
    cb, gb = COMPUTE_BYTES[w.precision], grad_bytes(w.precision, w.grad_reduce_dtype)
    grads = buckets = 0
    if s.zero_stage == 1 and w.precision == "bf16" and w.grad_reduce_dtype == "fp32":
        grads = 4 * P  # BF16_Optimizer's fp32 gradient buffer, allocated at initialize
    if s.zero_stage == 3:
        grads = gb * shard
        buckets = bucket_bytes(3, model.hidden, P, w.precision, w.grad_reduce_dtype, False, w.bucket_mb,
                               model.largest_param) if n > 1 else 0
    states = {"params": cb * held, "master": 4 * shard, "grads": grads, "buckets": buckets, "offloaded": 0}
    # offload (not measured for the reference): the engine's host copies as the policy's, its master partition
    # with offload_optimizer, its parameter partitions with offload_params under zero3
    if layout.offload_optimizer:
        states["offloaded"] += states["master"]
        states["master"] = 0
    if layout.offload_params and "params" in s.shards:
        states["offloaded"] += states["params"]
        states["params"] = 0
    # ZeRO-3's persistent parameters stay gathered on the device after the reference's first forward, as the
    # policy's do (offload_params or not)
    states["params"] += persistent_param_bytes(model, layout)
    return states


def reference_bytes(model: ModelSpec, layout: Layout, reference: Optional[str]) -> int:
    """Bytes per rank a DPO run's reference holds on the device beside the policy (`reference_states`, summed
    but for what it keeps in host memory)."""
    states = reference_states(model, layout, reference)
    return sum(states.values()) - states["offloaded"]


def unreached_bytes(model: ModelSpec, layout: Layout, reference: Optional[str]) -> int:
    """Of `reference_bytes`, what no tensor a strategy's state_bytes() walks holds: ddp's reducer buckets (its
    C++ reducer's own storage); what a run's end-of-run line leaves out of the predicted figure."""
    s = layout.spec
    return reference_states(model, layout, reference)["buckets"] if s.fp32_params else 0


def reference_offloaded(model: ModelSpec, layout: Layout, reference: Optional[str]) -> int:
    """Bytes per rank of the reference in host memory under offload (`reference_states`' 'offloaded')."""
    return reference_states(model, layout, reference)["offloaded"]


def avoidable_bytes(model: ModelSpec, layout: Layout, reference: Optional[str]) -> int:
    """Of `reference_bytes`, what a frozen model needs not hold: DeepSpeed's master partition and gradient
    buffers and the reducers' buckets, which the engines build for any model they set up."""
    states = reference_states(model, layout, reference)
    return states["master"] + states["grads"] + states["buckets"]  # on the device


def reference_flops_per_token(full_flops_per_token: float, reference: Optional[str]) -> float:
    """The reference's FLOPs per trained token each step: a forward (a third of `full_flops_per_token`, the
    full fine-tuning training figure) for live and adapters-off; 0 for precomputed and no reference."""
    return full_flops_per_token / 3 if reference in ("live", "adapters-off") else 0.0


def precompute_flops(full_flops_per_token: float, tokens: int) -> float:
    """dpo.reference=precomputed's one-off pass at step 0: a forward over every token of the data."""
    return full_flops_per_token / 3 * tokens


def reference_gather_sent(model: ModelSpec, layout: Layout, reference: Optional[str]) -> float:
    """Bytes each rank sends per optimizer step all-gathering the reference's weights under zero3/fsdp (the
    compute dtype, one ring all-gather of the whole model per micro batch: its forward only); 0 where
    parameters are whole or there is no reference forward."""
    s, w, n = layout.spec, layout.workload, layout.cluster.world_size
    if reference not in ("live", "adapters-off") or not s.gathers_in_forward or n == 1:
        return 0.0
    frozen = model.params if reference == "live" else model.frozen_params
    return (n - 1) / n * COMPUTE_BYTES[w.precision] * frozen * w.grad_accum_steps


REFERENCE_WORDS = {
    "live": "a frozen copy of the starting weights under the row's strategy (its bytes in 'refer'), a forward "
            "per micro batch",
    "adapters-off": "the base with the adapters off: no copy, a forward per micro batch",
    "precomputed": "log-probs computed in one pass at step 0 (a forward over the data): nothing held, no forward "
                   "per step",
}
"""What each dpo.reference costs, as `zerodp plan --objective dpo`'s header says it."""


def comparison_lines(dpo_rows: list[MemoryEstimate], sft_rows: list[MemoryEstimate],
                     reference: Optional[str]) -> list[str]:
    """The side-by-side table `zerodp plan --objective dpo` prints: each row's memory per GPU, whether it fits and
    its step, under SFT and DPO (each at its own micro batch and checkpointing), and the reference's share."""
    sft = {e.name: e for e in sft_rows}
    rows = side_by_side(dpo_rows, sft_rows, ("SFT", "SFT"), ("DPO", "DPO"), ("refer", "avoidable"),
                        lambda e: (f"{e.reference_bytes / 1e9:.1f}", f"{e.reference_avoidable_bytes / 1e9:.1f}"))
    lines = [f"SFT vs DPO with dpo.reference={reference} (total GB per GPU, each row at its own checkpointing; "
             f"refer: what the reference holds, avoidable: of it, the buffers the engine builds for any model and a "
             f"frozen one never uses):"]
    lines += aligned(rows)
    only_sft = [e.name for e in dpo_rows if not e.fits and sft.get(e.name) and sft[e.name].fits]
    if only_sft:
        lines.append(f"Only without the reference (SFT): {', '.join(only_sft)}.")
    return lines
