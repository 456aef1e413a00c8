"""Writers for the conversion tests: plain DeepSpeed and plain FSDP2 programs (no zerodp code),
run on real gloo processes through tests.support.harness.run_distributed. No tests live here."""

from __future__ import annotations

import os

import torch
from torch import nn


class TiedNet(nn.Module):
    """A tiny LM-shaped net with a tied embedding/head and odd sizes (so ZeRO pads its partitions)."""

    def __init__(self, vocab: int = 37, width: int = 10):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.body = nn.Linear(width, 3 * width + 1)
        self.proj = nn.Linear(3 * width + 1, width)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T) token ids
        h = self.wte(x)
        h = h + self.proj(torch.tanh(self.body(h)))
        return self.head(self.ln(h))  # (B, T, vocab)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 37, (3, 5), generator=g)
    return x, torch.roll(x, 1, dims=1)


def deepspeed_write(out: str, stage: int, bf16: bool, steps: int = 3) -> dict:
    """Train TiedNet under plain deepspeed.initialize and save; return live full params and moments."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    torch.manual_seed(0)
    model = TiedNet()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    cfg = {
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16}, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    for step in range(steps):
        x, y = _batch(int(os.environ["RANK"]), step)
        logits = engine(x)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 37), y.reshape(-1))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)
    result = {}
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed links each parameter to its optimizer-state fragment once, after the first step; a
        # group whose state did not exist yet then stays unlinked. Relink so the live moments can be read.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    for n, p in engine.module.named_parameters():
        result[n] = safe_get_full_fp32_param(p).detach().float().clone()
        result[n + "/exp_avg"] = safe_get_full_optimizer_state(p, "exp_avg").detach().float().clone()
        result[n + "/exp_avg_sq"] = safe_get_full_optimizer_state(p, "exp_avg_sq").detach().float().clone()
    return result


def fsdp_write(out: str, steps: int = 2) -> dict:
    """Train TiedNet under plain fully_shard and save a DCP checkpoint of model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TiedNet()
    fully_shard(model.proj)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        x, y = _batch(int(os.environ["RANK"]), step)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 37), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out)
    return {}


def deepspeed_write_all(root: str, configs: list[list]) -> dict:
    """deepspeed_write for each [stage, bf16] into root/s{stage}_{bf16} (one process start for all)."""
    return {f"s{stage}_{int(bf16)}": deepspeed_write(f"{root}/s{stage}_{int(bf16)}", stage, bf16)
            for stage, bf16 in configs}
