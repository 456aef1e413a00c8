"""Faults: a killed rank under torchrun restarts bit-identically; SIGTERM saves and exits; dead peers and
stragglers are named."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import TINY
from tests.support.harness import ROOT, base_env, free_port, run_distributed

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def small(tiny, out, steps=12, every=2):
    return [a for a in tiny if not a.startswith("checkpoint.every")] + [
        "strategy.name=ddp", "train.global_batch_size=8", f"train.max_steps={steps}",
        f"checkpoint.every={every}", "checkpoint.keep_last=2", f"train.out_dir={out}"]


def torchrun(args: list[str], restarts: int = 3) -> subprocess.Popen:
    env = base_env(2)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--max-restarts", str(restarts), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "zerodp", "train", "configs/tiny.yaml", *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def metric_lines(out: Path) -> int:
    p = out / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def workers_of(agent: subprocess.Popen) -> list[int]:
    r = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True)
    return [int(x) for x in r.stdout.split()]


def final_weights(out: Path) -> dict:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return load_file(out / "checkpoints" / latest / "model.safetensors")


# A finished run exits 0 on every rank, every time: gloo threads still finishing their last collective
# while Python shuts down used to abort about one launch in five ("terminate called without an active
# exception", exit -6). CLEAN_EXITS finished two-rank launches are checked for it in every run of this
# file: the SIGKILL launch's last generation, the SIGTERM/SIGUSR1 launch, the two-node launch, the
# srun-style pair, and the rest in test_ranks_exit_cleanly_after_success_and_after_a_shared_error.
CLEAN_EXITS = 5
CLEAN_EXIT_BROKEN = "terminate called"


def started(log: str) -> int:
    """How often the workers started: resuming from the newest checkpoint, or from step 0 where no save was
    complete yet (a kill mid-save leaves no checkpoint behind)."""
    return log.count("resuming from") + log.count("no checkpoint in")


def kill_a_worker(agent: subprocess.Popen, out: Path, after: int, delay: float, rng: random.Random,
                  spare: set[int]) -> set[int]:
    """SIGKILL one of the agent's workers (none of `spare`, an earlier generation's) `delay` s after
    metrics.jsonl holds `after` records; return the generation's pids."""
    deadline = time.monotonic() + 240
    while metric_lines(out) < after and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(delay)  # lands mid-step or mid-save
    victims = workers_of(agent)
    assert victims and not spare & set(victims), f"no workers to kill after {after} steps: the run finished too early"
    os.kill(rng.choice(victims), signal.SIGKILL)
    return set(victims)


def test_sigkill_at_random_moments_restarts_bit_identical(tiny, tmp_path):
    """One torchrun launch, a worker SIGKILLed at two random moments (seeded): after step 1-6, and 1-4 steps
    after the restarted workers' first records. Both restarts resume (--max-restarts 3) and the final
    weights equal an uninterrupted run's, bit for bit."""
    steps = 20  # the second kill lands by step 14: 6 steps (and 3 saves) remain, so it always finds workers
    reference = tmp_path / "uninterrupted"
    run_distributed("tests.support.workers:train_runs", 2, {"runs": [{"overrides": small(tiny, reference, steps)}]})
    want = final_weights(reference)
    rng = random.Random(int(os.environ.get("ZERODP_FAULT_SEED", "1234")))
    out = tmp_path / "run"
    agent = torchrun(small(tiny, out, steps) + ["train.progress=false"])
    kills = [rng.randint(1, 6), rng.uniform(0.0, 0.2), rng.randint(1, 4), rng.uniform(0.0, 0.2)]
    first = kill_a_worker(agent, out, kills[0], kills[1], rng, set())
    deadline = time.monotonic() + 240
    while not (set(workers_of(agent)) - first) and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the agent restarts the workers once the first generation is gone
    # the first generation can write no more: a record past those it left is the second's
    kill_a_worker(agent, out, metric_lines(out) + kills[2], kills[3], rng, first)
    log = agent.communicate(timeout=300)[0].decode(errors="replace")
    assert agent.returncode == 0, log[-3000:]
    assert started(log) >= 3, f"kills {kills}: not two restarts\n{log[-3000:]}"
    got = final_weights(out)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] == want[name]).all(), f"kills {kills}: {name} differs"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # the last generation's output (the earlier ones died by the kills): one of the CLEAN_EXITS launches
    last = max(log.rfind("resuming from"), log.rfind("no checkpoint in"))
    assert CLEAN_EXIT_BROKEN not in log[last:], log[last:]


