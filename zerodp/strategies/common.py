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


def replicated_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, lr: float, clip: float) -> float:
    """The optimizer step of a strategy whose ranks hold whole gradients (single, ddp): unscale (fp16),
    clip to the global norm, step, zero the gradients; return the norm before clipping."""
    set_lr(optimizer, lr)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def replicated_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What a rank holding everything holds: fp32 params (= master weights), fp32 grads, moments."""
    params = list(model.parameters())
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optim": tensor_bytes(optimizer_state_tensors(optimizer)),
    }


class FullState:
    """Full fp32 tensors by the model's own parameter names, from any checkpoint source
    (`zerodp.convert.open_checkpoint`): what lets any strategy at any world size start from a
    checkpoint written by any other. Shapes are checked; tied aliases are followed. Weights in Hugging
    Face's names and layouts (an HF model folder, a `--to hf` export) are read through the family's
    table in zerodp/models/hf.py (GPT-2's Conv1D weights transposed, GPT2Model's unprefixed names,
    HF's mask buffers ignored)."""

    def __init__(self, source, with_optimizer: bool):
        from zerodp.convert.source import names_layout
        from zerodp.errors import CheckpointError
        from zerodp.models import hf

        if source.meta.get("hf_config_error"):  # an HF folder of a model zerodp cannot run
            raise CheckpointError(source.meta["hf_config_error"])
        self.source = source
        stored_names = source.param_names()
        layout = names_layout(source)
        family = (source.meta.get("config") or {}).get("model", {}).get("arch") or hf.family_of_names(stored_names)
        # model name -> (stored name, transform): the table read backwards for HF weights, else the identity
        self.stored: dict[str, tuple[str, str | None]] = {}
        for n in stored_names:
            if layout == "hf" and family:
                if hf.is_buffer(family, n):
                    continue
                hit = hf.from_hf(family, n)
                self.stored[hit[0] if hit else n] = (n, hit[1]) if hit else (n, None)
            else:
                self.stored[n] = (n, None)
        model_name = {s: m for m, (s, _) in self.stored.items()}
        tied = {model_name.get(a, a): model_name.get(s, s) for a, s in source.tied().items()}
        self._tied = tied
        self.aliases = {**tied, **{stored: alias for alias, stored in tied.items()}}
        self.names = set(self.stored)
        self.with_optimizer = with_optimizer and all(source.has(s, "exp_avg") for s, _ in self.stored.values())

    def _stored(self, name: str) -> tuple[str, str | None]:
        for c in (name, self.aliases.get(name)):
            if c in self.stored:
                return self.stored[c]
        from zerodp.errors import CheckpointError

        raise CheckpointError(f"{self.source.path} has no parameter {name!r} (it has {len(self.names)}, e.g. "
                              f"{sorted(self.names)[:3]}); the model config must describe the checkpoint's model")

    def param_names(self) -> list[str]:
        """The source's parameters by the model's names (a tied alias not listed), in the source's order."""
        return list(self.stored)

    def tied(self) -> dict[str, str]:
        """{alias: stored name} of the source's tied weights, by the model's names."""
        return dict(self._tied)

    def shape(self, name: str) -> tuple[int, ...]:
        """`name`'s shape in the model's layout, read from the source's header (no tensor data)."""
        from zerodp.models.hf import transposed

        stored, transform = self._stored(name)
        return transposed(self.source.info(stored).shape, transform)

    def source_dtype(self, name: str) -> torch.dtype:
        return self.source.info(self._stored(name)[0]).dtype

    def has(self, name: str, kind: str) -> bool:
        return self.source.has(self._stored(name)[0], kind)

    def mismatch(self, shapes: dict[str, tuple]) -> str | None:
        """Why the source cannot fill a model with these parameter `shapes` (None when it can): names
        missing there, names there this model lacks, and shapes that differ, each with examples."""
        from zerodp.errors import CheckpointError

        used, missing, wrong = set(), [], []
        for name, shape in shapes.items():
            try:
                stored, _ = self._stored(name)
            except CheckpointError:
                missing.append(name)
                continue
            used.add(stored)
            have = self.shape(name)
            if have != tuple(shape):
                wrong.append(f"{name} is {list(have)} there, {list(shape)} here")
        extra = sorted(m for m, (s, _) in self.stored.items() if s not in used and m not in self.aliases)
        parts = []
        if missing:
            parts.append(f"{len(missing)} of this model's parameters are missing there (e.g. {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} parameters there are not in this model (e.g. {extra[0]})")
        if wrong:
            parts.append(f"{len(wrong)} have another shape (e.g. {wrong[0]})")
        return "; ".join(parts) or None

    def get(self, name: str, kind: str, shape) -> torch.Tensor:
        from zerodp.models.hf import TRANSPOSE

        stored, transform = self._stored(name)
        t = self.source.get(stored, kind).float()
        if transform == TRANSPOSE:
            t = t.t().contiguous()  # HF's Conv1D keeps (in, out); nn.Linear (out, in)
        if tuple(t.shape) != tuple(shape):
            from zerodp.errors import CheckpointError

            raise CheckpointError(f"{self.source.path}: {name} has shape {tuple(t.shape)} there but {tuple(shape)} "
                                  f"in this model; set the model section to the checkpoint's dimensions")
        return t

    def step(self, name: str) -> float:
        s = self.source.step(self._stored(name)[0])
        return float(s) if s is not None else 0.0


def load_full_replicated(model: nn.Module, optimizer: torch.optim.Optimizer, state: FullState) -> None:
    """Every rank holds everything (single, ddp): copy weights, and AdamW state if the source has it."""
    names = param_names(model, optimizer)
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        for n, p in zip(names, flat):
            p.copy_(state.get(n, "param", p.shape))
            if state.with_optimizer:
                optimizer.state[p] = {
                    "step": torch.tensor(state.step(n), dtype=torch.float32),
                    "exp_avg": state.get(n, "exp_avg", p.shape).to(p.device, p.dtype),
                    "exp_avg_sq": state.get(n, "exp_avg_sq", p.shape).to(p.device, p.dtype),
                }
