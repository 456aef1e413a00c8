"""Loading `.pt` pickles without running code from them.

`torch.load(weights_only=True)` only rebuilds tensors and plain containers; anything else a pickle
asks for must be allowlisted. DeepSpeed's ZeRO files need a handful of DeepSpeed types (found with
pickletools on files written by DeepSpeed 0.19.8). We never import DeepSpeed: each allowed type is
a stand-in class registered under DeepSpeed's dotted name, which only stores the pickled fields.
A pickle asking for any other global (os.system, builtins.eval, ...) is refused before anything of
it runs, with a CheckpointError naming the file and the global.
"""

from __future__ import annotations

import argparse
import pickle
import re
from pathlib import Path

import torch

from zerodp.errors import CheckpointError


class _Fields:
    """Stand-in for a pickled DeepSpeed object: keeps its attributes, has no behaviour."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LossScaler(_Fields):
    pass


class DynamicLossScaler(_Fields):
    pass


class FragmentAddress(_Fields):
    pass


class ZeroStageEnum(int):
    """DeepSpeed pickles its ZeRO stage enum as ZeroStageEnum(value): an int is all we need."""


# (stand-in, the dotted name DeepSpeed's pickles use). The whole list: extend only with plain-data types.
DEEPSPEED_ALLOWLIST: list[tuple[type, str]] = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (argparse.Namespace, "argparse.Namespace"),  # engines built with `args=` pickle them in model states
]

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|unrecognized function (\S+)|got <class '([\w.]+)'>")


def safe_torch_load(path: Path, mmap: bool = True) -> dict:
    """torch.load(weights_only=True) with the DeepSpeed allowlist; CheckpointError on anything else.

    With mmap=True tensors stay in the file until touched, so opening a large shard costs little."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(DEEPSPEED_ALLOWLIST):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = _GLOBAL.search(str(e))
        what = next((g for g in m.groups() if g), None) if m else None
        if what:
            raise CheckpointError(
                f"{path} asks to load the global {what}, which is not on zerodp's allowlist of checkpoint "
                f"types; refusing to load it (a checkpoint must contain only tensors and plain data)"
            ) from None
        raise CheckpointError(f"{path} is not a loadable torch file ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is truncated or corrupted ({first})") from None