def test_sigterm_and_sigusr1_finish_the_step_save_and_exit(tiny, tmp_path):
    """Either signal, as a scheduler sends it to every rank, stops the run after the same step on every
    rank with a checkpoint and exit 0. One launch: one rank gets SIGTERM, the other SIGUSR1 (a rank
    without a SIGUSR1 handler dies of it, and the launch fails); that each of the two alone asks for the
    stop (Preemption.request_code 1: exit 0 after the checkpoint) is checked in this process."""
    from zerodp.resilience.preemption import Preemption

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        preemption = Preemption(grace_s=1e9, announce=False)
        try:
            os.kill(os.getpid(), sig)
            time.sleep(0.01)  # the handler runs at the next bytecode of the main thread
            assert preemption.request_code == 1.0 and preemption.signal_name == sig.name
        finally:
            preemption.restore()
    out = tmp_path / "run"
    # train.log_every=3: the ranks share the signal at every 3rd step, so it stops the run after step 6
    agent = torchrun(small(tiny, out, steps=500, every=0) + ["train.progress=false", "train.log_every=3"], restarts=0)
    deadline = time.monotonic() + 240
    while metric_lines(out) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = sorted(workers_of(agent))
    assert len(workers) == 2, workers
    for pid, sig in zip(workers, (signal.SIGTERM, signal.SIGUSR1)):
        os.kill(pid, sig)
    log = agent.communicate(timeout=120)[0].decode(errors="replace")
    assert agent.returncode == 0, log[-3000:]
    assert "preempted: stopped after step" in log
    assert CLEAN_EXIT_BROKEN not in log, log  # one of the CLEAN_EXITS launches
    latest = (out / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert 3 <= step < 500
    assert metric_lines(out) == step  # every rank stopped after the same step


def test_dead_peer_is_named(tiny, tmp_path):
    results = run_distributed("tests.support.workers:die_at_step", 2,
                              {"overrides": small(tiny, tmp_path, steps=20, every=0), "rank": 1, "step": 3},
                              allow_missing=True)
    assert results[1] is None  # the dead rank wrote nothing
    msg = results[0]["error"]
    assert msg.startswith("rank 0 on ") and "rank 1 on " in msg and "last finished step 3" in msg, msg
    assert "Restart the job" in msg


def test_hung_peer_times_out_and_is_named(tiny, tmp_path):
    over = small(tiny, tmp_path, steps=20, every=0) + ["strategy.timeout_s=4"]
    results = run_distributed("tests.support.workers:hang_at_step", 2,
                              {"overrides": over, "rank": 1, "step": 2, "seconds": 10}, allow_missing=True)
    msg = results[0]["error"]
    assert msg is not None and "rank 1 on " in msg and "last finished step 2" in msg, msg
    assert results[0]["waited_s"] < 60  # the collective timeout, not the hang, decided when to stop


SLOW = {"compute": ("ddp", 0.25), "data": ("ddp", 0.25), "device-fsdp": ("fsdp", 0.002),
        "device-zero3": ("zero3", 0.002)}


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """Every slowed-rank run below, in one launch of 2 ranks: {case: rank 0's result}. Rank 1 is slowed by
    SLOW's delay, per step in its compute or its data loading, or per matrix multiply (a slow device)."""
    tmp = tmp_path_factory.mktemp("slowed")
    calls = [{"target": "tests.support.workers:slow_rank", "kwargs": {
        "overrides": small(TINY, tmp / case, steps=8, every=0) + [f"strategy.name={strategy}"], "rank": 1,
        "delay": delay, "where": case.split("-")[0]}} for case, (strategy, delay) in SLOW.items()]
    return dict(zip(SLOW, run_distributed("tests.support.workers:several", 2, {"calls": calls})[0]))


@pytest.mark.parametrize("where, cause", [("compute", "slow compute"), ("data", "data loading stall")])
def test_straggler_is_reported_with_its_cause(slowed, where, cause):
    res = slowed[where]
    found = [s for rec in res["records"] for s in rec.get("stragglers", [])]
    assert found and {s["rank"] for s in found} == {1}, res["records"]
    assert all(s["cause"] == cause for s in found)
    # with two ranks the median is their mean: the job waited about half the delay per step
    assert res["straggler_wait_s"] > 8 * 0.25 / 2 * 0.6


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_slow_device_is_found_where_the_forward_gathers_parameters(slowed, strategy):
    """Under fsdp and zero3 every rank's forward lasts as long as the slowest one's (the fast ranks wait
    inside its all-gathers), so forward time cannot name the culprit: the device probe does. Rank 1 is
    a slow device: each of its matrix multiplies takes 2 ms longer."""
    res = slowed[f"device-{strategy}"]
    found = [s for rec in res["records"] for s in rec.get("stragglers", [])]
    assert found and {s["rank"] for s in found} == {1}, res["records"]
    assert all(s["cause"] == "slow compute" and s["measured_by"] == "device probe" for s in found)


def test_two_nodes_on_loopback_train_like_one_process(tiny, tmp_path):
    """torchrun --nnodes 2 with separate node ranks on 127.0.0.1 follows the single-process losses."""
    from tests.support.reference import reference_run
    from zerodp.config import load_config

    over = small(tiny, tmp_path / "run", steps=6, every=0)
    ref_losses, _ = reference_run(load_config(None, over))
    port = free_port()
    env = base_env(2)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    agents = [subprocess.Popen(
        [TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "zerodp", "train", "configs/tiny.yaml", *over, "train.progress=false"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for node in (0, 1)]
    logs = [a.communicate(timeout=300)[0].decode(errors="replace") for a in agents]
    assert all(a.returncode == 0 for a in agents), logs[0][-2000:] + logs[1][-2000:]
    assert not any(CLEAN_EXIT_BROKEN in log for log in logs), logs  # one of the CLEAN_EXITS launches
    assert "on 2 process(es)" in logs[0]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, abs=1e-5)


def test_srun_style_environment_and_missing_master_addr(tiny, tmp_path):
    """Ranks started by srun carry SLURM_PROCID/SLURM_NTASKS only; without MASTER_ADDR that is an error,
    not N separate one-process jobs."""
    env = base_env(2)
    for k in ("MASTER_ADDR", "WORLD_SIZE"):
        env.pop(k)
    cmd = [sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", *small(tiny, tmp_path, steps=2, every=0)]
    r = subprocess.run(cmd, env=dict(env, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1"), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "rank 1 of 2 but MASTER_ADDR is not set" in r.stderr
    env["MASTER_ADDR"] = "127.0.0.1"
    procs = [subprocess.Popen(cmd, env=dict(env, SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r)),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert not any(CLEAN_EXIT_BROKEN in log for log in logs), logs  # one of the CLEAN_EXITS launches
    assert "on 2 process(es)" in logs[0]


def launch_pair(cmd: list[str]) -> list[subprocess.CompletedProcess]:
    """Start ranks 0 and 1 of `cmd` the way any launcher does (environment only); wait for both."""
    env = base_env(2)
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=240), *p.communicate()) for p in procs]


def test_ranks_exit_cleanly_after_success_and_after_a_shared_error(tiny, tmp_path):
    """A finished run exits 0 on every rank (CLEAN_EXITS launches, four of them in the tests above). An
    input error found after the process group is up exits 2 on every rank, with one line from rank 0."""
    train = [sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml"]
    for attempt in range(CLEAN_EXITS - 4):
        runs = launch_pair(train + small(tiny, tmp_path / str(attempt), steps=1, every=0)
                           + ["train.progress=false", "train.sample_tokens=0"])
        for r in runs:
            assert r.returncode == 0 and CLEAN_EXIT_BROKEN not in r.stderr, (attempt, r.returncode, r.stderr)
    runs = launch_pair(train + small(tiny, tmp_path / "bad", steps=1, every=0) + ["data.source=/nonexistent/corpus"])
    assert [r.returncode for r in runs] == [2, 2], [r.stderr for r in runs]
    assert runs[0].stderr.count("\n") == 1 and "data.source '/nonexistent/corpus' not found" in runs[0].stderr
    assert runs[1].stderr == ""


def start_pair(cmd: list[str], rank_args=lambda r: []) -> list[subprocess.Popen]:
    """Ranks 0 and 1 of `cmd`, as any launcher starts them (environment only); stderr apart from stdout."""
    env = base_env(2)
    return [subprocess.Popen(cmd + rank_args(r), env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]


def wait_exit(proc: subprocess.Popen, within: float) -> tuple[int | None, float, str]:
    """(exit code or None if still running after `within` s, seconds waited, stderr); a process still
    running is killed."""
    t0 = time.monotonic()
    try:
        proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        pass
    waited, code = time.monotonic() - t0, proc.poll()
    if code is None:
        proc.kill()
    return code, waited, proc.communicate()[1]


def test_a_peer_that_stops_answering_is_named_well_before_the_collective_timeout(tiny, tmp_path):
    """A stopped process keeps its sockets open: the collective waits for strategy.timeout_s (under nccl
    the watchdog then aborts without a word). Rank 1 is frozen (SIGSTOP) after 3 steps with
    strategy.timeout_s=60: rank 0's peer watch sees its heartbeat stop, prints the line naming it and
    exits 1 within about timeout_s / 10."""
    out = tmp_path / "run"
    procs = start_pair([sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml",
                        *small(tiny, out, steps=500, every=2), "train.progress=false", "strategy.timeout_s=60"])
    try:
        deadline = time.monotonic() + 180
        while metric_lines(out) < 3 and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.05)
        assert metric_lines(out) >= 3, procs[0].communicate(timeout=60)
        os.kill(procs[1].pid, signal.SIGSTOP)
        code, waited, err = wait_exit(procs[0], within=25)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert code == 1 and waited < 20, (code, waited, err[-3000:])
    line = err.strip().splitlines()[-1]
    assert line.startswith("zerodp: error: rank 0 on ") and "because rank 1 on " in line, err[-3000:]
    assert "(last finished step" in line and "no sign of life for 6s" in line, line
    assert "Restart the job" in line


def test_sigterm_while_blocked_on_a_hung_peer_exits_promptly(tiny, tmp_path):
    """Python runs a signal handler only once the main thread returns from the collective it is blocked
    in, which a hung peer delays until the collective timeout: torchrun's restart would wait out its
    shutdown timeout. Rank 1 hangs (its process alive: its heartbeat goes on) at step 6 with
    checkpoint.every=2; rank 0, blocked in step 6's gradient all-reduce, gets SIGTERM. It exits with 143
    within seconds, naming step_00000004, which is intact and the newest published checkpoint."""
    from zerodp.checkpoint import store as checkpoint

    out = tmp_path / "run"
    # train.log_every=1: every step's line is out when it ends (the loop's default fetches every 10th)
    kwargs = {"overrides": small(tiny, out, steps=500, every=2) + ["train.progress=false", "strategy.timeout_s=60",
                                                                   "train.log_every=1"],
              "rank": 1, "step": 5, "seconds": 60}
    procs = start_pair([sys.executable, "-m", "tests.support.harness", "tests.support.workers:hang_at_step",
                        json.dumps(kwargs), str(tmp_path), "cpu"])
    try:
        deadline = time.monotonic() + 180
        while metric_lines(out) < 5 and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.05)
        assert metric_lines(out) == 5, procs[0].communicate(timeout=60)
        time.sleep(1.0)  # rank 0 is now waiting for rank 1 inside step 6
        os.kill(procs[0].pid, signal.SIGTERM)
        code, waited, err = wait_exit(procs[0], within=30)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert code == 143 and waited < 15, (code, waited, err[-3000:])
    line = err.strip().splitlines()[-1]
    assert line.startswith("zerodp: error: SIGTERM: rank 0 on ") and "blocked in a collective at step 6" in line, err
    assert "the newest checkpoint, step_00000004, is intact" in line, line
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert sorted(p.name for p in root.iterdir() if checkpoint.is_step_dir(p)) == ["step_00000002", "step_00000004"]
    assert checkpoint.find_resumable(out) == root / "step_00000004"  # complete and intact
