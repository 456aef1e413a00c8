"""zerodp.optim's AdamW: the fused kernel on CUDA only, and AdamW state written on load placed where
AdamW itself keeps it. The fused step's numbers against the default path: tests/distributed/test_speed_gpu.py."""

from __future__ import annotations

import torch

from zerodp.config import load_config
from zerodp.optim import adam_step, adamw, fused_adamw, param_groups


def test_fused_only_for_cuda_parameters():
    assert fused_adamw("cuda") is True
    assert fused_adamw("cpu") is False and fused_adamw("meta") is False


def test_cpu_adamw_is_the_default_path(tiny):
    cfg = load_config(None, tiny)
    params = [torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))]
    groups = [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}]
    opt = adamw(groups, cfg, "cpu")
    assert [g["fused"] for g in opt.param_groups] == [False, False]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_step_state_placed_as_adamw_places_it():
    """torch keeps a fused group's step on the parameter's device, an unfused one's on the CPU
    (torch/optim/adam.py, "special device hosting for step"); adam_step agrees with what AdamW makes at
    its first step, shown on the CPU for the unfused path and with meta parameters for the placement."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p])
    opt.step()
    made = opt.state[p]["step"]
    built = adam_step(opt, p, 7)
    assert (built.device, built.dtype, built.item()) == (made.device, made.dtype, 7.0)
    meta = torch.nn.Parameter(torch.empty(3, device="meta"))
    fused = torch.optim.AdamW([meta], fused=True)
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.empty(3, device="meta"))])
    assert adam_step(fused, meta, 3).device.type == "meta"
    assert adam_step(plain, plain.param_groups[0]["params"][0], 3).device.type == "cpu"


def test_param_groups_split_matrices_from_the_rest(tiny):
    from zerodp.models import build_model

    cfg = load_config(None, tiny)
    decay, rest = param_groups(build_model(cfg.model, device="meta"), cfg)
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == cfg.optim.weight_decay
    assert rest["weight_decay"] == 0.0 and any(p.dim() == 1 for p in rest["params"])
