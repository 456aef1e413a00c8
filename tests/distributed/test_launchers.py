"""The launchers end a launch the way zerodp's ranks chose: their one line and exit code (2 for bad input,
130 after Ctrl-C, 0 after a preemption checkpoint), without torchrun's tracebacks; a rank that crashes
still shows its traceback, torchrun's failure report and a nonzero code (zerodp.distributed.launcher)."""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.harness import ROOT, base_env, free_port
from zerodp.distributed import launcher

# The small model of tests/distributed/test_first_day.py, under ddp on the 2 CPU processes of launchers/local.sh.
# train.log_every=3: the ranks share a signal at every 3rd step (a sync point), so a signal once step 3's
# records are out stops the run after step 6 (after step 20 with the default 10).
SMALL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "data.max_bytes=200000",
         "data.prefetch=0", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
         "train.sample_tokens=0", "train.progress=false", "strategy.name=ddp", "checkpoint.every=0",
         "train.log_every=3"]
# What plain torchrun adds to the ranks' own account.
TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "SignalException", "death signal", "closing signal",
                  "exitcode")


def launch_env(**extra) -> dict:
    """A shell's environment for the launchers: no rank variables, the test's python first on PATH."""
    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "OMP_NUM_THREADS"):
        env.pop(k)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update(extra)
    return env


