"""Background saves (checkpoint.async_save): the snapshot on the main thread, the writing in a thread,
the agreement and publication back on the main thread.

At a save step each rank copies what `store.save` writes into host memory (`HostBuffers`: one buffer
per tensor, reused from one save to the next, pinned on CUDA) through its strategy's `snapshot`, which
returns the function that writes the copy in the strategy's own layout. A thread runs it, writes the
RNG state and trainer.json, then, once the main threads have agreed that every rank's files are
there, fsyncs and hashes this rank's share of them (as `store.save` does). The background thread runs no
collective on the training process group: the fsdp strategy's
DCP writer uses its own gloo group, and the ranks agree on one gloo group of their own, from the main
thread only, at each step's `poll` while a save is in flight: once every rank's files are complete and
hashed, rank 0 writes meta.json, renames the folder and moves `latest`, then retention runs, exactly
as for a synchronous save. A rank killed at any point leaves a `.tmp` folder that is never `latest`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zerodp.checkpoint import store


class HostBuffers:
    """Host copies of a save's tensors, by key: the same buffers from one save to the next (their
    total is one copy of this rank's checkpoint), pinned when CUDA is there."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, key: str, tensor: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """`tensor` copied into this key's buffer (as `dtype`; None keeps its own)."""
        dtype = dtype or tensor.dtype
        buf = self.buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != dtype:
            buf = torch.empty(tensor.shape, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())
            self.buffers[key] = buf
        buf.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        return buf

    def ready(self) -> None:
        """Wait for the device copies issued by `copy` (a no-op without CUDA)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class InFlight:
    """One background save: its folders, its writer thread, and what the thread found."""

    def __init__(self, step: int, tmp: Path, final: Path, write, rng: dict, trainer_state: dict | None):
        self.step, self.tmp, self.final = step, tmp, final
        self.share: dict = {}
        self.error: str | None = None
        self.written, self.go_hash, self.done = threading.Event(), threading.Event(), threading.Event()
        """This rank's files are written; every rank's are (the main thread's word); all are hashed."""
        self.write_s = 0.0
        self._work = (write, rng, trainer_state)
        self.thread = threading.Thread(target=self._run, name=f"zerodp-save-{step}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        write, rng, trainer_state = self._work
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            self.error = store._attempt(lambda: _write(self.tmp, write, rng, trainer_state, rank))
            self.written.set()
            self.go_hash.wait()  # each rank hashes every world-th file of the folder: all must be there
            if self.error is None:
                self.error = store._attempt(lambda: self.share.update(store._manifest_share(self.tmp, rank, world)))
        except BaseException as e:  # anything else is still this save's failure, reported by the main thread
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._work = None  # the snapshot's references go with the thread
            self.write_s = time.perf_counter() - t0
            self.written.set()
            self.done.set()


def _write(tmp: Path, write, rng: dict, trainer_state: dict | None, rank: int) -> None:
    from safetensors.torch import save_file

    write()
    save_file(rng, tmp / f"rng_rank{rank}.safetensors")
    if trainer_state is not None:
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))


class Background:
    """The run's background saves: at most one in flight."""

    def __init__(self, strategy, root: Path, meta: dict, keep_last: int):
        self.strategy, self.root, self.meta, self.keep_last = strategy, root, meta, keep_last
        self.group = dist.new_group(backend="gloo")  # collective: every rank builds it at the same point
        self.buffers = HostBuffers()
        self.flight: InFlight | None = None
        self.waited_s = 0.0
        """Seconds save steps waited for the previous background save to finish."""

    def start(self, step: int, trainer_state: dict) -> Path:
        """Collective (main thread): snapshot this rank's checkpoint of `step` and start writing it."""
        assert self.flight is None, "finish the save in flight first"
        final = self.root / store.step_dir_name(step)
        tmp = self.root / (store.step_dir_name(step) + ".tmp")
        rank = dist.get_rank()
        error = store._attempt(lambda: store._fresh_dir(tmp)) if rank == 0 else None
        store._agree(error, tmp, step, self.root, self.group)
        write = self.strategy.snapshot(tmp, self.buffers)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        self.buffers.ready()
        self.flight = InFlight(step, tmp, final, write, rng, dict(trainer_state) if rank == 0 else None)
        return final

    def poll(self) -> None:
        """Collective (main thread, on this object's gloo group), at every step while a save is in
        flight: publish it once every rank's writer is done; raise CheckpointError if one failed."""
        if self.flight is None:
            return
        f = self.flight
        reached = torch.tensor([2 if f.done.is_set() else int(f.written.is_set())])
        dist.all_reduce(reached, op=dist.ReduceOp.MIN, group=self.group)
        if reached.item() >= 1:
            f.go_hash.set()
        if reached.item() == 2:
            self._publish()

    def wait(self, counted: bool = True) -> None:
        """Collective (main thread): let the save in flight finish, then publish it (or raise);
        `counted`: the wait is a save step's for the previous save (waited_s), not a save's own."""
        if self.flight is None:
            return
        t0 = time.perf_counter()
        self.flight.written.wait()
        dist.barrier(group=self.group)
        self.flight.go_hash.set()
        self.flight.done.wait()
        dist.barrier(group=self.group)
        if counted:
            self.waited_s += time.perf_counter() - t0
        self._publish()

    def _publish(self) -> None:
        f, self.flight = self.flight, None
        store._agree(f.error, f.tmp, f.step, self.root, self.group)  # every rank's files are complete
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, f.share, group=self.group)
        error = None
        if dist.get_rank() == 0:
            files = {rel: info for part in shares for rel, info in part.items()}
            error = store._attempt(lambda: store._publish(f.tmp, f.final, self.root, dict(sorted(files.items())),
                                                          self.meta, f.step, self.keep_last))
        store._agree(error, f.tmp, f.step, self.root, self.group)
