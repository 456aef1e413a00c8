"""torch FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over the ranks.

Every parameter becomes a DTensor sharded on dim 0 (uneven sizes are padded inside FSDP; the local
shard seen here is unpadded). Each transformer block is one FSDP unit, the root unit holds the rest
(the embeddings, the final norm and the head). A unit's parameters are all-gathered before its forward,
freed after it when `reshard_after_forward` (ZeRO-3-like) or kept until backward (ZeRO-2-like),
all-gathered again in backward if they were freed, and its gradients are reduce-scattered (averaged)
every micro batch into the sharded gradients (once per optimizer step with
strategy.fsdp_defer_grad_reduce, at the cost of keeping unsharded gradients between micro batches).

Precision: the sharded fp32 parameters are the master weights. For bf16/fp16 FSDP casts the gathered
parameters to 16 bits for compute and reduce-scatters gradients in fp32 into fp32 gradient shards; the
optimizer steps the fp32 shards. fp16 adds dynamic loss scaling with torch.amp.GradScaler, whose
inf/nan check is reduced over all ranks for DTensor gradients (a step is skipped everywhere or nowhere).
With model.lora the frozen base is sharded in train.precision's dtype (FSDP2 asks one dtype of a unit's
trained parameters only: the fp32 adapters, its master weights; their gradients alone are reduced) and
the checkpoint holds the adapters and their AdamW state (the base comes from model.init_from or the seed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from zerodp.convert.safeload import safe_dcp_planner, safe_dcp_reader
from zerodp.distributed.process_group import mesh_options
from zerodp.errors import CheckpointError, UserError
from zerodp.models import compile_blocks
from zerodp.optim import adam_step, adamw, param_groups
from zerodp.strategies.base import RunContext
from zerodp.strategies.common import (
    DTYPES,
    FullState,
    grad_scale,
    hold_frozen,
    loaded_params,
    local_grad_norms,
    optimizer_state_tensors,
    set_lr,
    tensor_bytes,
)

CKPT_FORMAT = 1
DCP_DIR = "dcp"  # torch.distributed.checkpoint folder inside the checkpoint
META_FILE = "fsdp.json"  # beside it: naming, tying and the loss scale


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """16-bit compute over fp32 shards with fp32 gradient reduction; fp32 training casts nothing."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)


def offload(ctx: RunContext) -> OffloadPolicy:
    """FSDP2 offloads parameters, gradients and the optimizer step together: one switch for both flags."""
    s = ctx.cfg.strategy
    if s.offload_params or s.offload_optimizer:
        return CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")  # pinning needs a GPU
    return OffloadPolicy()


def device_mesh(ctx: RunContext):
    """1-D mesh (shard over every rank), or with strategy.hybrid_shard a 2-D (replicate, shard) mesh:
    parameters are sharded within a group (a node: all-gathers stay on the fast intra-node links) and
    replicated across groups, whose gradients are all-reduced (HSDP)."""
    s = ctx.cfg.strategy
    if not s.hybrid_shard:
        return init_device_mesh(ctx.device.type, (ctx.world_size,))
    group = s.shard_group_size or ctx.local_world_size
    if ctx.world_size % group:
        raise UserError(f"strategy.shard_group_size={group} does not divide the world size {ctx.world_size}; "
                        f"set it to the number of ranks per node (a divisor of {ctx.world_size})")
    # Its subgroups get strategy.timeout_s like the default group (a 1-D mesh reuses that group itself).
    options = mesh_options(ctx.device.type, s.timeout_s)
    return init_device_mesh(ctx.device.type, (ctx.world_size // group, group),
                            mesh_dim_names=("replicate", "shard"),
                            backend_override={"replicate": options, "shard": options})


def apply_fsdp(model: nn.Module, ctx: RunContext) -> nn.Module:
    """Shard `model` in place: one unit per transformer block, then the root.

    Ordering rules (torchtitan's parallelize: activation checkpointing, then compile, then shard):
    activation checkpointing is already inside the model's forward (it must wrap the block's forward
    inside the FSDP unit, so that recomputation re-gathers through FSDP's hooks); with train.compile each
    block's forward is compiled next (zerodp.models.compile_blocks), so FSDP's hooks stay outside it;
    blocks are sharded before the root, because fully_shard on a module takes every parameter not
    already claimed by a child unit: the root then holds only the embeddings (= lm_head when tied),
    the final norm and an untied head.
    The optimizer is built after this, over the DTensor shards."""
    if ctx.cfg.train.compile:
        compile_blocks(model)
    mesh = device_mesh(ctx)
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision(ctx.cfg.train.precision), offload_policy=offload(ctx))
    reshard = ctx.cfg.strategy.reshard_after_forward
    for block in model.blocks():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    # The root's parameters (lm_head) are the first needed in backward, right after forward ends:
    # keeping them gathered saves an all-gather and costs nothing at the peak (FSDP's own default).
    fully_shard(model, reshard_after_forward=False, **kwargs)
    params = dict(model.named_parameters(remove_duplicate=False))
    for alias, stored in model.tied_weights().items():
        assert params[alias] is params[stored] and isinstance(params[stored], DTensor), "sharding untied weights"
    return model


