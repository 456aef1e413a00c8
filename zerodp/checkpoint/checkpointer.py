"""The run's checkpoints as the loop and the fault handling share them: one `Checkpointer` per run.

It saves (collective, through `store.save`: atomic publication, then retention keeps the newest
`checkpoint.keep_last` intact ones), restores where the start plan says (a checkpoint, or
`model.init_from` weights), and tells the peer watch what it needs while a collective holds the main
thread: whether a checkpoint is being written (`busy`: a signal then waits for it) and which one is the
newest complete one (`newest`, the name `latest` holds), named in the line a blocked rank leaves with.
"""

from __future__ import annotations

import time
from pathlib import Path

from zerodp.checkpoint import store


class Checkpointer:
    """Saving, retention, `latest` and the run's time spent saving, for one strategy in one out_dir."""

    def __init__(self, strategy, out_dir: str | Path, meta: dict, every: int, keep_last: int, max_steps: int,
                 async_save: bool = False, enabled: bool = True):
        self.strategy, self.out_dir, self.meta = strategy, Path(out_dir), meta
        self.enabled = enabled
        """checkpoint.enabled: false saves nothing, not even at the end or on preemption."""
        self.every, self.keep_last, self.max_steps = every, keep_last, max_steps
        self.background = None
        """The background saves (checkpoint.async_save; collective to build: a gloo group of its own)."""
        if async_save:
            from zerodp.checkpoint.background import Background

            self.background = Background(strategy, store.checkpoint_root(out_dir), meta, keep_last)
        self.busy = False
        """A checkpoint is being written (read by the peer watch from its own thread)."""
        self.save_s = 0.0
        """Seconds spent in `save` over the run."""

    def due(self, step: int) -> bool:
        """Whether the loop saves after step `step` (1-based): every checkpoint.every steps and at the end.

        Collective with background saves (every rank asks at every step): a save in flight whose files
        are complete on every rank is published here, and one that failed raises CheckpointError."""
        if self.background is not None:
            self.background.poll()
        return self.saves_after(step)

    def saves_after(self, step: int) -> bool:
        """Whether the loop will save after step `step`, by the schedule alone (no collective)."""
        if not self.enabled:
            return False
        return step == self.max_steps or bool(self.every and step % self.every == 0)

    @property
    def waited_s(self) -> float:
        """Seconds save steps waited for the previous background save (part of `save_s`)."""
        return self.background.waited_s if self.background is not None else 0.0

    def finish(self) -> None:
        """Collective: let a background save in flight finish and publish it (the end of the run)."""
        if self.background is not None:
            self.busy = True
            t0 = time.perf_counter()
            try:
                self.background.wait()
            finally:
                self.save_s += time.perf_counter() - t0
                self.busy = False

    def restore(self, resume_from: Path | None, init_from: str | None, world_size: int) -> dict:
        """Collective: load the `init_from` weights (with a fresh AdamW), then the checkpoint `resume_from`
        (any strategy, any world size saved it): both for a LoRA run, whose checkpoints hold the adapters
        and whose base comes from init_from; at step 0 a LoRA run's adapters may come from a PEFT folder
        (model.lora.init_from); return the trainer state ({} at step 0)."""
        if init_from:
            store.init_from(self.strategy, init_from)
        if resume_from is not None:
            return store.load(self.strategy, resume_from, world_size)
        lora = (self.meta.get("config") or {}).get("model", {}).get("lora") or {}
        if lora.get("init_from"):  # model.lora.init_from: the adapters from a PEFT folder, over the base
            from zerodp.convert.peft import load_adapters

            load_adapters(self.strategy, self.meta["config"])
        return {}

    def save(self, step: int, trainer_state: dict) -> Path:
        """Collective: publish the checkpoint of step `step`, then apply retention; return its folder.

        With background saves every checkpoint goes through the background writer (so an async run's
        checkpoints are all its files): a save in flight is finished first; a save at a
        checkpoint.every step that is not the last then only takes its snapshot (published by a later
        `due`, `save` or `finish`); the last one and a preemption's are published before this returns."""
        self.busy = True  # a signal now waits for the save (within the grace period)
        t0 = time.perf_counter()
        try:
            if self.background is None:
                return store.save(self.strategy, self.out_dir, step, trainer_state, self.meta, self.keep_last)
            self.background.wait()  # the previous one (counted as waited_s)
            final = self.background.start(step, trainer_state)
            if step == self.max_steps or not (self.every and step % self.every == 0):
                self.background.wait(counted=False)
            return final
        finally:
            self.save_s += time.perf_counter() - t0
            self.busy = False

    def newest(self) -> str | None:
        """The checkpoint `latest` names (the newest complete one), or None before the first save."""
        try:
            return (store.checkpoint_root(self.out_dir) / "latest").read_text().strip() or None
        except OSError:
            return None
