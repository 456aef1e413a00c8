"""A killed rank under torchrun (2 GPUs): the restarted run ends where the uninterrupted one did
(resume on one GPU: benchmarks/gpu/one_gpu.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from benchmarks.gpu.runner import ROOT, TORCHRUN, Setup
from benchmarks.gpu.verdicts import Result, same_losses


def killed_rank(setup: Setup, uninterrupted: dict, kill_after: int = 3) -> Result:
    """torchrun's restart after a SIGKILLed worker ends where the uninterrupted ddp run ended (world 2)."""
    from safetensors.torch import load_file

    check = "killed rank (torchrun restart)"
    out = setup.tmp / "killed"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "-m", "zerodp", "train",
           "configs/tiny.yaml", *setup.tiny(2), "strategy.name=ddp", f"train.out_dir={out}", "train.max_steps=8"]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=setup.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while agent.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.05)
    workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
    if not workers:
        agent.kill()
        return Result(check, False, f"no worker to kill (agent exit {agent.poll()})")
    os.kill(int(workers[-1]), signal.SIGKILL)
    try:
        log = agent.communicate(timeout=240)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        return Result(check, False, "the restarted run did not finish within 240 s")
    if agent.returncode != 0 or "resuming from" not in log:
        tail = " | ".join(log.strip().splitlines()[-3:])
        seen = "seen" if "resuming from" in log else "not seen"
        return Result(check, False, f"exit {agent.returncode}, restart {seen}: {tail}")
    losses = [json.loads(x)["loss"] for x in metrics.read_text().splitlines()]
    r = same_losses(check, losses, uninterrupted["losses"])
    latest = (out / "checkpoints" / "latest").read_text().strip()
    weights = load_file(out / "checkpoints" / latest / "model.safetensors")
    differ = [n for n, w in uninterrupted["weights"].items() if not bool((weights[n] == w).all())]
    if r.ok and differ:
        return Result(check, False, f"weights differ from the uninterrupted run: {', '.join(differ[:3])}")
    return Result(check, r.ok, r.detail + ("; final weights bit-identical" if r.ok else ""))