class FSDPStrategy:
    name = "fsdp"
    layout = "dcp"
    gathers_in_forward = True

    def check_config(self, cfg, world_size: int, grad_accum_steps: int) -> None:
        """What setup would refuse, checked without a process group: `zerodp train --dry-run`."""
        s = cfg.strategy
        group = s.shard_group_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if s.hybrid_shard and world_size % group:
            raise UserError(f"strategy.shard_group_size={group} does not divide the world size {world_size}; "
                            f"set it to the number of ranks per node (a divisor of {world_size})")

    def setup(self, model: nn.Module, ctx: RunContext) -> None:
        self.ctx = ctx
        # Sharded while still on the meta device, then each rank allocates only its own shards, on its
        # device (or in host memory with offload), and fills them with their initial values. LoRA's frozen
        # base is sharded in train.precision's dtype (FSDP2 asks one dtype of the trained parameters only).
        hold_frozen(model, ctx.cfg.train.precision)
        self.model = apply_fsdp(model, ctx)
        offloaded = ctx.cfg.strategy.offload_params or ctx.cfg.strategy.offload_optimizer
        self.model.to_empty(device="cpu" if offloaded else ctx.device)
        self._initialise(ctx.cfg.train.seed)
        self.optimizer = adamw(param_groups(self.model, ctx.cfg), ctx.cfg, "cpu" if offloaded else ctx.device.type)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.cfg.train.precision == "fp16")
        self._unsharded_peak = 0
        units = [*self.model.blocks(), self.model]
        # Both hooks run after FSDP's own pre-forward hook (prepended), so the unit's parameters are
        # gathered, and only until the first optimizer step: FSDP gathers the same units in the same order
        # every step, so the first step's forwards see the peak, and it gathers into the same unsharded
        # Parameter objects every time (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
        # init_unsharded_param), so the gradient hooks watch() puts on them stay. Scanning every
        # parameter at each unit's forward of every step cost fsdp's loop a few percent on a CPU.
        self._first_step_hooks = [unit.register_forward_pre_hook(self._measure_unsharded) for unit in units]
        self.local_norms = local_grad_norms(ctx)
        if self.local_norms is not None:
            self._first_step_hooks += [unit.register_forward_pre_hook(self._watch_unsharded) for unit in units]

    @torch.no_grad()
    def _initialise(self, seed: int) -> None:
        """Each rank draws only its shard's elements of every parameter's initial values (a pure
        function of seed and name: the same values one process holds there)."""
        for name, p in self.model.named_parameters():
            local = p.to_local()
            if local.numel():
                start, stop = _shard_range(p)
                local.view(-1).copy_(self.model.initial_values(name, seed, start, stop))

    def _measure_unsharded(self, module: nn.Module, args) -> None:
        """Bytes of parameters currently gathered (plain tensors, not DTensor shards), all units."""
        live = tensor_bytes(p for p in self.model.parameters() if not isinstance(p, DTensor))
        self._unsharded_peak = max(self._unsharded_peak, live)

    def _watch_unsharded(self, module: nn.Module, args) -> None:
        """Hook the unit's unsharded parameters (after FSDP's pre-forward: they are what autograd reaches;
        the DTensor shards never see a local gradient): their gradients are each rank's own, full, in the
        compute dtype, before the post-backward reduce-scatters them. Registered once per tensor."""
        self.local_norms.watch(p for p in module.parameters() if not isinstance(p, DTensor))

    def local_grad_sq(self) -> torch.Tensor | None:
        """This step's mean over micro batches of the rank's own gradient norm squared (before the
        reduction; zerodp.telemetry.grad_noise), or None when not measured. Call before step()."""
        return self.local_norms.take(self.ctx.grad_accum_steps, grad_scale(self.scaler)) if self.local_norms else None

    def micro_step(self, is_last: bool):
        # By default every micro batch's backward reduce-scatters into the sharded fp32 gradients, which
        # accumulate there: memory stays 1/N. With strategy.fsdp_defer_grad_reduce, sync is off until the
        # last micro batch: FSDP keeps every unit's unsharded fp32 gradient (4P bytes) and reduces once.
        # Set before forward: it applies to every unit's post-backward.
        self.model.set_requires_gradient_sync(is_last or not self.ctx.cfg.strategy.fsdp_defer_grad_reduce)
        return contextlib.nullcontext()

    def autocast(self):
        # FSDP's MixedPrecisionPolicy casts the gathered parameters; autocast on top would re-cast.
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self.ctx.grad_accum_steps).backward()

    def step(self, lr: float) -> torch.Tensor:
        set_lr(self.optimizer, lr)
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        # Each rank holds a shard of every gradient: the norm is a DTensor reduced over the mesh.
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        clip = self.ctx.cfg.optim.grad_clip
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        for hook in self._first_step_hooks:  # measured and watched: see setup
            hook.remove()
        self._first_step_hooks = []
        # With offload the gradient shards live in host memory, and so does their norm, while the loss and
        # the local norms are on the device, where the loop stacks them all. non_blocking: a blocking copy
        # would wait for the device's stream; from pageable memory CUDA stages the value at once.
        return norm.detach().to(self.ctx.device, non_blocking=True)

    def state_bytes(self) -> dict[str, int]:
        """This rank's bytes, counted from live tensors (padding of uneven shards included).

        'params': the fp32 parameter shards, which are also the master weights in bf16/fp16 (FSDP keeps
        no other copy; the ZeRO paper's 16-bit params exist here only while gathered); 'grads': the fp32
        gradient shards; 'optim': AdamW's exp_avg, exp_avg_sq and step; 'unsharded_peak': the most
        gathered (compute-dtype) parameter bytes seen at any unit's forward of the first optimizer step
        (every step gathers alike), 0 before the first forward; 'unsharded_grads': the full gradients
        accumulated between micro batches without gradient sync (in reduce_dtype, fp32), freed by the
        last micro batch's reduce-scatter. With offload all but 'unsharded_peak' and 'unsharded_grads'
        live in host memory."""
        params = list(self.model.parameters())
        # FSDP2 keeps accumulated gradients on its private FSDPParam objects (no public accessor): in
        # `unsharded_accumulated_grad` when reduce_dtype differs from param_dtype, else on the
        # unsharded parameter's .grad. tests/distributed/test_planner_validation.py notices if torch moves them.
        accumulated = []
        for unit in [*self.model.blocks(), self.model]:
            group = unit._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else ():
                unsharded = getattr(fp, "_unsharded_param", None)
                accumulated += [fp.unsharded_accumulated_grad, getattr(unsharded, "grad", None)]
        return {
            "params": tensor_bytes(params),
            "grads": tensor_bytes(p.grad for p in params),
            "optim": tensor_bytes(optimizer_state_tensors(self.optimizer)),
            "unsharded_peak": self._unsharded_peak,
            "unsharded_grads": tensor_bytes(accumulated),
        }

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # named_parameters() yields a tied weight once (under the embedding's name), like the plain model.
        return {n: _full(p) for n, p in self.model.named_parameters()}

    def save(self, ckpt_dir: Path) -> None:
        state, tied = self._dcp_state()
        dcp.save(state, checkpoint_id=ckpt_dir / DCP_DIR)
        self._write_meta(ckpt_dir, sorted(state["model"]), tied, self._scaler_state())

    def snapshot(self, ckpt_dir: Path, buffers) -> Callable[[], None]:
        """A background save through DCP's own `async_save`: it stages the state into host memory (its
        stager, kept from save to save, pinned on CUDA) before returning; its writer thread plans and
        writes over a gloo group of its own, never the training group."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if getattr(self, "_async", None) is None:  # collective: every rank's first background save
            cuda = torch.cuda.is_available()
            self._async = (dist.new_group(backend="gloo"), DefaultStager(StagingOptions(cuda, False, False, cuda)))
        group, stager = self._async
        state, tied = self._dcp_state()
        fqns, scaler = sorted(state["model"]), self._scaler_state()
        future = dcp.async_save(state, checkpoint_id=ckpt_dir / DCP_DIR, process_group=group, async_stager=stager)

        def write() -> None:
            future.result()
            self._write_meta(ckpt_dir, fqns, tied, scaler)

        return write

    def _dcp_state(self) -> tuple[dict, list]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=StateDictOptions())
        tied = self.model.tied_weights()
        for alias in tied:  # one name per tensor: the tied alias is restored from its source on load
            model_sd.pop(alias, None)
        return {"model": self._trained_only(model_sd), "optim": optim_sd}, tied

    def _trained_only(self, model_sd: dict) -> dict:
        """A LoRA run's checkpoint holds the adapters alone: its frozen base comes from model.init_from
        or the seed (zerodp.convert.lora_base); a full model's holds every weight."""
        frozen = {n for n, p in self.model.named_parameters() if not p.requires_grad}
        return {k: v for k, v in model_sd.items() if k not in frozen} if frozen else model_sd

    def _scaler_state(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler.is_enabled() else None

    def _write_meta(self, ckpt_dir: Path, fqns: list, tied: list, scaler: dict | None) -> None:
        if dist.get_rank() == 0:
            meta = {
                "format": CKPT_FORMAT,
                "layout": "torch.distributed.checkpoint",
                "dcp_dir": DCP_DIR,
                # DCP keys: model.<name> (fp32, global shapes) and optim.state.<name>.{step,exp_avg,
                # exp_avg_sq}, optim.param_groups.<i>.params = [<name>, ...]: plain GPT names throughout.
                "fqns": fqns,
                "tied": tied,
                "world_size": self.ctx.world_size,
                "scaler": scaler,
            }
            (ckpt_dir / META_FILE).write_text(json.dumps(meta, indent=1))

    def load(self, ckpt_dir: Path) -> None:
        if not (ckpt_dir / META_FILE).is_file():
            raise CheckpointError(f"{ckpt_dir} has no {META_FILE}: it was not saved by strategy fsdp; resume "
                                  f"with the strategy that saved it, or start fresh with --fresh")
        meta = json.loads((ckpt_dir / META_FILE).read_text())
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=StateDictOptions())
        for alias in meta["tied"]:
            model_sd.pop(alias, None)
        state = {"model": self._trained_only(model_sd), "optim": optim_sd}
        partial = len(state["model"]) < len(model_sd)  # LoRA: the base stays as model.init_from or the seed made it
        # Reshards to this world size. Metadata and non-tensor entries go through allowlisted unpicklers:
        # loading never runs code from a checkpoint.
        dcp.load(state, storage_reader=safe_dcp_reader(ckpt_dir / meta["dcp_dir"]), planner=safe_dcp_planner())
        for alias, source in meta["tied"].items():
            if source in state["model"]:
                state["model"][alias] = state["model"][source]
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=not partial))
        if meta.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(meta["scaler"])

    def load_full(self, state: FullState) -> None:
        """Start from full fp32 tensors (any checkpoint): each rank keeps only its own shard of each, of
        every parameter the state holds (zerodp.strategies.common.loaded_params: a LoRA run's frozen base
        too, in the dtype it is held in), and with `state.with_optimizer` the AdamW state of the trained
        ones. No communication: every rank cuts its chunk as fully_shard does (torch.chunk on dim 0)."""
        with torch.no_grad():
            for name, p in loaded_params(self.model, state):
                _copy_shard(p, state.get(name, "param", p.shape))
                if not state.with_optimizer or not p.requires_grad:
                    continue
                moments = {}
                for kind in ("exp_avg", "exp_avg_sq"):
                    moments[kind] = torch.zeros_like(p)
                    _copy_shard(moments[kind], state.get(name, kind, p.shape))
                moments["step"] = adam_step(self.optimizer, p, state.step(name))
                self.optimizer.state[p] = moments


def _shard_range(p: DTensor) -> tuple[int, int]:
    """The elements [start, stop) of the flattened parameter that this rank's shard holds: a run of
    whole rows, since FSDP2 shards on dim 0 (on a 2-D HSDP mesh, within the replica group)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = math.prod(p.shape[1:])
    return offset[0] * row, (offset[0] + local_shape[0]) * row


def _copy_shard(target: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's piece of `full` into the DTensor `target` (its placements, no collective)."""
    from torch.distributed.tensor import distribute_tensor

    piece = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    local = target.to_local()
    assert local.shape == piece.to_local().shape, (local.shape, piece.to_local().shape)
    local.copy_(piece.to_local())


def _full(p: torch.Tensor) -> torch.Tensor:
    """Collective for DTensors: the whole fp32 tensor on every rank (FSDP's padding removed)."""
    t = p.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).float().clone()
