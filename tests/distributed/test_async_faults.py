"""Faults during a background save (checkpoint.async_save): a rank killed while a save is in flight
leaves that save unpublished and the restart ends bit-identical; SIGTERM lets the save in flight finish,
then takes the final checkpoint; a write that fails stops the run with one line, the previous
checkpoint intact.

The kill and the signal land mid-write: the test stops every rank (SIGSTOP) as soon as a `step_*.tmp`
folder holds a file, checks under the freeze that it is still unpublished, and only then kills or
signals."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.distributed.test_faults import final_weights, metric_lines, small, start_pair, torchrun, workers_of
from tests.support.harness import ROOT, base_env, run_distributed
from zerodp.checkpoint import store

ASYNC = ["checkpoint.async_save=true", "checkpoint.keep_last=3", "train.progress=false"]


def unpublished(root: Path, after: int) -> int | None:
    """The step of a background save past step `after` being written: its folder still `.tmp`, with
    some of its files in it; or None."""
    for tmp in root.glob("step_*.tmp"):
        step = int(tmp.name.split("_")[1].split(".")[0])
        if step > after and any(p.is_file() for p in tmp.iterdir()):
            return step
    return None


def stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"


def freeze_mid_save(pids: list[int], root: Path, after: int, within: float = 180) -> int:
    """Stop `pids` (SIGSTOP) at a moment a background save past step `after` is in flight (its folder
    still `.tmp`, checked once every rank is stopped); return its step. The ranks stay stopped."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if unpublished(root, after) is None:
            time.sleep(0.001)
            continue
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        while not all(stopped(pid) for pid in pids):
            time.sleep(0.001)
        step = unpublished(root, after)
        if step is not None:
            return step
        for pid in pids:  # published between the look and the stop: try the next save
            os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"no background save seen in flight in {root}")


def test_sigkill_during_a_background_save_restarts_from_the_newest_complete_one(tiny, tmp_path):
    steps = 8
    reference = tmp_path / "uninterrupted"
    run_distributed("tests.support.workers:train_runs", 2,
                    {"runs": [{"overrides": small(tiny, reference, steps) + ASYNC}]})
    out = tmp_path / "run"
    root = out / "checkpoints"
    agent = torchrun(small(tiny, out, steps) + ASYNC, restarts=1)
    try:
        deadline = time.monotonic() + 120
        while len(workers_of(agent)) < 2 and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        ranks = workers_of(agent)
        step = freeze_mid_save(ranks, root, after=2)  # step 2's checkpoint is published by then
        previous = store.step_dir_name(step - 2)
        assert (root / "latest").read_text().strip() == previous
        assert not (root / store.step_dir_name(step)).exists()
        assert store.verify(root / previous) is None  # the newest complete one, intact
        os.kill(min(ranks), signal.SIGKILL)  # one of the two ranks, both frozen mid-save
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        log = agent.communicate(timeout=300)[0].decode(errors="replace")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode == 0, log[-3000:]
    assert f"resuming from {root / previous} at step {step - 2}" in log, log[-3000:]
    got, want = final_weights(out), final_weights(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] == want[name]).all(), f"{name} differs after the kill at step {step}'s save"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))


def test_sigterm_during_a_background_save_lets_it_finish_then_saves_within_the_grace_period(tiny, tmp_path):
    out = tmp_path / "run"
    root = out / "checkpoints"
    grace = 60
    procs = start_pair([sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml",
                        *small(tiny, out, steps=500, every=2), *ASYNC, "train.log_every=1",
                        f"train.preempt_grace_s={grace}"])
    try:
        pids = [p.pid for p in procs]
        step = freeze_mid_save(pids, root, after=2)
        for pid in pids:  # as a scheduler would: every rank gets the signal, here while frozen mid-save
            os.kill(pid, signal.SIGTERM)
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        codes = [p.wait(timeout=grace) for p in procs]
        took = time.monotonic() - t0
        err = procs[0].communicate()[1]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0] and took < grace, (codes, took, err[-3000:])
    final = (root / "latest").read_text().strip()
    stop = int(final.split("_")[1])
    assert f"preempted: stopped after step {stop}, checkpoint saved" in err, err[-3000:]
    assert step < stop < 500 and metric_lines(out) == stop
    for name in (store.step_dir_name(step), final):  # the one in flight and the final one: complete, intact
        assert store.verify(root / name) is None, name
    assert not list(root.glob("*.tmp"))


def test_a_background_write_that_fails_stops_the_run_with_one_line(tiny, tmp_path):
    """A disk that refuses the writes (RLIMIT_FSIZE: every write past 64 KiB into a file fails with
    EFBIG, as it does for root too) after step 2's checkpoint was saved: the background save of step 4
    fails, the run stops at the next step, exit 2, one line naming the folder and the error;
    step_00000002 stays intact and `latest`."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    run = small(tiny, out, steps=6, every=2) + ASYNC
    run_distributed("tests.support.workers:train_runs", 2,
                    {"runs": [{"overrides": [*run, "train.max_steps=2"]}]})
    limit = 64 * 1024
    assert (root / "step_00000002" / "model.safetensors").stat().st_size > limit  # the next save cannot fit

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail instead

    env = base_env(2)
    procs = [subprocess.Popen([sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", *run], cwd=ROOT,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), preexec_fn=small_files, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    lines = [x for err in errs for x in err.splitlines() if "error" in x.lower() or "Traceback" in x]
    assert len(lines) == 1 and errs[0].strip().endswith(lines[0]), errs  # rank 0's last line, alone
    line = lines[0]
    assert line.startswith("zerodp: error: could not write checkpoint step_00000004 in " + str(root)), line
    assert "File too large" in line and "the newest intact checkpoint is still step_00000002" in line, line
    assert metric_lines(out) <= 5  # stopped at the step after the failed save's
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert store.verify(root / "step_00000002") is None
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
