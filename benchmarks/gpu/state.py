"""Checks of what a run leaves and picks up again: resume and memory (1 GPU, fsdp and zero3 on GPT-2
124M's shape), determinism across processes, and a killed rank under torchrun (2 GPUs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from benchmarks.gpu.runner import COMMON, GPT2, ROOT, TORCHRUN, Setup, launch, run_spec
from benchmarks.gpu.verdicts import Result, same_losses, within


def resume_memory(setup: Setup) -> list[Result]:
    results: list[Result] = []
    first = {}
    tmp = setup.tmp
    for strategy in ("fsdp", "zero3"):
        base = COMMON + GPT2 + [f"strategy.name={strategy}", "checkpoint.every=2"]
        runs = []
        for precision in ("bf16", "fp16"):
            over = base + [f"train.precision={precision}"]
            straight = over + (["train.sample_tokens=16"] if precision == "bf16" else [])
            runs += [run_spec(straight, tmp / f"{strategy}-{precision}-a", 4),
                     run_spec(over, tmp / f"{strategy}-{precision}-b", 2),
                     run_spec(over, tmp / f"{strategy}-{precision}-b", 4, fresh=False)]
        try:
            got = launch(setup, runs, 1)
        except RuntimeError as e:
            results.append(Result(f"resume/memory {strategy}", False, str(e)))
            continue
        first[strategy] = got[0]
        for i, precision in enumerate(("bf16", "fp16")):
            a, resumed = got[3 * i], got[3 * i + 2]
            error = a.get("error") or resumed.get("error")
            results.append(Result(f"resume {strategy} {precision}", False, error) if error else
                           same_losses(f"resume {strategy} {precision}", resumed["losses"], a["losses"][2:]))
        results.append(memory_check(strategy, base + ["train.precision=bf16"], got[0]))
    if "fsdp" in first and "error" not in first["fsdp"]:
        over = COMMON + GPT2 + ["strategy.name=fsdp", "checkpoint.every=2", "train.precision=bf16",
                                "train.sample_tokens=16"]
        try:
            again = launch(setup, [run_spec(over, tmp / "determinism", 4)], 1)[0]
            results.append(Result("determinism", False, again["error"]) if "error" in again else
                           same_losses("determinism fsdp bf16 (a second process)", again["losses"],
                                       first["fsdp"]["losses"]))
        except RuntimeError as e:
            results.append(Result("determinism", False, str(e)))
    setup.cache["gpt2 fsdp bf16"] = first.get("fsdp")
    return results


def memory_check(strategy: str, overrides: list[str], run: dict) -> Result:
    from zerodp.config import load_config
    from zerodp.planner import plan_for_training

    if "error" in run:
        return Result(f"memory {strategy}", False, run["error"])
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), overrides)
    plan = plan_for_training(cfg, 1, run["device_memory"], run["device_name"])
    row = next((e for e in plan.estimates if e.name == strategy), None)
    if row is None or "setup" not in run["peaks"] or "sample" not in run["peaks"]:
        return Result(f"memory {strategy}", False, f"no planner row or no measurement: {run['peaks']}")
    p, context = run["peaks"], row.overhead_bytes
    return within(f"memory {strategy} bf16", [
        ("after setup", p["setup"], row.startup_bytes - context),
        ("training and final save", p["train"], row.total_bytes - context),
        ("end-of-run sample", p["sample"], p["train"])])


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
