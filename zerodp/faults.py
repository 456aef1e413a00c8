"""Surviving the things that go wrong at scale: preemption, dead or hung peers, stragglers.

- `Preemption`: SIGTERM, SIGUSR1 (Slurm's warning before the time limit) or a first Ctrl-C (SIGINT)
  sets a flag; the loop shares it with the step's metrics, so every rank finishes the current step,
  saves, and exits together. A second Ctrl-C stops at once. A watchdog ends the process if saving takes
  longer than the grace period.
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

import torch


class Preemption:
    """Turns SIGTERM / SIGUSR1 / a first Ctrl-C into a request to checkpoint and stop after the current
    step; a second Ctrl-C raises KeyboardInterrupt at once."""

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
    SAME_CTRL_C_S = 1.0
    """A SIGINT this soon after the first is the same Ctrl-C forwarded by a launcher (torchrun sends
    its workers the signal the terminal already sent them), not the user pressing it again."""

    def __init__(self, grace_s: float, announce: bool = True):
        self.grace_s = grace_s
        self.announce = announce  # print what happens (rank 0)
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

    CTRL_C = 2.0

    @property
    def request_code(self) -> float:
        """0: no request; 1: SIGTERM/SIGUSR1 (exit 0 after the checkpoint, the job stopped cleanly);
        CTRL_C: Ctrl-C (exit 130 after the checkpoint, as a shell expects). Shared by the step's
        all-gather."""
        if self.requested_at is None:
            return 0.0
        return self.CTRL_C if self.signal_name == "SIGINT" else 1.0

    def _handle(self, signum, frame) -> None:
        if self.requested_at is not None:
            late = time.monotonic() - self.requested_at > self.SAME_CTRL_C_S
            if signum == signal.SIGINT and late:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            return
        self.requested_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.announce:
            print("\nzerodp: Ctrl-C: finishing this step, then saving a checkpoint and exiting; "
                  "press Ctrl-C again to stop at once without saving", file=sys.stderr, flush=True)
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


class StragglerMonitor:
    """Flags a rank whose step time exceeds the median of the *other* ranks' by `margin` (and by at
    least MIN_EXCESS_S) for `patience` consecutive steps: sustained, not a spike (a busy host's noise comes and goes). Each rank is
    reported once per slow spell, again only after it recovered and slowed down anew.

    The other ranks' median, not all ranks': with two ranks the median of both is their mean, which
    would halve how much slower the slow one looks."""

    MIN_EXCESS_S = 0.005
    """Below this many seconds per step a slower rank costs nothing worth a warning, and on a busy host
    millisecond forward passes jitter by more than any margin."""

    def __init__(self, hosts: list[str], margin: float = 0.2, patience: int = 5):
        self.hosts, self.margin, self.patience = hosts, margin, patience
        self.streak: dict[int, int] = {}
        self.waited_s = 0.0
        """How long the job waited for its slowest rank, summed over steps (max - median)."""
        self.reported: dict[int, str] = {}
        """rank -> cause, for every rank reported during the run."""

    def update(self, compute: list[float], data_wait: list[float]) -> list[dict]:
        """Feed one step's per-rank compute (forward) and data-wait seconds; return the stragglers
        confirmed at this step."""
        total = [c + d for c, d in zip(compute, data_wait)]
        self.waited_s += max(total) - statistics.median(total)
        if len(total) < 2:
            return []
        found = []
        for r, t in enumerate(total):
            others = statistics.median(total[:r] + total[r + 1:])
            slow = others > 0 and t > others * (1 + self.margin) and t - others > self.MIN_EXCESS_S
            self.streak[r] = self.streak.get(r, 0) + 1 if slow else 0
            if self.streak[r] != self.patience:
                continue
            rest = lambda xs: statistics.median(xs[:r] + xs[r + 1:])  # noqa: E731
            excess_data = data_wait[r] - rest(data_wait)
            excess_compute = compute[r] - rest(compute)
            cause = "data loading stall" if excess_data > excess_compute else "slow compute"
            found.append({"rank": r, "host": self.hosts[r], "step_time_s": t, "median_s": others,
                          "slower_by": t / others - 1, "cause": cause})
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
