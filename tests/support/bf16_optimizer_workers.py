"""Rank functions for tests/distributed/test_bf16_optimizer.py: zero1 in bf16 with fp32 accumulation, which
DeepSpeed runs as its BF16_Optimizer, trained with a checkpoint and resumed under zero1 and ddp."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from tests.support.workers import train_runs


def save_and_resume(full: list[str], part: list[str], resume: dict[str, list[str]], pristine: str) -> dict:
    """Train `full` (uninterrupted) and `part` (with a checkpoint); rank 0 copies part's run directory
    for each resume and once more to `pristine` (left untouched, for convert and inspect); then resume
    each copy under its strategy. {"full", "part", name: result}."""
    first, saved = train_runs([{"overrides": full}, {"overrides": part}])
    src = Path(next(o.split("=", 1)[1] for o in part if o.startswith("train.out_dir=")))
    if dist.get_rank() == 0:
        for out in [*(next(o.split("=", 1)[1] for o in over if o.startswith("train.out_dir="))
                      for over in resume.values()), pristine]:
            shutil.copytree(src, out)
    dist.barrier()
    resumed = train_runs([{"overrides": over, "fresh": False} for over in resume.values()])
    for r in (first, saved, *resumed):
        r["weights"] = {k: v.float() for k, v in r["weights"].items()} if r["weights"] else r["weights"]
    return {"full": first, "part": saved, **dict(zip(resume, resumed))}
