"""LoRA in the planner: a run that trains low-rank adapters on a frozen base, priced apart from the base.

The adapters' names and shapes come from `zerodp.models.lora_spec` (`adapter_shapes`, the one description
the model is built from); here is what they change in the memory and time model (docs/memory_model.md,
"LoRA: frozen base, trained adapters"):

* states: the frozen base is stored in the compute dtype (2 bytes in bf16/fp16, 4 in fp32), whole on
  every rank under single/ddp/zero1/zero2 and sharded under zero3/fsdp, with no gradient and no optimizer
  state; the adapters are held as each engine holds trained parameters (`memory.engine_states` of the
  adapter count);
* activations: each adapted module keeps its x A product (tokens x rank) for B's gradient, the input to
  A being the base layer's own (kept anyway); with dropout also the dropped input and its mask;
* communication: gradients are reduced (all-reduced, reduce-scattered) for the adapters only; zero3 and
  fsdp still all-gather the whole base, forward and backward;
* compute: the frozen weights need no weight gradient (4 FLOPs per parameter per token instead of 6), the
  adapters cost 6 per parameter; the optimizer step and offload traffic cover the adapters only.

Torch-free; reads the planner's types and units only (zerodp.planner.models imports `with_lora`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from zerodp.errors import UserError
from zerodp.models.lora_spec import LoraSpec, adapter_count, adapter_shapes, check_targets
from zerodp.planner.types import MemoryEstimate, ModelSpec, Workload
from zerodp.planner.units import COMPUTE_BYTES, aligned, human_count, side_by_side


def with_lora(model: ModelSpec, spec: LoraSpec, where: str = "model.lora.targets") -> ModelSpec:
    """`model` (full fine-tuning) with `spec`'s adapters added: `params` counts them too, `trainable_params`
    is them alone. ConfigError when a target names no linear layer; UserError for a model without its
    layers' shapes (a --params guess)."""
    if model.arch is None:
        raise UserError("LoRA needs the model's layer shapes to size the adapters; describe the model with "
                        "--model, --hf-config or --config instead of --params")
    check_targets(model.arch, spec, where)
    base = without_lora(model)
    count = adapter_count(base.arch, spec)
    return dataclasses.replace(base, params=base.params + count, active_params=base.active_params + count,
                               trainable_params=count, lora=spec)


def without_lora(model: ModelSpec) -> ModelSpec:
    """The same model fully fine-tuned: the adapters gone, every parameter trained."""
    if model.lora is None:
        return model
    count = model.trainable_params
    return dataclasses.replace(model, params=model.params - count, active_params=model.active_params - count,
                               trainable_params=None, lora=None)


def param_shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape: the architecture's, and the adapters' under LoRA."""
    shapes = dict(model.arch.param_shapes())
    if model.lora is not None:
        shapes.update(adapter_shapes(model.arch, model.lora))
    return shapes


def trainable_shapes(model: ModelSpec) -> Optional[dict[str, tuple[int, ...]]]:
    """The adapters' names and shapes under LoRA; None in full fine-tuning (every parameter trains)."""
    return adapter_shapes(model.arch, model.lora) if model.lora is not None else None


def frozen_bytes(model: ModelSpec, world_size: int, sharded: bool, precision: str) -> int:
    """Bytes per rank of the frozen base: its storage in the compute dtype (2 bytes in bf16/fp16, 4 in fp32),
    the largest shard ceil(P_f/N) under a strategy that shards parameters, else whole; 0 in full fine-tuning."""
    frozen = model.frozen_params
    return COMPUTE_BYTES[precision] * (math.ceil(frozen / world_size) if sharded else frozen)


