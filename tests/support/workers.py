"""Functions run on every rank by tests.support.harness.run_distributed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist

import zerodp.trainer.loop
from zerodp.config import load_config
from zerodp.data.batches import TokenBatches
from zerodp.errors import PeerFailure
from zerodp.trainer.loop import train


def train_runs(runs: list[dict]) -> list[dict]:
    """Train several configs in turn in one process group: [{"overrides": [...], "fresh": bool}]."""
    results = []
    for run in runs:
        cfg = load_config(run.get("config"), run["overrides"])
        summary = train(cfg, fresh=run.get("fresh", True), return_weights=True)
        # rank 0 writes metrics.jsonl: every step's comm_bytes, to check that each step sends the same,
        # and its gradient noise scale, to check that every strategy measures the same
        metrics = Path(cfg.train.out_dir) / "metrics.jsonl"
        records = [json.loads(x) for x in metrics.read_text().splitlines()] if dist.get_rank() == 0 else []
        steps = [r.get("comm_bytes") for r in records] if dist.get_rank() == 0 else None
        results.append({"losses": [summary["losses"][k] for k in sorted(summary["losses"])],
                        "weights": summary["weights"], "state_bytes": summary["state_bytes"],
                        "strategy": summary["strategy"], "comm": summary["comm"],
                        "comm_steps": steps, "planned": summary["planned"],
                        "noise": [r.get("grad_noise_scale") for r in records]})
    return results


def several(calls: list[dict]) -> list:
    """Run several of these functions in turn in one process group, where each would otherwise start
    its own (each launch costs the ranks' start-up: torch, DeepSpeed): [{"target": "module:function",
    "kwargs": {...}}]. Returns their results, in order."""
    import importlib

    results = []
    for call in calls:
        module, fn = call["target"].split(":")
        results.append(getattr(importlib.import_module(module), fn)(**call.get("kwargs", {})))
    return results


def die_at_step(overrides: list[str], rank: int, step: int) -> dict:
    """`rank` dies (no goodbye) when it starts optimizer step `step`; the others report what they saw."""
    real_step = zerodp.trainer.loop.train_step
    calls = {"n": 0}

    def dying_step(*args, **kwargs):
        if dist.get_rank() == rank and calls["n"] == step:
            os._exit(1)
        calls["n"] += 1
        return real_step(*args, **kwargs)

    zerodp.trainer.loop.train_step = dying_step
    try:
        train(load_config(None, overrides + ["strategy.timeout_s=30"]), fresh=True)
    except PeerFailure as e:
        return {"error": str(e), "no_barrier": True}
    return {"error": None, "no_barrier": True}


def hang_at_step(overrides: list[str], rank: int, step: int, seconds: float) -> dict:
    """`rank` stops answering at optimizer step `step` for `seconds` (then leaves); the others time out."""
    real_step = zerodp.trainer.loop.train_step
    calls = {"n": 0}

    def hanging_step(*args, **kwargs):
        if dist.get_rank() == rank and calls["n"] == step:
            time.sleep(seconds)
            os._exit(0)
        calls["n"] += 1
        return real_step(*args, **kwargs)

    zerodp.trainer.loop.train_step = hanging_step
    started = time.monotonic()
    try:
        train(load_config(None, overrides), fresh=True)
    except PeerFailure as e:
        return {"error": str(e), "waited_s": time.monotonic() - started, "no_barrier": True}
    return {"error": None, "no_barrier": True}


def slow_rank(overrides: list[str], rank: int, delay: float, where: str) -> dict:
    """Slow `rank` by `delay` seconds per step, in its compute or in its data loading; or, with
    where="device", by `delay` seconds per matrix multiply (a device that computes slowly). The
    slowed functions are put back after the run (`several` runs this more than once in a process)."""
    import torch
    import torch.nn.functional as F

    from zerodp.models import GPT

    real = (F.linear, torch.mm, GPT.forward, TokenBatches.rank_micro_batches)
    if dist.get_rank() == rank:
        if where == "device":
            def slowed(fn):
                def slow(*args, **kwargs):
                    time.sleep(delay)
                    return fn(*args, **kwargs)
                return slow

            F.linear, torch.mm = slowed(F.linear), slowed(torch.mm)
        elif where == "compute":  # a slow device: its forward (and backward) take longer
            real_forward = GPT.forward

            def slow_forward(self, *args, **kwargs):
                time.sleep(delay)
                return real_forward(self, *args, **kwargs)

            GPT.forward = slow_forward
        else:
            real_batches = TokenBatches.rank_micro_batches

            def slow_batches(self, *args, **kwargs):
                time.sleep(delay)
                return real_batches(self, *args, **kwargs)

            TokenBatches.rank_micro_batches = slow_batches
    cfg = load_config(None, overrides + ["data.prefetch=0"])
    try:
        summary = train(cfg, fresh=True)
    finally:
        F.linear, torch.mm, GPT.forward, TokenBatches.rank_micro_batches = real
    records = [json.loads(x) for x in (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()] \
        if dist.get_rank() == 0 else []
    return {"records": records, "straggler_wait_s": summary["straggler_wait_s"]}


def find_resumable_shared(out_dir: str) -> dict:
    """Run the collective resume lookup; report what it found and which files this rank hashed."""
    from zerodp.checkpoint import manifest, store as checkpoint

    real, hashed = manifest.sha256_file, []

    def recording(path):
        hashed.append(str(Path(path).relative_to(out_dir)))
        return real(path)

    manifest.sha256_file = recording
    try:
        found = checkpoint.find_resumable(out_dir)
    finally:
        manifest.sha256_file = real
    return {"found": str(found), "hashed": hashed}
