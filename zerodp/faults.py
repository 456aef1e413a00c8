"""Surviving the things that go wrong at scale: preemption, dead or hung peers, stragglers.

- `Preemption`: SIGTERM or SIGUSR1 (Slurm's warning before the time limit) sets a flag; the loop shares
  it with the step's metrics, so every rank finishes the current step, saves, and exits together. A
  watchdog ends the process if that takes longer than the grace period.
- `Heartbeat`: each rank records its last finished step in the job's key-value store; when a
  collective fails or times out, the survivors name the rank(s) and host(s) that stopped answering.
- `StragglerMonitor`: per-rank forward-pass time and data wait; a rank slower than the median by a
  margin for several consecutive steps is reported by rank and host, with the cause (data or compute).
  The whole step time cannot show a straggler: synchronous ranks all wait for the slowest inside the
  gradient reduction, so every rank's step takes the same time.
- `DeviceProbe`: under zero3 and fsdp the forward pass itself all-gathers parameters, so the fast ranks
  wait for the slow one inside it and every rank's forward lasts equally long. There each rank times a
  small fixed matrix-multiply workload after the step instead: a slow device (throttled, shared, faulty)
  is slow at it too, and the forward time is split over the ranks in proportion.
"""

from __future__ import annotations

import datetime
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch


class Preemption:
    """Turns SIGTERM / SIGUSR1 into a request to checkpoint and stop after the current step."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.requested_at: float | None = None
        self.signal_name = ""
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _handle(self, signum, frame) -> None:
        if self.requested_at is not None:
            return
        self.requested_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        threading.Thread(target=self._watchdog, daemon=True, name="zerodp-grace").start()

    def _watchdog(self) -> None:
        time.sleep(self.grace_s)
        print(f"zerodp: error: {self.signal_name}: the checkpoint did not finish within the grace period "
              f"of {self.grace_s:.0f}s (train.preempt_grace_s); exiting. The previous checkpoint is intact.",
              file=sys.stderr, flush=True)
        os._exit(143)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Heartbeat:
    """Last finished step per rank, in the process group's store, to name peers that went silent."""

    def __init__(self, rank: int, world_size: int, hosts: list[str]):
        self.rank, self.world_size, self.hosts = rank, world_size, hosts
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = _get_default_store()
        except Exception:  # a store-less backend: failures are still reported, without names
            self.store = None

    def beat(self, step: int) -> None:
        if self.store is not None:
            self.store.set(f"zerodp/heartbeat/{self.rank}", f"{step}:{time.time():.3f}")

    def diagnose(self, error: BaseException, step: int) -> str:
        """A one-line explanation of a failed collective naming the ranks that stopped."""
        behind = []
        if self.store is not None:
            try:
                self.store.set_timeout(datetime.timedelta(seconds=5))
                now = time.time()
                for r in range(self.world_size):
                    key = f"zerodp/heartbeat/{r}"
                    if r == self.rank:
                        continue
                    if not self.store.check([key]):
                        behind.append(f"rank {r} on {self.hosts[r]} (never reported a step)")
                        continue
                    last_step, when = self.store.get(key).decode().split(":")
                    if int(last_step) < step + 1:  # it never finished the step we are in
                        behind.append(f"rank {r} on {self.hosts[r]} (last finished step {last_step}, "
                                      f"{now - float(when):.0f}s ago)")
            except Exception:
                behind.append("the job's store is unreachable (rank 0's host may be down)")
        who = "; ".join(behind) if behind else "a peer"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"rank {self.rank} on {self.hosts[self.rank]}: a collective at step {step + 1} failed because "
                f"{who} stopped responding ({first[:200]}). Restart the job (the same command resumes from the "
                f"newest checkpoint); raise strategy.timeout_s if steps are legitimately slow")


@dataclass
class StragglerMonitor:
    """Flags ranks whose step time exceeds the median by `margin` for `patience` consecutive steps."""

    hosts: list[str]
    margin: float = 0.2
    patience: int = 3
    streak: dict[int, int] = field(default_factory=dict)
    waited_s: float = 0.0
    reported: dict[int, str] = field(default_factory=dict)

    def update(self, compute: list[float], data_wait: list[float]) -> list[dict]:
        """Feed one step's per-rank compute (forward) and data-wait seconds; return the stragglers
        confirmed at this step. `waited_s` accumulates how long the job waited for its slowest rank."""
        total = [c + d for c, d in zip(compute, data_wait)]
        median = statistics.median(total)
        self.waited_s += max(total) - median
        found = []
        for r, t in enumerate(total):
            if median > 0 and t > median * (1 + self.margin):
                self.streak[r] = self.streak.get(r, 0) + 1
            else:
                self.streak[r] = 0
            if self.streak[r] >= self.patience:
                excess_data = data_wait[r] - statistics.median(data_wait)
                excess_compute = compute[r] - statistics.median(compute)
                cause = "data loading stall" if excess_data > excess_compute else "slow compute"
                found.append({"rank": r, "host": self.hosts[r], "step_time_s": t, "median_s": median,
                              "slower_by": t / median - 1, "cause": cause})
                self.reported[r] = cause
        return found


class Stopwatch:
    """Accumulates time inside `with` blocks: CUDA events on a GPU (kernels run async), else a clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []
        self.total = 0.0

    def __enter__(self):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.spans.append([start, None])
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans[-1][1] = end
        else:
            self.total += time.perf_counter() - self.t0

    def seconds(self) -> float:
        """Call after the device was synchronised."""
        return self.total + sum(s.elapsed_time(e) / 1000 for s, e in self.spans)


class DeviceProbe:
    """A fixed matrix-multiply workload timed on this rank's device: its speed, free of communication.

    Sized to take about a millisecond (a 2048-wide bf16 product 8 times on a GPU, a 160-wide fp32 one
    on a CPU core), i.e. well under 1% of a training step. Run it after the step has synchronised."""

    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        n, dtype = (2048, torch.bfloat16) if cuda else (160, torch.float32)
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=gen).to(device, dtype)
        self.b = torch.randn(n, n, generator=gen).to(device, dtype)
        self.reps = 8
        self.measure()  # warm-up: kernel selection and caches are not the device's speed

    def measure(self) -> float:
        """Seconds for the workload (CUDA events on a GPU, where kernels run asynchronously)."""
        watch = Stopwatch(self.device)
        with watch:
            for _ in range(self.reps):
                torch.mm(self.a, self.b)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return watch.seconds()


def compute_from_probe(forward_s: list[float], probe_s: list[float]) -> list[float]:
    """Each rank's share of the (equal, synchronised) forward time in proportion to its device speed:
    the median forward time scaled by the rank's probe time over the median probe time."""
    median_probe = statistics.median(probe_s)
    if median_probe <= 0:
        return list(forward_s)
    median_forward = statistics.median(forward_s)
    return [median_forward * p / median_probe for p in probe_s]