def block_adapter_params(model: ModelSpec) -> int:
    """Adapter elements of the block with the most: what a zero3/fsdp unit gathers and reduces beside the
    block's base weights; 0 in full fine-tuning."""
    if model.lora is None:
        return 0
    prefix, per_block = model.arch.block_prefix + ".", {}
    for name, shape in adapter_shapes(model.arch, model.lora).items():
        layer = int(name[len(prefix):].split(".")[0])
        per_block[layer] = per_block.get(layer, 0) + math.prod(shape)
    return max(per_block.values(), default=0)


def adapter_activation_bytes(model: ModelSpec, w: Workload, mode: str) -> int:
    """What the adapters keep for backward beyond the base model's activations, for one micro batch: per
    adapted module the x A product (tokens x rank, compute dtype) that B's gradient needs, and with
    model.lora.dropout the dropped input (tokens x in) and its 1-byte mask. A's input is the base layer's
    input, already counted. Every block keeps them (checkpointing off or selective: x A is a matmul
    output); with full checkpointing only the block being recomputed. 0 in full fine-tuning."""
    spec = model.lora
    if spec is None:
        return 0
    tokens, cb = w.micro_batch * w.seq_len, COMPUTE_BYTES[w.precision]
    per_block = 0
    for _, fan_in in _block_modules(model):
        per_block += tokens * spec.rank * cb + (tokens * fan_in * (cb + 1) if spec.dropout else 0)
    return per_block * (1 if mode == "full" else model.n_layer)


def _block_modules(model: ModelSpec) -> list[tuple[int, int]]:
    """(out, in) of each adapted module of block 0."""
    shapes = adapter_shapes(model.arch, model.lora)
    first = f"{model.arch.block_prefix}.0."
    return [(shapes[f"{name[:-len('.lora_A.weight')]}.lora_B.weight"][0], shape[1])
            for name, shape in shapes.items() if name.startswith(first) and name.endswith(".lora_A.weight")]


def flops_per_token(model: ModelSpec, base_flops: float, seq_len: int) -> float:
    """Training FLOPs per token of a LoRA run, from the full fine-tuning figure `base_flops` (6 per
    multiplying parameter + attention's 12 L s q_dim): the frozen weights compute the forward (2) and their
    input's gradient (2) but no weight gradient, so 4 per multiplying parameter; the adapters 6 per
    parameter. `base_flops` unchanged in full fine-tuning."""
    if model.lora is None:
        return base_flops
    attention = 12.0 * model.n_layer * seq_len * model.q_dim
    multiplying = (base_flops - attention) / 6
    return 4 * multiplying + attention + 6 * model.trainable_params


def describe(model: ModelSpec) -> str:
    """'LoRA rank 16, alpha 32, targets q_proj, v_proj: 16.4M trainable (0.02%), the rest frozen'."""
    s = model.lora
    return (f"LoRA rank {s.rank}, alpha {s.alpha:g}, targets {', '.join(s.targets)}: "
            f"{human_count(model.trainable_params)} trainable adapter parameters "
            f"({model.trainable_params / model.params:.2%}), {human_count(model.frozen_params)} frozen")


def comparison_lines(lora_rows: list[MemoryEstimate], full_rows: list[MemoryEstimate]) -> list[str]:
    """The side-by-side table `zerodp plan` prints under a LoRA plan: each row's memory per GPU and whether
    it fits, fully fine-tuned and with the adapters (each at its own micro batch and checkpointing)."""
    full = {e.name: e for e in full_rows}
    lines = ["Full fine-tuning vs LoRA (total GB per GPU, each row at its own checkpointing):"]
    lines += aligned(side_by_side(lora_rows, full_rows, ("full FT", "FT"), ("LoRA", "LoRA")))
    fits_lora = [e.name for e in lora_rows if e.fits and not (full.get(e.name) and full[e.name].fits)]
    if fits_lora:
        lines.append(f"Only with the adapters: {', '.join(fits_lora)}.")
    return lines


__all__ = ["with_lora", "without_lora", "param_shapes", "trainable_shapes", "frozen_bytes", "block_adapter_params",
           "adapter_activation_bytes", "flops_per_token", "describe", "comparison_lines"]
