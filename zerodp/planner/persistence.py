"""ZeRO-3's persistent parameters in memory: DeepSpeed marks every parameter of at most
stage3_param_persistence_threshold elements (1e5 by default) persistent, and a persistent parameter, once
its first forward has gathered it, stays gathered: whole, in the compute dtype, on every rank, beside
the rank's partition of it (deepspeed/runtime/zero/parameter_offload.py, mark_persistent_parameters).
Biases and norms are a rounding error on a large model; on a small one most parameters are persistent,
and a rank holds P + P/N of them, not P/N (the traffic model counts the same parameters:
zerodp.planner.traffic). Pure arithmetic, no torch.
"""

from __future__ import annotations

from zerodp.planner.traffic import _zero3_elements
from zerodp.planner.types import Layout, ModelSpec
from zerodp.planner.units import COMPUTE_BYTES


def persistent_param_bytes(model: ModelSpec, layout: Layout) -> int:
    """Bytes of the whole persistent parameters each rank keeps gathered, beside its partitions (on the
    GPU, offload_params or not): for DeepSpeed's ZeRO-3, the elements of every parameter of at most the
    workload's threshold (unpadded: a gathered parameter has its own shape) in the compute dtype; 0 for
    every engine that does not partition parameters this way. DeepSpeed's model-wide cap
    (stage3_model_persistence_threshold) is unlimited by default and not modelled."""
    w = layout.workload
    if layout.spec.traffic != "gather_per_use":  # the catalog's mark of ZeRO-3's partitioning
        return 0
    persistent, _, _ = _zero3_elements(model, 1, w.zero3_persistence_threshold, w.zero3_keep_window)
    return COMPUTE_BYTES[w.precision] * persistent
