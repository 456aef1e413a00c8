"""Plain helper functions shared by the strategies (no strategy inherits from another)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device: torch.device):
    """torch.autocast for 16-bit compute over fp32 parameters; a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (tied or aliased tensors counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        if hasattr(t, "to_local"):  # DTensor: count this rank's shard
            t = t.to_local()
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                yield v


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own order (the order AdamW state is indexed by)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def save_replicated(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt_dir: Path, extra: dict) -> None:
    """Write full fp32 weights and per-parameter AdamW state as safetensors (the zerodp layout).

    model.safetensors: {name: fp32 weight}; optim.safetensors: {name/exp_avg, name/exp_avg_sq};
    optim.json: AdamW step per parameter and the strategy's `extra` state (e.g. the loss scale)."""
    names = param_names(model, optimizer)
    params = dict(model.named_parameters())
    save_file({n: params[n].detach().float().contiguous().cpu() for n in names}, ckpt_dir / "model.safetensors")
    tensors, steps = {}, {}
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    for n, p in zip(names, flat):
        st = optimizer.state.get(p)
        if not st:
            continue
        tensors[f"{n}/exp_avg"] = st["exp_avg"].float().contiguous().cpu()
        tensors[f"{n}/exp_avg_sq"] = st["exp_avg_sq"].float().contiguous().cpu()
        steps[n] = float(st["step"])
    save_file(tensors, ckpt_dir / "optim.safetensors")
    (ckpt_dir / "optim.json").write_text(json.dumps({"step": steps, "extra": extra}))


def load_replicated(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt_dir: Path) -> dict:
    """Inverse of `save_replicated`; returns the strategy's `extra` state."""
    weights = load_file(ckpt_dir / "model.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(w)
    moments = load_file(ckpt_dir / "optim.safetensors")
    meta = json.loads((ckpt_dir / "optim.json").read_text())
    names = param_names(model, optimizer)
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    for n, p in zip(names, flat):
        if n not in meta["step"]:
            continue
        optimizer.state[p] = {
            "step": torch.tensor(meta["step"][n], dtype=torch.float32),
            "exp_avg": moments[f"{n}/exp_avg"].to(p.device, p.dtype),
            "exp_avg_sq": moments[f"{n}/exp_avg_sq"].to(p.device, p.dtype),
        }
    return meta["extra"]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr
