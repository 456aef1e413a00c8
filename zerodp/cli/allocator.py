"""The CUDA caching allocator's default setting for zerodp's processes: expandable segments.

Without them the allocator carves fixed-size segments, and a run whose tensors change size (FSDP's and
ZeRO-3's gathered units, the gradient buckets, a growing generation cache) strands memory in
fragments: reserved far above allocated, an out-of-memory error with memory free. Expandable segments
grow one mapping per stream instead (torch's notes on CUDA memory management; torchtitan's run script
sets the same). The allocator reads its setting once, when CUDA first allocates, from
PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF (c10/cuda/CUDAAllocatorConfig.h), so the entry point
sets it before torch is imported, and only where the user set neither (or the ROCm spelling).

Layer: the top (the command line); torch-free.
"""

from __future__ import annotations

from typing import MutableMapping

DEFAULT = "expandable_segments:True"
VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
USERS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""Where a user's own allocator setting may be: any one of them leaves the allocator to it."""


def default_allocator(environ: MutableMapping[str, str]) -> str | None:
    """Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in `environ` unless the user set an
    allocator variable (even empty: a deliberate choice); return what was set, or None."""
    if any(name in environ for name in USERS):
        return None
    environ[VARIABLE] = DEFAULT
    return DEFAULT
