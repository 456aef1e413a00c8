"""What watches a run for what goes wrong at scale (zerodp.resilience), put together for the loop: the
heartbeat that names a dead peer, the straggler monitor (and its device probe where the forward
gathers parameters), the preemption handler and the peer watch's side thread."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from zerodp.config import Config
from zerodp.distributed.process_group import DistEnv
from zerodp.errors import PeerFailure
from zerodp.resilience.peers import Checkpoints, Heartbeat, PeerWatch
from zerodp.resilience.preemption import Preemption
from zerodp.resilience.stragglers import DeviceProbe, StragglerMonitor, compute_from_probe
from zerodp.trainer.records import log


class Guards:
    """The run's fault handling from step `start` on; `watching` holds the peer watch and the signal
    handlers for the length of the loop."""

    def __init__(self, cfg: Config, env: DistEnv, gathers_in_forward: bool, start: int):
        self.env = env
        self.heartbeat = Heartbeat(env.rank, env.world_size, env.hosts)
        self.heartbeat.beat(start)  # a peer lost during the first step is named too
        self.stragglers = StragglerMonitor(env.hosts, cfg.train.straggler_margin, cfg.train.straggler_patience)
        # Where the forward all-gathers parameters, its time is the slowest rank's on every rank: probe instead.
        self.probe = DeviceProbe(env.device) if gathers_in_forward and env.world_size > 1 else None
        self.preemption = Preemption(cfg.train.preempt_grace_s, announce=env.rank == 0)
        self.timeout_s = cfg.strategy.timeout_s
        self.watch: PeerWatch | None = None

    @contextlib.contextmanager
    def watching(self, start: int, checkpoints: Checkpoints, say):
        """The loop's span: a side thread for a peer that stops answering and for a signal while a
        collective blocks the main thread (naming `checkpoints`' newest); a failed collective becomes a
        PeerFailure naming the ranks that stopped. `say`: a line on stderr from any thread."""
        self.watch = PeerWatch(self.heartbeat, self.preemption, self.timeout_s, say=say, checkpoints=checkpoints)
        self.step = start
        self.watch.start(start)
        peers_alive = True
        try:
            yield self.watch
        except (dist.DistBackendError, RuntimeError) as e:
            if not _is_collective_failure(e):
                raise
            peers_alive = False  # rank 0 does not wait for a dead peer to leave the store
            raise PeerFailure(self.heartbeat.diagnose(e, self.step)) from None
        finally:
            self.watch.stop(peers_alive)
            self.preemption.restore()

    def find_stragglers(self, per_rank: list[list[float]]) -> list[dict]:
        """Feed one step's per-rank times (rows of the loop's all-gather) to the monitor; log what it finds.

        Compute is each rank's forward time, or, where the forward all-gathers parameters (probed), the
        forward time shared out in proportion to each rank's device-probe time."""
        probed = self.probe is not None
        compute, data_wait = [r[4] for r in per_rank], [r[2] for r in per_rank]
        if probed:
            compute = compute_from_probe(compute, [r[5] for r in per_rank])
        found = self.stragglers.update(compute, data_wait)
        for f in found:
            if probed:
                f["measured_by"] = "device probe"
        for f in self.stragglers.worth_a_line(found):  # every spell is in the records; its first one said
            log(self.env, f"straggler: rank {f['rank']} on {f['host']} is {f['slower_by']:.0%} slower than the "
                          f"other ranks ({f['step_time_s']:.3f}s vs {f['median_s']:.3f}s): {f['cause']}"
                          + (" (compute estimated from the device probe)" if probed else "")
                          + "; its later slow spells are counted at the end of the run")
        return found

    def report(self) -> None:
        """The time the job waited for its slowest rank, and the stragglers named, at the end of the run."""
        env, stragglers = self.env, self.stragglers
        if stragglers.waited_s > 0 and env.world_size > 1:
            named = stragglers.summary(env.hosts)
            log(env, f"time spent waiting for the slowest rank: {stragglers.waited_s:.1f}s"
                     + (f"; stragglers: {named}" if named else ""))


def _is_collective_failure(e: BaseException) -> bool:
    """A failed or timed-out collective (a peer died or hung), as opposed to a bug in this rank."""
    if isinstance(e, dist.DistBackendError):
        return True
    text = str(e)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                                   "timed out", "Gloo", "NCCL", "connectFullMesh"))
