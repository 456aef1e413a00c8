"""Deterministic kernels for `train.deterministic`: the same inputs give the same bits on CUDA too.

On CPU zerodp's training is bit-reproducible as it is (a resumed run ends bit-identical to an
uninterrupted one; the tests check it). On CUDA three things can change the bits from run to run:
kernels that accumulate with atomics (the backward of the flash and memory-efficient attention
kernels, cuDNN's attention), cuBLAS picking its reduction split from a workspace shared between
streams, and cuDNN autotuning. `apply(True)` removes all three:

- `torch.use_deterministic_algorithms(True)` (not `warn_only`: with `warn_only` the attention backward
  kernels only warn and keep their atomics). PyTorch then runs flash attention's backward in its
  deterministic mode, the memory-efficient kernel's backward without splitting the keys, and never
  picks cuDNN attention; an op with no deterministic CUDA kernel raises a RuntimeError naming itself
  instead of running. torch.empty's memory is filled (NaN) so that it never holds stale values.
- `CUBLAS_WORKSPACE_CONFIG=:4096:8` (8 workspaces of 4 MiB), which cuBLAS needs for reproducible
  results; read when the first cuBLAS handle is made, so `apply` must run before any CUDA matmul.
- `torch.backends.cudnn.deterministic = True`, `benchmark = False`.

The cost is speed, mostly in the attention backward; zerodp has not measured it on GPUs yet.
"""

from __future__ import annotations

import os

import torch

from zerodp.errors import UserError

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
_REPRODUCIBLE_CUBLAS = (":4096:8", ":16:8")  # the two values cuBLAS documents (and PyTorch accepts)


def apply(deterministic: bool) -> None:
    """With `deterministic`, switch this process to deterministic kernels (see the module docstring);
    without, change nothing. Call it first in a training process, before CUDA computes anything.

    Raises UserError when the environment already sets CUBLAS_WORKSPACE_CONFIG to a value that is not
    reproducible (PyTorch would otherwise stop at the first matmul with a RuntimeError)."""
    if not deterministic:
        return
    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if current is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    elif current not in _REPRODUCIBLE_CUBLAS:
        raise UserError(f"train.deterministic=true needs CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE_CONFIG} (or :16:8) "
                        f"but the environment sets {current!r}; unset it, or set train.deterministic=false")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
