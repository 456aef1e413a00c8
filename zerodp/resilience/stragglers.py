"""Stragglers, and the timing they are measured with.

- `StragglerMonitor`: per-rank forward-pass time and data wait; a rank slower than the median by a
  margin for several consecutive steps is reported by rank and host, with the cause (data or compute).
  The whole step time cannot show a straggler: synchronous ranks all wait for the slowest inside the
  gradient reduction, so every rank's step takes the same time.
- `DeviceProbe`: under zero3 and fsdp the forward pass itself all-gathers parameters, so the fast ranks
  wait for the slow one inside it and every rank's forward lasts equally long. There each rank times a
  small fixed matrix-multiply workload after the step instead: a slow device (throttled, shared, faulty)
  is slow at it too, and the forward time is split over the ranks in proportion.
- `Stopwatch`: time inside `with` blocks, by CUDA events on a GPU.
"""

from __future__ import annotations

import statistics
import time

import torch


class StragglerMonitor:
    """Flags a rank whose step time exceeds the median of the *other* ranks' by `margin` (and by at
    least MIN_EXCESS_S) for `patience` consecutive steps: sustained, not a spike (a busy host's noise
    comes and goes). Each rank is reported once per slow spell, again only after it recovered and
    slowed down anew: every spell goes into the step's record, but only a rank's first spell gets a
    line on the console (`worth_a_line`); the end of the run counts them all (a shared machine slows
    ranks on and off all run long: 7-11 lines a run otherwise).

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
        self.spells: dict[int, int] = {}
        """rank -> how many slow spells it had."""
        self.lines = 0

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
            def rest(xs):  # the median of the other ranks' values
                return statistics.median(xs[:r] + xs[r + 1:])

            excess_data = data_wait[r] - rest(data_wait)
            excess_compute = compute[r] - rest(compute)
            cause = "data loading stall" if excess_data > excess_compute else "slow compute"
            found.append({"rank": r, "host": self.hosts[r], "step_time_s": t, "median_s": others,
                          "slower_by": t / others - 1, "cause": cause})
            self.reported[r] = cause
            self.spells[r] = self.spells.get(r, 0) + 1
        return found

    LINES = 3
    """Console lines about stragglers in one run, at most; `summary` names every one."""

    def worth_a_line(self, found: list[dict]) -> list[dict]:
        """Of the stragglers `update` just confirmed, those to say on the console: a rank's first slow
        spell, for the first LINES ranks (the rest are counted in `summary`)."""
        said = [f for f in found if self.spells[f["rank"]] == 1][:max(0, self.LINES - self.lines)]
        self.lines += len(said)
        return said

    def summary(self, hosts: list[str]) -> str:
        """The stragglers of the run, by rank: host, cause, and how many slow spells when more than one."""
        return ", ".join(f"rank {r} on {hosts[r]} ({cause}" + (f", {self.spells[r]} slow spells)" if self.spells[r] > 1
                                                                else ")")
                         for r, cause in sorted(self.reported.items()))


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
    on a CPU core), i.e. well under 1% of a training step. Queued after the step, on the same stream."""

    def __init__(self, device: torch.device):
        self.device = device
        cuda = device.type == "cuda"
        n, dtype = (2048, torch.bfloat16) if cuda else (160, torch.float32)
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=gen).to(device, dtype)
        self.b = torch.randn(n, n, generator=gen).to(device, dtype)
        self.reps = 8
        self.launch()  # warm-up: kernel selection and caches are not the device's speed

    def launch(self) -> Stopwatch:
        """Queue the workload; its Stopwatch reads the seconds once the device has been synchronised
        (the loop does that once per log interval, not per step)."""
        watch = Stopwatch(self.device)
        with watch:
            for _ in range(self.reps):
                torch.mm(self.a, self.b)
        return watch


def compute_from_probe(forward_s: list[float], probe_s: list[float]) -> list[float]:
    """Each rank's share of the (equal, synchronised) forward time in proportion to its device speed:
    the median forward time scaled by the rank's probe time over the median probe time."""
    median_probe = statistics.median(probe_s)
    if median_probe <= 0:
        return list(forward_s)
    median_forward = statistics.median(forward_s)
    return [median_forward * p / median_probe for p in probe_s]
