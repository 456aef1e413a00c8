"""The memory planner: will it fit, and how should I run it?

Pure arithmetic on the model's shape, the cluster and the step (docs/memory_model.md): no process
group, no GPU, and neither torch nor deepspeed is imported, so `zerodp plan` answers instantly and
`strategy: auto` can plan before anything is built.

    estimate(model, layout) -> MemoryEstimate     one strategy's memory per GPU and step time (memory.py,
                                                  composing the formula modules: activations.py, lora.py,
                                                  moe.py, persistence.py, traffic.py; the types they share:
                                                  types.py)
    choose(model, cluster, workload) -> Plan      every strategy, the choice, and why (choose.py; the
                                                  rows, search and pick: rows.py; the sentences: reasons.py)
    plan_for_training(cfg, world_size, device_memory_bytes, device_name) -> Plan

Layer: above config, the model specs and the noise-scale math (zerodp.telemetry.grad_noise); torch-
free. The CLI, the trainer and telemetry import it.
"""

from zerodp.planner.choose import Plan, choose
from zerodp.planner.hardware import GPUS, Cluster, GpuSpec, gpu_preset
from zerodp.planner.memory import (
    Layout,
    MemoryEstimate,
    Workload,
    activation_bytes,
    engine_states,
    estimate,
    model_states,
)
from zerodp.planner.models import (
    PRESETS,
    ModelSpec,
    gpt_param_count,
    preset,
    spec_from_arch,
    spec_from_hf_config,
    spec_from_model_config,
    spec_from_params,
)
from zerodp.planner.training import plan_for_training

__all__ = [
    "Plan", "choose", "GPUS", "Cluster", "GpuSpec", "gpu_preset", "Layout", "MemoryEstimate", "Workload",
    "activation_bytes", "engine_states", "estimate", "model_states", "PRESETS", "ModelSpec", "gpt_param_count",
    "preset", "spec_from_arch", "spec_from_hf_config", "spec_from_model_config", "spec_from_params",
    "plan_for_training",
]
