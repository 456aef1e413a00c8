"""Background saves for the ZeRO strategies, in DeepSpeed's own layout.

DeepSpeed 0.19's own decoupled engine (DecoupledCheckpointEngine) runs its writer in a second process
over FastCheckpointEngine's accelerator I/O, which CPU runs lack. What every engine goes through is the
checkpoint-engine interface `engine.save_checkpoint` calls for each file (`checkpoint_engine.save(
state_dict, path)`): zerodp puts its own engine there for the call, which copies each state dict's
tensors into host buffers (reused from save to save) and keeps the path; the background writer then
hands each copy to DeepSpeed's live engine (`torch.save`, the same files, names and pickles), so
DeepSpeed's zero_to_fp32 and `zerodp convert` read the folder as they read a synchronous one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch


class SnapshotEngine:
    """Collects host copies of what `engine.save_checkpoint` writes; `inner` (DeepSpeed's
    CheckpointEngine) does everything else (every other method is its) and writes the copies later."""

    def __init__(self, inner, buffers):
        self.inner, self.buffers = inner, buffers
        self.files: list[tuple[object, str]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def save(self, state_dict, path: str):
        self.files.append((self._copy(state_dict, Path(path).name), path))

    def _copy(self, value, key: str):
        if torch.is_tensor(value):
            return self.buffers.copy(key, value, dtype=None)
        if isinstance(value, dict):
            items = [(k, self._copy(v, f"{key}/{k}")) for k, v in value.items()]
            return dict(items) if type(value) is dict else _same_type(value, items)
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._copy(v, f"{key}/{i}") for i, v in enumerate(value))
        return copy.deepcopy(value)  # small objects (config, loss scaler, counters): frozen at the snapshot

    def preserves_storage_sharing(self):
        return False  # the host copies are compact already: DeepSpeed need not clone on the device first

    def write(self) -> None:
        """Write every collected file with DeepSpeed's own engine (the background thread)."""
        for state, path in self.files:
            self.inner.save(state, path)
        self.files = []


def _same_type(value: dict, items: list):
    try:
        return type(value)(items)  # OrderedDict and the like
    except TypeError:
        return dict(items)


def snapshot(strategy, ckpt_dir: Path, buffers, tag: str) -> Callable[[], None]:
    """`engine.save_checkpoint` with `SnapshotEngine` in place of the engine's checkpoint engine: its
    collectives and small files now, the state files' writing returned for the background thread."""
    engine = strategy.model
    live = engine.checkpoint_engine
    snap = SnapshotEngine(live, buffers)
    engine.checkpoint_engine = snap
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False, exclude_frozen_parameters=True)
    finally:
        engine.checkpoint_engine = live
    return snap.write
