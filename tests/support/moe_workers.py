"""Functions run on every rank by tests.support.harness.run_distributed for tests/distributed/test_qwen3_moe.py."""

from __future__ import annotations

import torch

from tests.support.hf_workers import hf_jobs
from tests.support.reference import reference_run
from zerodp.checkpoint import store as checkpoint
from zerodp.config import load_config
from zerodp.distributed.process_group import init_distributed
from zerodp.models.moe import SparseMoeBlock
from zerodp.models.moe_spec import moe_spec
from zerodp.trainer.loop import _core, set_up, train_step


def moe_jobs(jobs: list[dict]) -> list[dict]:
    """hf_jobs' jobs, and {"kind": "routes", "overrides", "tokens", "steps"}: `steps` steps on micro batches
    that hold token tokens[rank] only, returning each step's loss and balance loss and the experts every
    router chose on this rank in the first step; {"kind": "first_step", "overrides", "x", "y"}: model.init_from's
    weights, one train_step on (x, y), its LM loss and balance loss."""
    out = []
    for job in jobs:
        if job["kind"] not in ("routes", "first_step"):
            out += hf_jobs([job])
            continue
        cfg = load_config(None, job["overrides"])
        env = init_distributed(cfg.train.device, cfg.strategy.timeout_s)
        accum = cfg.check_batch_split(env.world_size)
        torch.manual_seed(cfg.train.seed)
        strategy, _ = set_up(cfg, env, accum)
        if job["kind"] == "first_step":
            checkpoint.init_from(strategy, cfg.model.init_from)
            figures: dict = {}
            loss, *_ = train_step(strategy, [(torch.tensor(job["x"]), torch.tensor(job["y"]))], 1e-3, env.device,
                                  figures)
            out.append({"loss": loss.item(), "balance_loss": figures["balance_loss"].item()})
            continue
        chosen: list[list[int]] = []

        def record(module, args, result):  # the router's (probabilities, weights, experts)
            chosen.append(sorted(set(result[2].flatten().tolist())))

        hooks = [m.gate.register_forward_hook(record) for m in _core(strategy.model).modules()
                 if isinstance(m, SparseMoeBlock)]
        shape = (cfg.train.micro_batch_size, cfg.model.block_size)
        x = torch.full(shape, job["tokens"][env.rank])
        losses, balances, first = [], [], None
        for _ in range(job["steps"]):
            figures = {}
            loss, *_ = train_step(strategy, [(x, x)] * accum, 1e-3, env.device, figures)
            losses.append(loss.item())
            balances.append(figures["balance_loss"].item())
            if first is None:
                first = list(chosen)
        for h in hooks:
            h.remove()
        out.append({"losses": losses, "balance": balances, "experts": first})
    return out


def moe_reference(cfg, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """tests.support.reference.reference_run with the balance loss: one process, plain AdamW, one forward
    over each global batch for the LM loss (its target mean, a loss mask's and document masking's batches
    as they are) plus router_aux_loss_coef x the balance loss. `sequence`: the global batch's own (the mean
    over its sequences, whatever the split); `micro_batch`: by definition a micro batch's, so the mean over
    the micro batches that `world` ranks at train.micro_batch_size train on (the same rows in each)."""
    G, micro = cfg.train.global_batch_size, cfg.train.micro_batch_size

    def balance(model, data, step):
        if moe_spec(cfg.model.moe).balance != "micro_batch":
            return model.aux_loss  # the global batch's forward
        parts = []
        for rank in range(world):
            for batch in data.rank_micro_batches(step, G, micro, rank, world):
                model(*batch)
                parts.append(model.aux_loss)
        return sum(parts) / len(parts)

    return reference_run(cfg, balance)
