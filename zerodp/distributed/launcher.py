"""torchrun whose outcome is the one zerodp's ranks chose: what launchers/*.sh run instead of torchrun.

    python -m zerodp.distributed.launcher [torchrun options] -m zerodp train CONFIG [overrides...]

zerodp says how a run ended in one line and an exit code (2: bad input, 130: Ctrl-C, 0: preempted with a
checkpoint saved; docs/operations.md). Plain torchrun then adds its own account: a rank that exits with
anything but 0 gets a `ChildFailedError` traceback and exit code 1, and a Ctrl-C it receives itself a
`SignalException` traceback and exit code 1. This module runs torchrun's own `main`, with the same
options, agent and signal handling, in this process, so that it can tell the two apart afterwards:

- the ranks failed, and every one that did left with a code zerodp chose (or was stopped by the agent
  because another one did): exit with that code and add nothing; the ranks' lines are the whole story;
- the agent was signalled (Ctrl-C, SIGTERM, SIGUSR1; it forwards the signal and waits for the ranks):
  exit with the code the ranks chose after it, 128 + the signal for a rank that left without choosing;
- anything else (a rank's traceback, a rank killed by a signal nobody sent it): torchrun's failure
  report, then the root cause's exit code (128 + N for signal N). Errors of torchrun itself (options,
  rendezvous) are torchrun's, traceback and all.

A rank tells which code it chose in a file of the folder ZERODP_OUTCOME_DIR names (`record_exit`,
called just before zerodp leaves: zerodp.cli.commands, and zerodp.resilience's side threads). Exit codes 2, 130 and 143
are zerodp's without one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from zerodp.distributed.devices import TORCHRUN_OMP_DEFAULT

OUTCOME_DIR = "ZERODP_OUTCOME_DIR"

ZERODP_CODES = (2, 130, 143)
"""Codes only zerodp leaves with (bad input, Ctrl-C, SIGTERM without a checkpoint): Python leaves an
uncaught exception with 1, and a process killed by a signal has no exit code (torchrun reports -N)."""


def record_exit(code: int) -> int:
    """Leave `code` where the launcher finds it, when one asked (ZERODP_OUTCOME_DIR); return `code`."""
    folder = os.environ.get(OUTCOME_DIR)
    if folder:
        try:
            record = {"code": code, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                      "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                      "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
            path = Path(folder) / str(os.getpid())  # the pid the agent reports the exit under
            path.with_suffix(".tmp").write_text(json.dumps(record))
            path.with_suffix(".tmp").replace(path)
        except (OSError, ValueError):
            pass  # never in the way of leaving: the launcher then judges by the exit code alone
    return code


def read_records(folder: str | Path) -> dict[int, dict]:
    """The records of `folder` by pid."""
    records = {}
    for path in Path(folder).iterdir():
        if path.name.isdigit():
            try:
                records[int(path.name)] = json.loads(path.read_text())
            except (OSError, ValueError):
                pass
    return records


def failures_outcome(failures: list[tuple[int, int]], records: dict[int, dict]) -> int | None:
    """The code zerodp chose for a launch whose ranks failed, `failures` being (pid, exit code) of each
    failed rank in rank order: the first chosen code, when every failure is a choice of zerodp's or the
    agent's SIGTERM to the ranks still running after one; None otherwise."""
    chosen = [code for pid, code in failures if code in ZERODP_CODES or records.get(pid, {}).get("code") == code]
    stopped = sum(code == -signal.SIGTERM for _, code in failures)
    return chosen[0] if chosen and len(chosen) + stopped == len(failures) else None


def signal_outcome(signum: int, records: dict[int, dict]) -> int:
    """The code of a launch whose agent got signal `signum`: the first nonzero code this node's ranks
    chose in the last attempt, by local rank; 128 + signum for a rank without a record (or none at all)."""
    attempt = max((r["attempt"] for r in records.values()), default=0)
    chosen = {r["local_rank"]: r for r in records.values() if r["attempt"] == attempt}
    ranks = max((r["local_world_size"] for r in chosen.values()), default=1)
    codes = [chosen[i]["code"] if i in chosen else 128 + signum for i in range(ranks)]
    return next((code for code in codes if code != 0), 0)


# The agent's account of stopping its ranks (torch/distributed/elastic/multiprocessing/api.py and
# agent/server/api.py), matched by format string: a message a torch release words otherwise is shown.
_STOPPING = "Sending process %s closing signal %s"
_SIGNALLED = "Received %s death signal, shutting down workers"
_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


class AgentLog(logging.Filter):
    """Keeps the agent's account of a shutdown off the console when zerodp's ranks chose it.

    After a rank fails, the agent logs that it is stopping the others, then the failure: the first is
    held until the second shows whose choice the failure was. After a signal, the agent's account of
    forwarding it is dropped (the ranks say what they did). Any other record is shown at once, the
    held ones first; `release` shows them when the launch turns out to have failed on its own."""

    def __init__(self, folder: str | Path):
        super().__init__()
        self.folder = folder
        self.held: list[logging.LogRecord] = []
        self.signalled = False

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "zerodp_released", False):
            return True
        if record.msg == _SIGNALLED:
            self.signalled = True
            return False
        if record.msg == _STOPPING:
            if not self.signalled:
                self.held.append(record)
            return False
        if record.msg == _FAILED:
            exitcode, _, pid = record.args[:3]
            chosen = failures_outcome([(pid, exitcode)], read_records(self.folder)) is not None
            if chosen:
                self.held = []
            else:
                self.release()
            return not chosen
        self.release()
        return True

    def release(self) -> None:
        held, self.held = self.held, []
        for record in held:
            record.zerodp_released = True
            logging.getLogger(record.name).handle(record)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.argv[0] = "torchrun"  # the name torchrun's own messages (bad options) give
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun
    except KeyboardInterrupt:  # Ctrl-C while torch loads: nothing was started
        return 130
    with tempfile.TemporaryDirectory(prefix="zerodp-outcome-") as folder:
        os.environ[OUTCOME_DIR] = folder  # torchrun hands its environment to the ranks
        # torchrun sets OMP_NUM_THREADS=1 when it is unset and several ranks share the node: tell the ranks
        # whose choice it was (zerodp.distributed.devices.user_threads), so that they size their threads.
        os.environ[TORCHRUN_OMP_DEFAULT] = "1" if "OMP_NUM_THREADS" in os.environ else "0"
        # torchrun's own default, without the four-line banner it prints when it sets it: the ranks size
        # their threads themselves (they were told above that the user did not choose this 1).
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        log = AgentLog(folder)
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).addFilter(log)
        try:
            torchrun(argv)
            return 0
        except ChildFailedError as e:
            records = read_records(folder)
            failures = [(f.pid, f.exitcode) for _, f in sorted(e.failures.items())]
            code = failures_outcome(failures, records)
            if code is not None:
                return code
            log.release()
            print(e.format_msg(), file=sys.stderr)  # torchrun's report, without its own call stack
            root = e.get_first_failure()[1].exitcode
            return root if root > 0 else 128 - root
        except SignalException as e:
            return signal_outcome(e.sigval, read_records(folder))
        except KeyboardInterrupt:  # before torchrun's agent took over SIGINT: no rank was started
            return 130
        finally:
            # torchrun's handlers raise SignalException wherever the next signal lands: from here on,
            # a signal ends this process the default way.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
