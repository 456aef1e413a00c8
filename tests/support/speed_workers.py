"""Rank functions of the speed tests (tests/distributed/test_speed_gpu.py), run by
tests.support.harness.run_distributed."""

from __future__ import annotations

import torch

from zerodp.config import load_config
from zerodp.models import build_model
from zerodp.optim import adamw, param_groups


def fused_against_unfused(overrides: list[str], steps: int) -> dict:
    """The same model trained `steps` AdamW steps twice on this rank's device, with torch's fused kernel
    (zerodp.optim.adamw on CUDA) and with the default path; the largest weight difference and the
    losses. Both see the same batches and the same gradients at step one."""
    cfg = load_config(None, overrides)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    runs = {}
    for fused in (True, False):
        model = build_model(cfg.model, cfg.train.seed, device=device)
        groups = param_groups(model, cfg)
        opt = adamw(groups, cfg, device.type) if fused else adamw(groups, cfg, "cpu")
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(steps):
            x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size), generator=gen).to(device)
            loss = model(x, x.roll(-1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs[fused] = ({n: p.detach().float().cpu() for n, p in model.named_parameters()}, losses,
                       opt.param_groups[0]["fused"])
    (fw, fl, f_flag), (uw, ul, u_flag) = runs[True], runs[False]
    return {"max_weight_diff": max((fw[n] - uw[n]).abs().max().item() for n in fw), "fused_losses": fl,
            "unfused_losses": ul, "flags": [bool(f_flag), bool(u_flag)]}


def prefetched_pinned(overrides: list[str]) -> dict:
    """Two steps through the prefetch thread for this rank's device: whether every tensor handed over
    is pinned, and whether the values are a direct call's."""
    from zerodp.data.batches import TokenBatches, load_tokens, prefetch

    cfg = load_config(None, overrides)
    device = torch.device("cuda", torch.cuda.current_device())
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    got = list(prefetch(data, range(2), cfg, 0, 1, 2, device))
    pinned = [t.is_pinned() for _, mbs in got for xy in mbs for t in xy]
    want = [data.rank_micro_batches(s, cfg.train.global_batch_size, cfg.train.micro_batch_size, 0, 1) for s, _ in got]
    equal = all(torch.equal(a, b) for (_, mbs), w in zip(got, want) for xy, wxy in zip(mbs, w) for a, b in zip(xy, wxy))
    return {"pinned": pinned, "equal": equal}
