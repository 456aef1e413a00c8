"""Rank functions for tests/distributed/test_async_checkpoint.py: runs with checkpoint.async_save."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from zerodp.config import load_config
from zerodp.trainer.loop import train


def manifests(out: str) -> dict:
    """{checkpoint name: {file: sha256}} of every published checkpoint in out (rank 0's view)."""
    root = Path(out) / "checkpoints"
    found = {}
    for meta in sorted(root.glob("step_*/meta.json")):
        found[meta.parent.name] = {k: v["sha256"] for k, v in json.loads(meta.read_text())["files"].items()}
    return found


def sync_and_async(overrides: list[str], out: str) -> dict:
    """The same run saved synchronously and in the background: both runs' checkpoints and weights."""
    result = {}
    for mode in ("sync", "async"):
        cfg = load_config(None, [*overrides, f"train.out_dir={out}/{mode}", f"checkpoint.async_save={mode == 'async'}"])
        summary = train(cfg, fresh=True, return_weights=True)
        dist.barrier()
        result[mode] = {"manifests": manifests(f"{out}/{mode}"), "weights": summary["weights"],
                        "save_s": summary.get("checkpoint_save_s")}
    return result
