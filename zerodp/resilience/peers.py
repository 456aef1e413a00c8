"""Dead or hung peers.

- `Heartbeat`: each rank records its last finished step in the job's key-value store; when a
  collective fails or times out, the survivors name the rank(s) and host(s) that stopped answering.
- `PeerWatch`: a side thread for what the main thread cannot see while a collective holds it in C++
  (no Python exception, no signal handler, and under nccl a timeout that aborts without a word): a
  peer that shows no sign of life, and a preemption signal that its handler cannot act on.
"""

from __future__ import annotations

import datetime
import os
import select
import signal
import sys
import threading
import time
from typing import Protocol

from zerodp.distributed.launcher import record_exit
from zerodp.resilience.preemption import Preemption


class Checkpoints(Protocol):
    """What the peer watch needs to know of the run's checkpoints (zerodp.checkpoint.checkpointer.Checkpointer
    is the one the loop passes): this protocol is the whole of that surface."""

    busy: bool
    """A checkpoint is being written: a signal then waits for it (within the grace period)."""

    def newest(self) -> str | None:
        """The newest complete checkpoint's name, or None before the first save."""


class NoCheckpoints:
    """A run that saves nothing."""

    busy = False

    def newest(self) -> str | None:
        return None


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
        if self.store is not None:
            try:
                self.store.set_timeout(datetime.timedelta(seconds=5))
            except Exception:
                pass
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return self.describe(step, first[:200])

    def describe(self, step: int, cause: str, ranks: list[int] | None = None, store=None,
                 verb: str = "failed", who: str | None = None) -> str:
        """One line: the collective of step `step` (0-based, in progress) `verb` because the peers that
        stopped did; `ranks` names them (else: those that never finished this step), `who` replaces
        the naming, `cause` says how it showed."""
        who = who or self._who(step, ranks, store if store is not None else self.store)
        return (f"rank {self.rank} on {self.hosts[self.rank]}: a collective at step {step + 1} {verb} because "
                f"{who} stopped responding ({cause}). Restart the job (the same command resumes from the "
                f"newest checkpoint); raise strategy.timeout_s if steps are legitimately slow")

    def _who(self, step: int, ranks: list[int] | None, store) -> str:
        named = []
        if store is not None:
            try:
                now = time.time()
                for r in range(self.world_size) if ranks is None else ranks:
                    key = f"zerodp/heartbeat/{r}"
                    if r == self.rank:
                        continue
                    if not store.check([key]):
                        named.append(f"rank {r} on {self.hosts[r]} (never reported a step)")
                        continue
                    last_step, when = store.get(key).decode().split(":")
                    if ranks is not None or int(last_step) < step + 1:  # it never finished the step we are in
                        named.append(f"rank {r} on {self.hosts[r]} (last finished step {last_step}, "
                                     f"{now - float(when):.0f}s ago)")
            except Exception:
                named.append("the job's store is unreachable (rank 0's host may be down)")
        elif ranks:
            named = [f"rank {r} on {self.hosts[r]}" for r in ranks]
        return "; ".join(named) if named else "a peer"


def peer_dead_s(timeout_s: float) -> float:
    """How long a peer may show no sign of life before it counts as dead: a tenth of the collective
    timeout (strategy.timeout_s), at least 5 s and at most 60 s."""
    return min(60.0, max(5.0, timeout_s / 10))