def start(cmd: list[str], **env) -> subprocess.Popen:
    """`cmd` in a session of its own: a terminal's Ctrl-C is os.killpg(proc.pid, SIGINT)."""
    return subprocess.Popen(cmd, env=launch_env(**env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def wait_for_step(proc: subprocess.Popen, out: Path, step: int = 3, timeout: float = 180) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.time() < deadline, finish(proc)
        time.sleep(0.05)


def saved_step(err: str, out: Path, said: str) -> int:
    """The step the ranks said they saved (`said` the start of zerodp's line); checks that checkpoint."""
    from zerodp.checkpoint import store as checkpoint

    found = re.search(rf"{said}: stopped after step (\d+), checkpoint saved", err)
    assert found, err
    ckpt = out / "checkpoints" / f"step_{int(found.group(1)):08d}"
    assert checkpoint.verify(ckpt) is None and checkpoint.read_meta(ckpt)["world_size"] == 2
    return int(found.group(1))


# -- launchers/local.sh, what `make quickstart` and the README run ---------------------------------------------

def test_bad_override_under_local_sh_is_zerodps_one_line_and_exit_2():
    """Before: the line, then torchrun's log lines and ChildFailedError traceback, exit 1."""
    r = subprocess.run(["launchers/local.sh", "configs/tiny.yaml", "train.max_stepz=3"], env=launch_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.splitlines() == ["zerodp: error: unknown key 'train.max_stepz' in configs/tiny.yaml (with "
                                     "overrides); did you mean 'train.max_steps'?"], r.stderr
    assert r.stdout == "local.sh: 2 process(es) on the CPU\n"


# -- the README's launch on several processes: what a user types ---------------------------------------------------

def readme_launch() -> list[str]:
    """The words of the README's launch of configs/tiny.yaml on several processes (its Train section);
    every other launch the README shows with --nproc-per-node starts the same way."""
    from tests.distributed.test_readme import README, commands

    launches = [shlex.split(c.shell) for c in commands(README.read_text(encoding="utf-8"))
                if "--nproc-per-node" in c.shell]
    runnable = [w for w in launches if "configs/tiny.yaml" in w and not any("..." in x for x in w)]
    assert runnable, "README.md shows no launch of configs/tiny.yaml with --nproc-per-node"
    launcher_words = runnable[0][:runnable[0].index("--nproc-per-node")]
    assert all(w[:len(launcher_words)] == launcher_words for w in launches), launches
    return runnable[0]


def test_bad_override_under_the_readmes_launch_is_zerodps_one_line_and_exit_2():
    """Before (plain torchrun): the line, then torchrun's log lines and ChildFailedError traceback, exit 1."""
    r = subprocess.run([*readme_launch(), "train.max_stepz=3"], env=launch_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.splitlines() == ["zerodp: error: unknown key 'train.max_stepz' in configs/tiny.yaml (with "
                                     "overrides); did you mean 'train.max_steps'?"], r.stderr


def test_ctrl_c_under_the_readmes_launch_saves_and_exits_130_without_a_traceback(tmp_path):
    """Before (plain torchrun): both ranks saved and said so, then torchrun's SignalException traceback,
    exit 1. launchers/local.sh runs the same launcher (its bad input: above)."""
    out = tmp_path / "run"
    proc = start([*readme_launch(), *SMALL, f"train.out_dir={out}", "train.max_steps=100000"])
    wait_for_step(proc, out)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
    _, err = finish(proc)
    assert proc.returncode == 130, err
    saved_step(err, out, "Ctrl-C")
    assert not [noise for noise in TORCHRUN_NOISE if noise in err], err


# -- launchers/multinode_torchrun.sh: the agent forwards a signal it alone received ---------------------------------

def test_sigterm_to_multinode_torchrun_sh_preempts_and_exits_0(tmp_path):
    """A scheduler's SIGTERM to the agent (with restarts left): forwarded, the ranks save and leave with 0,
    and so does the launch (plain torchrun: a SignalException traceback, exit 1)."""
    out = tmp_path / "run"
    proc = start(["launchers/multinode_torchrun.sh", "configs/tiny.yaml", *SMALL, f"train.out_dir={out}",
                  "train.max_steps=100000"], NNODES="1", NPROC="2", RDZV_HOST="127.0.0.1",
                 RDZV_PORT=str(free_port()), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    wait_for_step(proc, out)
    proc.send_signal(signal.SIGTERM)  # the agent only
    _, err = finish(proc)
    assert proc.returncode == 0, err
    saved_step(err, out, "preempted")
    assert not [noise for noise in TORCHRUN_NOISE if noise in err], err


# -- launchers/multinode_deepspeed.sh: DeepSpeed's runner exits 1 after a Ctrl-C --------------------------------------

# Stand-ins for what DeepSpeed's pdsh runner calls (as in tests/distributed/test_dist.py): `ssh` succeeds,
# `pdsh -w a,b CMD` runs CMD for each host here in a bare environment; the runner's kill command (pkill -f on
# every node) is not run, since it would reach whatever matches on this machine: the terminal's SIGINT stops the ranks.
PDSH = r"""#!/usr/bin/env bash
while getopts "Sf:w:" o; do case $o in w) hosts=$OPTARG ;; *) ;; esac; done; shift $((OPTIND - 1))
case "$*" in pkill*) exit 0 ;; esac
IFS=, read -ra names <<<"$hosts"; pids=()
for i in "${!names[@]}"; do env -i HOME="$HOME" PATH="$PATH" bash -c "${*//%n/$i}" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


def test_ctrl_c_under_multinode_deepspeed_sh_saves_and_exits_130(tmp_path):
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    for name, text in (("pdsh", PDSH), ("ssh", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o700)
    # what reaches the ranks through the bare "ssh" environment (PYTHONPATH: DeepSpeed exports PYTHON*)
    (home / ".deepspeed_env").write_text(f"DS_ACCELERATOR=cpu\nZERODP_CACHE={os.environ['ZERODP_CACHE']}\n"
                                         "OMP_NUM_THREADS=1\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    out = tmp_path / "run"
    proc = start(["launchers/multinode_deepspeed.sh", str(hostfile), "configs/tiny.yaml", *SMALL,
                  f"train.out_dir={out}", "train.max_steps=100000"], HOME=str(home), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(free_port()), PATH=f"{bin_dir}{os.pathsep}{launch_env()['PATH']}")
    wait_for_step(proc, out)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = finish(proc)
    assert proc.returncode == 130, err
    saved_step(err, out, "Ctrl-C")
    assert "Traceback" not in err


# -- a genuine failure is still shown -------------------------------------------------------------------------------

@pytest.mark.parametrize("how, code, shown", [
    ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
    ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9, "Signal 9 (SIGKILL) received by PID"),
])
def test_a_rank_that_crashes_shows_its_traceback_torchruns_report_and_its_code(tmp_path, how, code, shown):
    script = tmp_path / "crash.py"
    script.write_text(f"import os, signal, time\nif os.environ['RANK'] == '1':\n    {how}\ntime.sleep(60)\n")
    r = subprocess.run([sys.executable, "-m", "zerodp.distributed.launcher", "--standalone", "--nproc-per-node", "2",
                        str(script)],
                       env=launch_env(OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == code, r.stderr
    assert shown in r.stderr
    # torchrun's account, as plain torchrun gives it, less its own call stack
    assert "Sending process" in r.stderr and "closing signal SIGTERM" in r.stderr
    assert "crash.py FAILED" in r.stderr and re.search(r"rank\s+: 1 \(local_rank: 1\)", r.stderr)
    assert "torch/distributed/run.py" not in r.stderr


# -- bad input to the launcher scripts themselves ---------------------------------------------------------------------

@pytest.mark.parametrize("cmd, env, pattern", [
    (["launchers/local.sh"], {}, r"^local.sh: error: no config given; usage: launchers/local.sh CONFIG.yaml"),
    (["launchers/multinode_torchrun.sh"], {"RDZV_HOST": "node-001"}, r"^multinode_torchrun.sh: error: no config"),
    (["launchers/multinode_torchrun.sh", "configs/tiny.yaml"], {},
     r"^multinode_torchrun.sh: error: RDZV_HOST is not set; set it to the first node's host name"),
    (["launchers/multinode_deepspeed.sh", "configs/tiny.yaml"], {},
     r"^multinode_deepspeed.sh: error: a hostfile and a config are needed"),
    (["launchers/multinode_deepspeed.sh", "/nonexistent/hostfile", "configs/tiny.yaml"], {},
     r"^multinode_deepspeed.sh: error: hostfile /nonexistent/hostfile not found"),
    (["bash", "launchers/slurm.sbatch"], {}, r"^slurm.sbatch: error: no config given"),
])
def test_bad_input_to_a_launcher_script_is_one_line_exit_2(cmd, env, pattern):
    r = subprocess.run(cmd, env=launch_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.splitlines()) == 1 and re.search(pattern, r.stderr), r.stderr


# -- how zerodp.distributed.launcher judges, without processes ---------------------------------------------------------

def test_a_rank_records_the_code_it_chose(tmp_path, monkeypatch):
    monkeypatch.setenv(launcher.OUTCOME_DIR, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert launcher.record_exit(1) == 1
    assert launcher.read_records(tmp_path) == {os.getpid(): {"code": 1, "local_rank": 1, "local_world_size": 2,
                                                             "attempt": 3}}
    monkeypatch.delenv(launcher.OUTCOME_DIR)
    assert launcher.record_exit(2) == 2  # without a launcher asking: nothing written, nowhere


@pytest.mark.parametrize("failures, records, outcome", [
    ([(10, 2), (11, -15)], {}, 2),               # rank 0's bad input; the agent stopped rank 1
    ([(10, -15), (11, 2)], {}, 2),               # rank 1 printed first
    ([(10, 1), (11, 1)], {10: {"code": 1}, 11: {"code": 1}}, 1),  # a peer failure, said by both
    ([(10, 1), (11, -15)], {}, None),            # an uncaught exception
    ([(10, 1), (11, -15)], {10: {"code": 2}}, None),  # a record of another code: not this exit
    ([(10, 1), (11, -9)], {10: {"code": 1}}, None),  # rank 1 was killed: by nobody zerodp knows
    ([(10, -15), (11, -15)], {}, None),          # nothing chosen
])
def test_failures_outcome(failures, records, outcome):
    assert launcher.failures_outcome(failures, records) == outcome


def _rec(local_rank, code, attempt=0, size=2):
    return {"code": code, "local_rank": local_rank, "local_world_size": size, "attempt": attempt}


@pytest.mark.parametrize("signum, records, outcome", [
    (signal.SIGINT, {1: _rec(0, 130), 2: _rec(1, 130)}, 130),   # Ctrl-C: both saved
    (signal.SIGTERM, {1: _rec(0, 0), 2: _rec(1, 0)}, 0),        # preempted, checkpoint saved
    (signal.SIGTERM, {1: _rec(0, 0)}, 143),                     # rank 1 left without a word
    (signal.SIGINT, {1: _rec(0, 2), 2: _rec(1, 2)}, 2),         # the save failed: bad out_dir
    (signal.SIGINT, {}, 130),                                   # before any rank chose
    (signal.SIGTERM, {1: _rec(0, 1), 2: _rec(1, 1), 3: _rec(0, 0, attempt=1), 4: _rec(1, 0, attempt=1)}, 0),
])
def test_signal_outcome(signum, records, outcome):
    assert launcher.signal_outcome(signum, records) == outcome


def test_agent_log_holds_back_the_account_of_a_shutdown_zerodp_chose(tmp_path):
    shown = []
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    agent = logging.getLogger("tests.distributed.test_launchers.agent")
    agent.propagate = False
    agent.addHandler(handler)
    log = launcher.AgentLog(tmp_path)
    agent.addFilter(log)
    stop = ("Sending process %s closing signal %s", 11, "SIGTERM")
    failed = ("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 10, "python")
    agent.warning(*stop)
    agent.error(*failed)  # exit 2: zerodp's bad input; both lines stay off the console
    assert shown == []
    (tmp_path / "12").write_text('{"code": 1}')
    agent.warning(*stop)
    agent.error(failed[0], 1, 0, 12, "python")  # exit 1, recorded: a peer failure zerodp named
    assert shown == []
    agent.warning(*stop)
    agent.error(failed[0], 1, 0, 13, "python")  # exit 1, unrecorded: a crash, shown as torchrun shows it
    assert shown == ["Sending process 11 closing signal SIGTERM", "failed (exitcode: 1) local_rank: 0 (pid: 13) "
                     "of binary: python"]
    shown.clear()
    agent.warning(*stop)
    agent.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 11, "SIGTERM", "SIGKILL")
    assert shown == ["Sending process 11 closing signal SIGTERM",
                     "Unable to shutdown process 11 via SIGTERM, forcefully exiting via SIGKILL"]
    shown.clear()
    agent.warning("Received %s death signal, shutting down workers", 2)
    agent.warning(*stop)
    assert shown == []  # a signal's shutdown: the ranks say what they did
