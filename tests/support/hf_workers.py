"""Functions run on every rank by tests.support.harness.run_distributed for tests/distributed/test_hf.py."""

from __future__ import annotations

import torch

from zerodp.checkpoint import store as checkpoint
from zerodp.config import load_config
from zerodp.distributed.process_group import init_distributed
from zerodp.models import build_model
from zerodp.strategies import RunContext, make_strategy
from zerodp.trainer.loop import train
from zerodp.trainer.start import plan_start


def hf_jobs(jobs: list[dict]) -> list[dict]:
    """Run jobs in turn in one process group: {"kind": "train", "overrides", "fresh"} trains (returning
    the losses and the final full weights); {"kind": "logits", "overrides", "idx"} returns the logits of
    the model as `model.init_from` leaves it, before any step, under the configured strategy."""
    out = []
    for job in jobs:
        cfg = load_config(None, job["overrides"])
        if job["kind"] == "train":
            s = train(cfg, fresh=job.get("fresh", True), return_weights=True)
            out.append({"losses": [s["losses"][k] for k in sorted(s["losses"])], "weights": s["weights"]})
        else:
            out.append({"logits": logits_after_init(cfg, torch.tensor(job["idx"]))})
    return out


def logits_after_init(cfg, idx: torch.Tensor) -> torch.Tensor:
    """What zerodp.trainer.loop does up to the first step (the start plan's checks included), then a forward."""
    env = init_distributed(cfg.train.device, cfg.strategy.timeout_s)
    grad_accum = cfg.check_batch_split(env.world_size)
    plan = plan_start(cfg, fresh=True, set_aside_damaged=False, rank=env.rank)
    torch.manual_seed(cfg.train.seed)
    strategy = make_strategy(cfg.strategy.name)
    strategy.setup(build_model(cfg.model), RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device,
                                                      grad_accum, env.local_world_size))
    checkpoint.init_from(strategy, cfg.model.init_from)
    assert env.rank != 0 or plan.init_from == cfg.model.init_from
    strategy.model.eval()
    with torch.no_grad():
        return strategy.model(idx.to(env.device)).float().cpu()