class PeerWatch:
    """A side thread that acts while the main thread is held inside a collective.

    A blocked collective keeps the main thread in C++: no Python exception until the collective
    timeout, no signal handler until it returns (Python runs handlers between bytecodes of the main
    thread only), and under nccl the timeout aborts the process (SIGABRT) without naming anyone.

    - A dead or frozen peer. Every rank's thread adds 1 to its counter in the job's store every
      `beat_s`, whatever its main thread is doing; rank r watches rank r+1 (a ring: two store
      operations per rank and beat, whatever the world size). A counter that stays still for
      `dead_s` (`peer_dead_s`: strategy.timeout_s / 10, 5 to 60 s) means the process is gone, stopped,
      or its host is lost or cut off. The watcher reads every counter twice, a few beats apart, to name
      all the ranks that stopped, posts them in the store, where every rank's thread looks each beat,
      and every survivor prints the heartbeat line naming them and exits with code 1 at once. A rank
      whose main thread is stuck but whose process lives still beats: the collective timeout ends that
      case, as before. A rank that finished its loop says so, so that its silence is not a death.
    - A preemption signal while the main thread is blocked. The signal's number reaches the thread at
      once through `signal.set_wakeup_fd`. If `Preemption`'s handler has not run `blocked_s` later
      (3 slowest steps, at least 5 s, at most train.preempt_grace_s; the grace period while a checkpoint
      is being written), the main thread is stuck inside one call, waiting for a peer that does not
      answer, and cannot finish the step: the process exits at once with 143 (130 after Ctrl-C),
      naming the newest checkpoint, from which the launcher's restart or the same command resumes. A
      checkpoint being written is never published half-way (it is renamed into place when complete).
      When the handler runs, the usual path follows: finish the step, save, exit.
    """

    ALIVE, STOPPED, DEAD = "zerodp/alive/{}", "zerodp/stopped/{}", "zerodp/dead"
    LEFT = "zerodp/left/{}"
    """Ranks whose watch is done with the store, per watch this process started (the same count on every
    rank: a pooled test world runs many in one store): rank 0 leaves last (see `_leave_store`)."""
    _started = 0
    LEAVE_WAIT_S = 3.0
    """At most this long rank 0 waits at the end for its peers' watches to finish with the store."""
    FIRST_STEP_S = 10.0
    """The step time assumed before a step has finished (the first one warms up)."""
    SIGNUMS = {getattr(signal, n) for n in Preemption.SIGNALS if hasattr(signal, n)}

    def __init__(self, heartbeat: Heartbeat, preemption: Preemption, timeout_s: float, say=None,
                 checkpoints: Checkpoints | None = None):
        self.hb, self.preemption = heartbeat, preemption
        self.rank, self.world = heartbeat.rank, heartbeat.world_size
        self.dead_s = peer_dead_s(timeout_s)
        self.beat_s = min(2.0, self.dead_s / 10)
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        # busy while one is written; the newest, named when leaving blocked
        self.checkpoints = checkpoints or NoCheckpoints()
        self.step, self.step_at = 0, time.monotonic()
        self.slowest_step_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    def start(self, step: int) -> None:
        """Start watching (from the main thread, at the loop's first step `step`)."""
        self.step, self.step_at = step, time.monotonic()
        if self.hb.store is None or self.world < 2:
            return
        try:  # an own connection, with a short timeout: the process group's store keeps its own
            self.store = self.hb.store.clone()
            self.store.set_timeout(datetime.timedelta(seconds=max(1.0, 2 * self.beat_s)))
        except Exception:
            return
        self._pipe = os.pipe()
        for fd in self._pipe:
            os.set_blocking(fd, False)
        if threading.current_thread() is threading.main_thread():
            self._old_wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        PeerWatch._started += 1
        self._left_key = self.LEFT.format(PeerWatch._started)
        self._thread = threading.Thread(target=self._run, daemon=True, name="zerodp-peer-watch")
        self._thread.start()

    def step_done(self, done: int, seconds: float) -> None:
        """The loop finished step `done` (1-based) in `seconds`."""
        self.step, self.step_at = done, time.monotonic()
        self.slowest_step_s = max(seconds, self.slowest_step_s or 0.0)

    def blocked_s(self) -> float:
        """How long a signal may wait for its handler before the main thread counts as blocked."""
        if self.checkpoints.busy:
            return self.preemption.grace_s
        step_s = self.slowest_step_s if self.slowest_step_s is not None else self.FIRST_STEP_S
        return min(self.preemption.grace_s, max(5.0, 3 * step_s))

    def stop(self, peers_alive: bool = True) -> None:
        """Stop watching and tell the peers this rank's silence from now on is no death; rank 0 waits for
        its peers to be done with the store unless a peer is known to have failed (`peers_alive` False)."""
        if self._thread is None:
            return
        self._stop.set()
        try:
            os.write(self._pipe[1], b"\0")  # wake the thread now
        except OSError:
            pass
        self._thread.join(timeout=10)
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._old_wakeup)
        for fd in self._pipe:
            os.close(fd)
        self._thread = None
        self._leave_store(wait=peers_alive)

    def _leave_store(self, wait: bool) -> None:
        """Count this rank out of the store; rank 0 then waits (LEAVE_WAIT_S at most: a dead peer never
        counts itself) until every peer has. Under a plain env:// launch rank 0's process hosts the store,
        and a peer whose last beat or STOPPED mark meets the closed socket has torch log a C++ stack trace
        on its stderr: after a run that ends in one shared error line, that would be a second message."""
        try:
            left = self.store.add(self._left_key, 1)
            deadline = time.monotonic() + self.LEAVE_WAIT_S
            while wait and self.rank == 0 and left < self.world and time.monotonic() < deadline:
                time.sleep(0.05)
                left = self.store.add(self._left_key, 0)
        except Exception:
            pass

    def _run(self) -> None:
        mine, watched = self.ALIVE.format(self.rank), (self.rank + 1) % self.world
        count, changed_at = None, time.monotonic()
        store_ok_at = time.monotonic()
        pending: tuple[float, int] | None = None  # (when, signal) not yet handled on the main thread
        while not self._stop.is_set():
            if select.select([self._pipe[0]], [], [], self.beat_s)[0]:
                try:
                    for signum in os.read(self._pipe[0], 512):
                        if signum in self.SIGNUMS and pending is None:
                            pending = (time.monotonic(), signum)
                except BlockingIOError:
                    pass
            if self._stop.is_set():
                break
            now = time.monotonic()
            if pending is not None:
                handled = self.preemption.handled_at
                if handled is not None and handled > pending[0] - 1.0:  # the handler ran: the usual path
                    pending = None
                elif now - pending[0] > self.blocked_s():
                    self._leave_blocked(signal.Signals(pending[1]).name, now)
            try:
                self.store.add(mine, 1)
                seen = self.store.add(self.ALIVE.format(watched), 0)
                dead = self.store.get(self.DEAD).decode() if self.store.check([self.DEAD]) else ""
                store_ok_at = now
            except Exception as e:
                if now - store_ok_at > self.dead_s:
                    self._leave(self.hb.describe(
                        self.step, f"it did not answer for {self.dead_s:.0f}s: {str(e).strip()[:120]}",
                        verb="cannot finish", who="the job's store (rank 0's host may be down)"))
                continue
            if dead:
                watcher, ranks = dead.split(":")
                self._leave_dead([int(r) for r in ranks.split(",")], int(watcher))
            if seen != count:
                count, changed_at = seen, now
            elif now - changed_at > self.dead_s and not self._stopped(watched, seen):
                ranks = self._scan(watched)
                try:
                    self.store.set(self.DEAD, f"{self.rank}:{','.join(map(str, ranks))}")
                except Exception:
                    pass
                self._leave_dead(ranks, self.rank)
        try:
            self.store.set(self.STOPPED.format(self.rank), str(self.store.add(mine, 0)))
        except Exception:
            pass

    def _stopped(self, rank: int, count: int) -> bool:
        """Whether `rank` finished its loop and has not beaten since."""
        key = self.STOPPED.format(rank)
        try:
            return self.store.check([key]) and int(self.store.get(key)) == count
        except Exception:
            return False

    def _scan(self, watched: int) -> list[int]:
        """Every rank (the watched one included) whose counter does not move over three beats."""
        others = [r for r in range(self.world) if r not in (self.rank, watched)]
        try:
            before = {r: self.store.add(self.ALIVE.format(r), 0) for r in others}
            time.sleep(3 * self.beat_s)
            after = {r: self.store.add(self.ALIVE.format(r), 0) for r in others}
        except Exception:
            return [watched]
        return sorted([watched] + [r for r in others if before[r] == after[r]
                                   and not self._stopped(r, after[r])])

    def _leave_dead(self, ranks: list[int], watcher: int) -> None:
        seen_by = "" if watcher == self.rank else f", seen by rank {watcher}"
        self._leave(self.hb.describe(self.step, f"no sign of life for {self.dead_s:.0f}s{seen_by}", ranks=ranks,
                                     store=self.store, verb="cannot finish"))

    def _leave_blocked(self, name: str, now: float) -> None:
        newest = self.checkpoints.newest()
        kept = (f"the newest checkpoint, {newest}, is intact and the restart (or the same command) resumes "
                f"from it" if newest else "no checkpoint was saved yet; the restart starts over")
        what = "writing a checkpoint" if self.checkpoints.busy else f"step {self.step + 1}"
        self._leave(f"{name}: rank {self.rank} on {self.hb.hosts[self.rank]} is blocked in a collective at "
                    f"{what} (no step finished for {now - self.step_at:.0f}s: a peer is not answering), so it "
                    f"cannot finish the step and save; exiting now: {kept}",
                    130 if name == "SIGINT" else 143)

    def _leave(self, message: str, code: int = 1) -> None:
        """Print one line and end the process: the main thread is held in C++ and cannot raise."""
        try:
            sys.stdout.flush()
            self.say(f"zerodp: error: {message}")
            sys.stderr.flush()
        finally:
            os._exit(record_exit(code))
