"""Plain helper functions shared by the strategies (no strategy inherits from another)."""

from __future__ import annotations

import contextlib
import json
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from zerodp.convert.full_state import FullState  # what load_full receives
from zerodp.optim import adam_step

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
    """Write full fp32 weights and per-parameter AdamW state as safetensors (the zerodp layout), of the
    optimizer's parameters: every one, or a LoRA run's adapters alone (its frozen base is not saved).

    model.safetensors: {name: fp32 weight}; optim.safetensors: {name/exp_avg, name/exp_avg_sq};
    optim.json: AdamW step per parameter and the strategy's `extra` state (e.g. the loss scale)."""
    write_replicated(ckpt_dir, replicated_state(model, optimizer, extra, lambda _key, t: t.float().contiguous().cpu()))


def replicated_state(model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, copy) -> tuple:
    """What `save_replicated` writes, each tensor passed through `copy(key, tensor)` (a host copy:
    `.cpu()`, or zerodp.checkpoint.background.HostBuffers.copy for a background save)."""
    names = param_names(model, optimizer)
    params = dict(model.named_parameters())
    weights = {n: copy(n, params[n].detach()) for n in names}
    tensors, steps = {}, {}
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    for n, p in zip(names, flat):
        st = optimizer.state.get(p)
        if not st:
            continue
        tensors[f"{n}/exp_avg"] = copy(f"{n}/exp_avg", st["exp_avg"])
        tensors[f"{n}/exp_avg_sq"] = copy(f"{n}/exp_avg_sq", st["exp_avg_sq"])
        steps[n] = float(st["step"])
    return weights, tensors, json.dumps({"step": steps, "extra": extra})


def write_replicated(ckpt_dir: Path, state: tuple) -> None:
    """Write what `replicated_state` returned: the canonical safetensors writer, any thread."""
    weights, tensors, optim_json = state
    save_file(weights, ckpt_dir / "model.safetensors")
    save_file(tensors, ckpt_dir / "optim.safetensors")
    (ckpt_dir / "optim.json").write_text(optim_json)


def load_replicated(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt_dir: Path) -> dict:
    """Inverse of `save_replicated`, one tensor at a time (never a second copy of the model in host
    memory); returns the strategy's `extra` state."""
    params = dict(model.named_parameters())
    with torch.no_grad(), safe_open(ckpt_dir / "model.safetensors", "pt") as weights:
        for n in weights.keys():
            params[n].copy_(weights.get_tensor(n))
    meta = json.loads((ckpt_dir / "optim.json").read_text())
    names = param_names(model, optimizer)
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    with safe_open(ckpt_dir / "optim.safetensors", "pt") as moments:
        for n, p in zip(names, flat):
            if n not in meta["step"]:
                continue
            optimizer.state[p] = {
                "step": adam_step(optimizer, p, meta["step"][n]),
                "exp_avg": moments.get_tensor(f"{n}/exp_avg").to(p.device, p.dtype),
                "exp_avg_sq": moments.get_tensor(f"{n}/exp_avg_sq").to(p.device, p.dtype),
            }
    return meta["extra"]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def replicated_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, lr: float,
                    clip: float) -> torch.Tensor:
    """The optimizer step of a strategy whose ranks hold whole gradients (single, ddp): unscale (fp16),
    clip to the global norm, step, zero the gradients; return the norm before clipping, a tensor on the
    device (the loop fetches it at its next sync point)."""
    set_lr(optimizer, lr)
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


def replicated_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What a rank holding everything holds: params as held (fp32 master weights; a LoRA run's frozen
    base in train.precision's dtype), grads (fp32, of the trained parameters only), moments."""
    params = list(model.parameters())
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optim": tensor_bytes(optimizer_state_tensors(optimizer)),
    }


def hold_frozen(model: nn.Module, precision: str) -> None:
    """On the meta device, before the model is materialised or sharded: frozen parameters (LoRA's base)
    held in train.precision's dtype, 2 bytes each in bf16/fp16 (never updated, they need no fp32 master
    copy); trained ones (the adapters) stay fp32, AdamW's master weights. Tied weights stay one tensor."""
    if precision == "fp32":
        return
    dtype = DTYPES[precision]
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and p.dtype != dtype:
                module._parameters[name] = nn.Parameter(p.to(dtype), requires_grad=False)
    model.tie_weights()  # each alias was replaced on its own: point it at its source's new tensor again


def loaded_params(model: nn.Module, state: FullState) -> list[tuple[str, nn.Parameter]]:
    """The parameters `load_full` copies from `state` (every strategy's contract): all of them, and for a
    LoRA model (frozen parameters beside trained ones) those the state holds: its checkpoints hold the
    adapters only (the base came from model.init_from or the seed), a base model's weights lack the
    adapters (they keep their initial values). A full model's missing parameter raises CheckpointError."""
    params = list(model.named_parameters())
    if all(p.requires_grad for _, p in params):
        return params
    return [(n, p) for n, p in params if state.holds(n)]


