"""Preemption: SIGTERM, SIGUSR1 (Slurm's warning before the time limit) or a first Ctrl-C (SIGINT)
sets a flag; the loop shares it with the metrics it exchanges at its next sync point (at most
train.log_every steps later), so every rank stops after the same step, saves, and exits together. A
second Ctrl-C stops at once. A watchdog ends the process if those steps and the save take longer than
the grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from zerodp.distributed.launcher import record_exit


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
        self.handled_at: float | None = None
        """When the handler last ran: a signal it has not run for is one the main thread cannot act on."""
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
        CTRL_C: Ctrl-C (exit 130 after the checkpoint, as a shell expects). Shared by the loop's
        all-gather at its sync points."""
        if self.requested_at is None:
            return 0.0
        return self.CTRL_C if self.signal_name == "SIGINT" else 1.0

    def _handle(self, signum, frame) -> None:
        self.handled_at = time.monotonic()
        if self.requested_at is not None:
            late = time.monotonic() - self.requested_at > self.SAME_CTRL_C_S
            if signum == signal.SIGINT and late:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            return
        self.requested_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.announce:
            print("\nzerodp: Ctrl-C: training on to the next log step (train.log_every), then saving a checkpoint "
                  "and exiting; press Ctrl-C again to stop at once without saving", file=sys.stderr, flush=True)
        threading.Thread(target=self._watchdog, daemon=True, name="zerodp-grace").start()

    def _watchdog(self) -> None:
        time.sleep(self.grace_s)
        print(f"zerodp: error: {self.signal_name}: the checkpoint did not finish within the grace period "
              f"of {self.grace_s:.0f}s (train.preempt_grace_s); exiting. The previous checkpoint is intact.",
              file=sys.stderr, flush=True)
        os._exit(record_exit(143))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
