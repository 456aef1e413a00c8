"""Rank functions of tests/distributed/test_replicas.py: training runs in which one rank's weight gets
one flipped bit, right after an optimizer step (run with fresh=True: they patch the loop)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerodp.config import load_config
from zerodp.errors import PeerFailure


def flip_one_bit(runs: list[dict], rank: int, after_step: int, bit: int = 0) -> list[dict]:
    """Each of `runs` ({"overrides"}) trained with bit `bit` of the first element of the first weight
    flipped on `rank` right after step `after_step`'s optimizer step; per run: the error's line (or
    None), the checkpoint `latest` names, the published step folders and the metrics records that
    carry a replica_mismatch."""
    import torch.distributed as dist

    from zerodp.trainer import loop

    original, out = loop.train_step, []
    for run in runs:
        steps = {"done": 0}

        def flipping(strategy, micro_batches, lr, device, steps=steps):
            result = original(strategy, micro_batches, lr, device)
            steps["done"] += 1
            if steps["done"] == after_step and dist.get_rank() == rank:
                with torch.no_grad():
                    weight = next((getattr(strategy, "module", None) or strategy.model).parameters())
                    local = weight.to_local() if hasattr(weight, "to_local") else weight  # HSDP: this rank's shard
                    local.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << bit)
            return result

        loop.train_step = flipping
        cfg = load_config(None, run["overrides"])
        error = None
        try:
            loop.train(cfg, fresh=True)
        except PeerFailure as e:
            error = str(e)
        finally:
            loop.train_step = original
        dist.barrier()
        folder = Path(cfg.train.out_dir)
        ckpts = folder / "checkpoints"
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
        out.append({"error": error, "latest": (ckpts / "latest").read_text().strip() if (ckpts / "latest").exists()
                    else None, "published": sorted(p.name for p in ckpts.glob("step_*") if not p.name.endswith(".tmp")),
                    "mismatches": [r for r in metrics if "replica_mismatch" in r],
                    "last_step": metrics[-1]["step"] if metrics else None})
    return out