def load_full_replicated(model: nn.Module, optimizer: torch.optim.Optimizer, state: FullState) -> None:
    """Every rank holds everything (single, ddp): copy every weight the state holds (frozen ones too: the
    base of a LoRA run, in the dtype it is held in), and with `state.with_optimizer` the AdamW state of
    the trained ones."""
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    with torch.no_grad():
        for n, p in loaded_params(model, state):
            p.copy_(state.get(n, "param", p.shape))
            if state.with_optimizer and id(p) in trained:
                optimizer.state[p] = {
                    "step": adam_step(optimizer, p, state.step(n)),
                    "exp_avg": state.get(n, "exp_avg", p.shape).to(p.device, p.dtype),
                    "exp_avg_sq": state.get(n, "exp_avg_sq", p.shape).to(p.device, p.dtype),
                }


class LocalGradNorms:
    """This rank's own gradient norm squared per micro batch, before any reduction: the small batch of
    the gradient noise scale (zerodp.telemetry.grad_noise). A hook on each parameter (`watch`) sees the gradient
    of one backward before autograd accumulates it into .grad, so before DDP's reducer, DeepSpeed's
    and FSDP's reduction hooks, which all run at or after that accumulation; it adds the norm squared
    to a device scalar (one norm per parameter per micro batch, no host sync). A tied weight's hook sees
    the sum of its uses' gradients, once."""

    def __init__(self, device: torch.device):
        self.total = torch.zeros((), device=device)
        self._watched: dict[int, weakref.ref] = {}  # by id: a Tensor's == is elementwise, no set or WeakSet

    def watch(self, params) -> None:
        """Hook every parameter of `params` that needs a gradient and is not hooked yet."""
        for p in params:
            known = self._watched.get(id(p))
            if not p.requires_grad or (known is not None and known() is p):
                continue
            p.register_hook(self._add)
            self._watched[id(p)] = weakref.ref(p)

    def _add(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self.total.add_(torch.linalg.vector_norm(grad, dtype=torch.float32).square())

    def take(self, grad_accum_steps: int, loss_scale=1.0) -> torch.Tensor:
        """The mean over this step's micro batches of |g|^2, g the gradient of one micro batch's mean
        loss; resets. The hooks saw the gradients of loss / grad_accum_steps x loss_scale (a float or,
        for torch's GradScaler, the scale tensor: no host sync), which this undoes."""
        taken, self.total = self.total, torch.zeros_like(self.total)
        return taken * (grad_accum_steps / loss_scale**2)


def grad_scale(scaler: torch.amp.GradScaler):
    """The loss scale the gradients carry: 1.0, or with fp16 GradScaler's scale tensor, read without a
    host sync (its public get_scale() calls .item()). Read before scaler.update() changes it."""
    return scaler._get_scale_async() if scaler.is_enabled() else 1.0


def local_grad_norms(ctx, params=()) -> LocalGradNorms | None:
    """The strategy's LocalGradNorms, watching `params`, when train.grad_noise_scale asks for them and
    the batch split has two batch sizes to compare (zerodp.telemetry.grad_noise.skip_reason); else None."""
    from zerodp.telemetry.grad_noise import skip_reason

    t = ctx.cfg.train
    if not t.grad_noise_scale or skip_reason(ctx.world_size, t.micro_batch_size, t.global_batch_size):
        return None
    norms = LocalGradNorms(ctx.device)
    norms.watch(params)
    return norms


def zero_attr_kind(attr: str) -> str:
    """Which state_bytes key a ZeRO optimizer attribute belongs to, by DeepSpeed's naming: ipg
    (reduce) buckets -> buckets, *grad* (partitions, averaged gradients) -> grads, *fp32* (master
    partitions) -> optim, bit16/fp16/lp/param -> params."""
    a = attr.lower()
    if "ipg" in a or "bucket" in a:
        return "buckets"
    if "grad" in a and "norm" not in a:
        return "grads"
    if "fp32" in a:
        return "optim"
    if any(k in a for k in ("bit16", "fp16", "lp_param", "param")):
        return "params"
    return "buffers"


def zero_tensors(value, depth: int = 0):
    """Tensors inside `value` (nested lists, tuples, dicts, and the `buffer` of DeepSpeed's IPGBucket
    objects, not their params or grads lists), a few levels deep."""
    if torch.is_tensor(value):
        yield value
    elif depth < 4 and hasattr(value, "buffer") and hasattr(value, "elements"):  # IPGBucket, IPGBucketZ3
        yield from zero_tensors(value.buffer, depth + 1)
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            yield from zero_tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from zero_tensors(v, depth + 1)
