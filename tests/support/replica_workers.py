"""Rank functions of tests/distributed/test_replicas.py: training runs in which one rank's weight gets
one flipped bit, right after an optimizer step (run with fresh=True: they patch the loop)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zerodp.config import load_config
from zerodp.errors import PeerFailure


def flip_gathered(module: torch.nn.Module, bit: int) -> None:
    """From the next forward on, flip bit `bit` of the first element of `module`'s first parameter in the
    copy the engine gathered (its own pre-forward hooks ran), before the replica check's hook hashes it:
    a fault of this rank's gathered copy, not of its shard (the engine frees the copy after use)."""
    def flip(mod, _args):
        with torch.no_grad():
            next(mod.parameters(recurse=False)).view(-1)[:1].view(torch.int32).bitwise_xor_(1 << bit)

    module.register_forward_pre_hook(flip)
    hooks = list(module._forward_pre_hooks.items())  # ..., the engine's, the check's (registered last), ours
    module._forward_pre_hooks.clear()
    module._forward_pre_hooks.update(hooks[:-2] + [hooks[-1], hooks[-2]])


def flip_one_bit(runs: list[dict], rank: int, after_step: int, bit: int = 0) -> list[dict]:
    """Each of `runs` ({"overrides", "gathered"}) trained with bit `bit` of the first element of the first
    weight flipped on `rank` right after step `after_step`'s optimizer step (with "gathered": in the copy
    each later forward gathers, `flip_gathered`); per run: the error's line (or None), the checkpoint
    `latest` names, the published step folders and the metrics records that carry a replica_mismatch."""
    import torch.distributed as dist

    from zerodp.trainer import loop

    original, out = loop.train_step, []
    for run in runs:
        steps = {"done": 0}

        def flipping(strategy, micro_batches, lr, device, *rest, steps=steps, gathered=run.get("gathered", False)):
            result = original(strategy, micro_batches, lr, device, *rest)
            steps["done"] += 1
            if steps["done"] == after_step and dist.get_rank() == rank and gathered:
                model = getattr(strategy, "module", None) or strategy.model
                flip_gathered(next(m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), bit)
            elif steps["done"] == after_step and dist.get_rank() == rank:
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
