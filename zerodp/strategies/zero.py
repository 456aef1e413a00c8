"""DeepSpeed ZeRO stage 1, 2 or 3 through the real DeepSpeed engine (`stage` is the only difference).

ZeRO-1 shards the optimizer state (fp32 master weights and AdamW moments) over the data-parallel
ranks, ZeRO-2 also the gradients, ZeRO-3 also the parameters. The engine gets the same AdamW param
groups and hyper-parameters as every other strategy, as a client optimizer; zerodp's loop keeps the
learning-rate schedule (no DeepSpeed scheduler) and DeepSpeed clips, scales the loss and reduces.

The DeepSpeed config is generated from zerodp's own config by the pure `deepspeed_config`; extra keys
under `strategy.deepspeed` deep-merge over it, and a key that contradicts a zerodp setting is refused.
ZeRO++ (zero3 only: hpZ, qwZ, qgZ) comes from `strategy.hpz_partition_size`, `quantized_weights` and
`quantized_gradients`, checked against the world and the node it runs on (zerodp/strategies/zeropp.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from zerodp.config import Config
from zerodp.errors import UserError
from zerodp.optim import adam_step, adamw, adamw_kwargs, param_groups
from zerodp.strategies import deepspeed_ops, zero_snapshot
from zerodp.strategies.base import RunContext
from zerodp.strategies.common import (
    FullState,
    loaded_params,
    local_grad_norms,
    optimizer_state_tensors,
    set_lr,
    tensor_bytes,
    zero_attr_kind,
    zero_tensors,
)
from zerodp.strategies.deepspeed_config import deepspeed_config  # tests and benchmarks read it here too
from zerodp.strategies.zeropp import check_quantizer, drop_secondary_partitions, hpz_group, ranks_per_node

OFFLOADED_ATTRS = (
    # DeepSpeedZeroOptimizer (zero1/2) with cpu_offload: the fp32 master partition, the 16-bit staging copy of
    # it, the host gradient buffers (one the size of the largest parameter; one per parameter of the partition
    # while accumulating) and the fp32 gradient views; zero3's offloaded optimizer: its fp32 partition and
    # gradient partition
    "single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
    "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu", "offload_gradient_dict", "averaged_gradients",
    "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
)
"""The ZeRO optimizer's attributes whose tensors DeepSpeed keeps in host memory under strategy.offload_optimizer
(deepspeed/runtime/zero/stage_1_and_2.py and stage3.py: device='cpu' where cpu_offload)."""

TAG = "deepspeed"
"""Checkpoint sub-folder: DeepSpeed writes `<ckpt_dir>/deepspeed/*.pt` (no `latest` file)."""

def _import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer with `torch.compile` left out of it. Its ZeRO engines import it
    on the first engine and step (only to recognise a Muon optimizer), and the module torch.compiles
    three of its functions as it is imported, which imports inductor: about 2 s of every rank's start-up
    on a CPU core, for an optimizer zerodp never runs (it hands DeepSpeed torch's AdamW or
    DeepSpeedCPUAdam). Under train.compile=true zerodp's own torch.compile is unaffected."""
    import sys

    from deepspeed.runtime import compiler

    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name in sys.modules or not hasattr(compiler, "compile"):
        return
    real = compiler.compile
    compiler.compile = lambda: (lambda fn: fn)
    try:
        __import__(name)
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        compiler.compile = real


ZERO3_COMPILE = "ZERODP_CHECK_ZERO3_COMPILE"
"""Set (to anything) by benchmarks/gpu_checks.py's compile group alone: lets zero3 + train.compile run on
CUDA so that the check can show whether it trains the same model as single (issue 39, item 1).

What a GPU showed (one H200, torch 2.11 cu130, DeepSpeed 0.19.8; tiny gpt2, fp32, deterministic, world 1, 8
steps): step 1's loss is single's (5.33274 both), the first update is not: step 2 5.25041 against 5.10675,
0.432 at most over the 8 steps, the final weights 9.1e-3 apart. zero3 eager matches single (weights within
2.3e-6) and so does single compiled (1.7e-6); making each block a ZeRO-3 leaf module (one gather for the
whole block, no DeepSpeed hook inside the compiled forward) gives the very same wrong losses. So the
compiled forward reads gathered weights; what goes wrong is the compiled backward (or the gradients it
hands DeepSpeed), a suspect being the parameters that AOTAutograd saves for the backward while ZeRO-3
releases and re-gathers them into new storage. On CPU (torch 2.13) zero3 compiled matches single
exactly (tests/distributed/test_compile.py), which is why the refusal is for CUDA only."""


def _on_cuda(device: str) -> bool:
    """Whether a run with train.device `device` computes on CUDA ('auto': when a GPU is visible)."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


class ZeroStrategy:
    layout = "deepspeed"

    def __init__(self, stage: int):
        assert stage in (1, 2, 3), stage
        self.stage = stage
        self.name = f"zero{stage}"
        self.gathers_in_forward = stage == 3

    def check_config(self, cfg: Config, world_size: int, grad_accum_steps: int) -> None:
        """What setup would refuse (a strategy.deepspeed key contradicting zerodp, offload without
        zero3, ZeRO++ that cannot run or help here), checked without a process group: `zerodp train --dry-run`."""
        deepspeed_ops.check(self.name, cfg.strategy.offload_optimizer)  # a compiler, where DeepSpeed builds an op
        deepspeed_config(cfg, self.stage, grad_accum_steps, world_size, ranks_per_node())
        check_quantizer(cfg.strategy)
        if self.stage == 3 and cfg.train.compile and _on_cuda(cfg.train.device) and not os.environ.get(ZERO3_COMPILE):
            raise UserError("train.compile=true under zero3 trained a different model on CUDA (a GPU check found its "
                            "loss off by 0.14 at step 2) and is refused until the check passes: use strategy.name=fsdp "
                            "with train.compile=true, or zero3 with train.compile=false")

    def setup(self, model: nn.Module, ctx: RunContext) -> None:
        deepspeed_ops.choose_accelerator()  # before DeepSpeed is imported
        deepspeed_ops.use_environment_dir()  # before DeepSpeed builds anything
        deepspeed_ops.skip_unused_ops()  # before its first init_distributed
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines drown the loop's output
        self.ctx = ctx
        config = deepspeed_config(ctx.cfg, self.stage, ctx.grad_accum_steps, ctx.world_size,
                                  ranks_per_node(ctx.local_world_size))
        check_quantizer(ctx.cfg.strategy)
        accel = get_accelerator()
        if ctx.cfg.train.precision == "fp16" and not accel.is_fp16_supported():
            raise UserError(f"train.precision=fp16: DeepSpeed's {accel.device_name()} accelerator has no fp16 "
                            f"support; use train.precision=bf16 (or fp32) here, or run {self.name} on GPUs")
        if ctx.rank == 0 and (line := deepspeed_ops.build_line(ctx.cfg.strategy.offload_optimizer)):
            print(f"zerodp: {line}", file=sys.stderr, flush=True)  # else a minute of silence
        # DeepSpeed asserts the launcher's variables exist; a plain one-process run has none.
        for var, value in (("LOCAL_RANK", ctx.local_rank), ("RANK", ctx.rank), ("WORLD_SIZE", ctx.world_size)):
            os.environ.setdefault(var, str(value))
        model = self._materialise(model, config)
        self.optimizer = self._optimizer(model, ctx.cfg)
        _import_muon_uncompiled()
        # DeepSpeed takes cuda:LOCAL_RANK unless told (engine._set_distributed_vars reads args.device_rank):
        # where a scheduler shows each task one GPU, that device is cuda:0 whatever the local rank.
        args = SimpleNamespace(device_rank=ctx.device.index) if ctx.device.type == "cuda" else None
        self.model, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=self.optimizer, config=config)
        self.module = self.model.module
        _drop_tied_frozen(self.model)
        self._initialise(model, ctx.cfg.train.seed)
        # Hooks on the module's parameters run before the engine's own (on autograd's gradient
        # accumulators): each micro batch's gradient, full size under ZeRO-3 too, before any reduction.
        self.local_norms = local_grad_norms(ctx, self.module.parameters())

    def _materialise(self, model: nn.Module, config: dict) -> nn.Module:
        """The meta-device `model` made real as this stage keeps it. ZeRO-1/2 hold the whole working copy:
        it is materialised directly on the device in the dtype the engine computes in. ZeRO-3 builds the
        model again under `deepspeed.zero.Init`, which partitions each module's parameters as soon as the
        module is created: no rank ever holds more than its partitions and one module's parameters."""
        import deepspeed

        from zerodp.models import construct

        if self.stage == 3:
            deepspeed.init_distributed()  # wraps the process group zerodp made (zero.Init needs it)
            # mem_efficient_linear=False: otherwise DeepSpeed replaces torch.nn.functional.linear for the
            # whole process, for good; the modules compute as they do under every other strategy.
            hpz = hpz_group(config["zero_optimization"]["zero_hpz_partition_size"])
            with deepspeed.zero.Init(config_dict_or_path=config, mem_efficient_linear=False,
                                     zero_param_parallel_group=hpz):
                return construct(model.cfg)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.ctx.cfg.train.precision)
        if dtype is not None:
            model.to(dtype)  # on the meta device: no memory, no values
        # Storage only: `_initialise` draws each initial value once, for the working copy and the master.
        model.to_empty(device=self.ctx.device)
        model.tie_weights()
        return model

    @torch.no_grad()
    def _initialise(self, model: nn.Module, seed: int) -> None:
        """Write every parameter's initial values (a pure function of seed and name, the same on every
        layout) into this rank's part: the ZeRO-3 partition and its fp32 master, or, for ZeRO-1/2, the
        working copy (16-bit, rounded) and the fp32 master fragment (the exact fp32 values, as one process
        holds them), both from one draw: `_materialise` left the storage unfilled. A frozen parameter (a
        LoRA run's base) has no fp32 master: DeepSpeed keeps it out of the optimizer, in the working dtype."""
        rank = torch.distributed.get_rank()
        for name, p in self.module.named_parameters():
            if self.stage == 3:
                start, stop = _partition_range(p, rank)
                self._set_part(p, model.initial_values(name, seed, start, stop))
            else:  # one draw: the working copy (rounded to 16 bits) and the exact fp32 master fragment
                self._set_part(p, model.initial_values(name, seed).view(p.shape))
        drop_secondary_partitions(self.module)

    def _set_part(self, p: nn.Parameter, values: torch.Tensor, kind: str = "param") -> None:
        """Write `values` (ZeRO-3: this rank's partition of the flattened parameter, `_partition_range`;
        ZeRO-1/2: the whole parameter) into this rank's part of `p`: for kind 'param' its working copy and,
        if the optimizer holds it, its fp32 master; for 'exp_avg' / 'exp_avg_sq' that AdamW moment."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        trained = _optimized(p)
        if self.stage == 3:  # p holds nothing between gathers; its partition is p.ds_tensor
            if kind == "param":
                _copy_range(p.ds_tensor, values)
            if trained:
                key = None if kind == "param" else kind
                _copy_range(self.model.optimizer._get_fp32_opt_state_partition(p, False, key)[0], values)
        elif kind == "param":  # replicated working copy (16-bit or fp32) + this rank's fp32 master fragment
            p.data.copy_(values.to(p.dtype))
            if trained:
                safe_set_full_fp32_param(p, values)
        elif trained:
            safe_set_full_optimizer_state(p, values, kind)

    def _optimizer(self, model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
        """AdamW over zerodp's param groups; DeepSpeedCPUAdam (the same AdamW, vectorised on the CPU)
        when the optimizer state lives in CPU memory, where torch's AdamW would be several times slower.
        DeepSpeed takes it as the engine's basic optimizer as it is (deepspeed/runtime/engine.py
        _configure_optimizer): on CUDA torch's fused AdamW (zerodp.optim.adamw) is what steps the flat fp32
        partitions, DeepSpeed's own FusedAdam (a JIT-built extension) is not needed."""
        groups, kwargs = param_groups(model, cfg), adamw_kwargs(cfg)
        if cfg.strategy.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
        return adamw(groups, cfg, self.ctx.device.type)

    def micro_step(self, is_last: bool):
        # DeepSpeed reduces (ZeRO-1) and steps only at the boundary; the loop calls step() once after.
        self.model.set_gradient_accumulation_boundary(is_last)
        return contextlib.nullcontext()

    def autocast(self):
        # The engine holds 16-bit parameters itself in bf16/fp16: the forward already runs in 16 bits.
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)  # divides by gradient_accumulation_steps and multiplies by the loss scale

    def local_grad_sq(self) -> torch.Tensor | None:
        """This step's mean over micro batches of the rank's own gradient norm squared (before the
        reduction; zerodp.telemetry.grad_noise), or None when not measured. Call before step(): the engine
        divided the loss by the accumulation steps and, with fp16, multiplied it by a loss scale that
        step() may change."""
        if self.local_norms is None:
            return None
        return self.local_norms.take(self.ctx.grad_accum_steps, getattr(self.model.optimizer, "loss_scale", 1.0))

    def step(self, lr: float) -> float:
        set_lr(self.optimizer, lr)
        try:
            self.model.step()
        except Exception as e:  # DeepSpeed gives up with a bare Exception; only that case is translated
            if not _loss_scale_exhausted(e, self.model.optimizer):
                raise
            scaler = self.model.optimizer.loss_scaler
            raise LossScaleExhausted(
                f"train.precision=fp16: step {self.model.global_steps + 1} overflowed again with the loss scale "
                f"already at its minimum {scaler.min_scale:g} ({self.model.skipped_steps} steps skipped for "
                f"overflow so far): the fp16 gradients overflow at any scale, so DeepSpeed stops the run; use "
                f"train.precision=bf16 (or fp32), or lower optim.lr") from None
        # DeepSpeed's ZeRO optimizers keep the norm as a device tensor: returned as it is, no host sync.
        norm = self.model.get_global_grad_norm()
        if norm is None:
            return float("nan")
        return norm.detach() if torch.is_tensor(norm) else float(norm)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the distinct storages this rank holds, found by walking the module's parameters
        (their data, ZeRO-3 `ds_tensor` partitions, hpZ's secondary ones, and grads), every tensor attribute of
        DeepSpeed's ZeRO optimizer (named by `zero_attr_kind`) and the AdamW state. A storage is counted once,
        under the first of offloaded, params, optim, buckets, grads, buffers that reaches it: a gradient copied
        into a reduce bucket counts as the bucket, so 'grads' is the gradients themselves and 'buckets' is what
        the planner calls bucket_bytes. 'offloaded' is what DeepSpeed keeps in host memory because of
        strategy.offload_optimizer (the fp32 master partition and its gradient, AdamW's moments, the host
        staging and accumulation buffers, `OFFLOADED_ATTRS`) and strategy.offload_params (the parameter
        partitions): the planner's offloaded_bytes, the rest its device figures, on a CPU device too, where
        both are host memory; only under offload (see docs/strategies.md for what each key holds per stage)."""
        s = self.ctx.cfg.strategy
        offloaded_attrs = OFFLOADED_ATTRS if s.offload_optimizer else ()
        found: dict[str, list] = {"offloaded": [], "params": [], "optim": [], "buckets": [], "grads": [],
                                  "buffers": []}
        for p in self.module.parameters():
            # hpZ's secondary partition exists from a gather until the step after it drops it
            partition = getattr(p, "ds_tensor", None)
            found["offloaded" if s.offload_params else "params"].append(partition)
            found["params"] += [p.data, getattr(p, "ds_secondary_tensor", None)]
            found["grads"].append(p.grad)
        for attr, value in vars(self.model.optimizer).items():
            kind = "offloaded" if attr in offloaded_attrs else zero_attr_kind(attr)
            if attr == "temp_grad_buffer_for_gpu_offload":  # the device side of the offload's staging
                kind = "buckets"
            for t in zero_tensors(value):
                found[kind].append(t)
                if t.is_leaf and t.grad is not None:  # the fp32 partitions' grads during step()
                    found["offloaded" if kind == "offloaded" else "grads"].append(t.grad)
        found["offloaded" if s.offload_optimizer else "optim"] += list(optimizer_state_tensors(self.optimizer))
        held, seen, before = {}, [], 0
        for key in ("offloaded", "params", "optim", "buckets", "grads", "buffers"):
            seen += found[key]
            total = tensor_bytes(seen)
            held[key], before = total - before, total
        if not (s.offload_optimizer or s.offload_params):
            del held["offloaded"]  # nothing is: the start-up line names no host memory
        return held

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights; a frozen parameter (no master) as the engine holds it, in its working
        dtype widened to fp32. Collective under ZeRO-3: every rank gathers every parameter in the same order."""
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for n, p in self.module.named_parameters():
            if _optimized(p):
                out[n] = safe_get_full_fp32_param(p).detach().float().clone()
            elif self.stage == 3:
                with deepspeed.zero.GatheredParameters([p]):
                    out[n] = p.data.detach().float().clone()
            else:
                out[n] = p.detach().float().clone()
        return out

    def save(self, ckpt_dir: Path) -> None:
        # save_latest=False: zerodp's own `latest` (one level up) is the only pointer to trust.
        # exclude_frozen_parameters: a LoRA run saves its adapters (and their AdamW state) only; the base
        # comes back from model.init_from or the seed, as at the start (no effect without frozen parameters).
        self.model.save_checkpoint(str(ckpt_dir), tag=TAG, save_latest=False, exclude_frozen_parameters=True)

    def snapshot(self, ckpt_dir: Path, buffers):  # a background save: zerodp/strategies/zero_snapshot.py
        return zero_snapshot.snapshot(self, ckpt_dir, buffers, TAG)

    def load(self, ckpt_dir: Path) -> None:
        """Resume from DeepSpeed's files without DeepSpeed's loader: `engine.load_checkpoint` unpickles
        with weights_only=False, i.e. runs whatever the files ask for. zerodp reads the same files with
        its allowlisted loader (zerodp.convert) and sets each rank's part (`load_full`): the fp32
        master weights, moments and step come back exactly, and so do the engine's step counters and
        fp16's dynamic loss scale."""
        from zerodp.convert import open_checkpoint

        with open_checkpoint(ckpt_dir) as source:
            self.load_full(FullState(source, with_optimizer=True))
            saved = source.loss_scaler()
        self._restore_loss_scaler(saved)

    def _restore_loss_scaler(self, saved: dict | None) -> None:
        """Continue dynamic loss scaling where it stopped: without this an fp16 run would restart at
        2**16 and skip steps on overflow until it has found its scale again. A static scale is the
        config's, never the checkpoint's."""
        live = getattr(self.model.optimizer, "loss_scaler", None)
        if not saved or live is None or not getattr(live, "dynamic", False) or not saved.get("dynamic"):
            return
        for key in _DYNAMIC_SCALER_STATE:
            if key in saved and hasattr(live, key):
                value = saved[key]
                setattr(live, key, value.item() if torch.is_tensor(value) else value)

    def load_full(self, state: FullState) -> None:
        """Start from full fp32 tensors (any checkpoint, any world size): set each parameter's working
        copy, this rank's fp32 master fragment and, if the source has them, its AdamW moments (of the
        parameters the optimizer holds: a frozen base has none). In a LoRA model a parameter the source
        lacks keeps its values: the adapters over a base model's weights (model.init_from), the base
        under a LoRA checkpoint (adapters only). Collective-free but must run on every rank in the same order."""
        if state.with_optimizer:
            self._create_optimizer_state(state)
        rank = torch.distributed.get_rank()
        with torch.no_grad():
            for name, p in loaded_params(self.module, state):  # a LoRA model: those the state holds
                shape = p.ds_shape if self.stage == 3 else p.shape
                start, stop = _partition_range(p, rank) if self.stage == 3 else (0, 0)
                kinds = ("param", "exp_avg", "exp_avg_sq") if state.with_optimizer and _optimized(p) else ("param",)
                for kind in kinds:
                    full = state.get(name, kind, shape)
                    self._set_part(p, full.flatten()[start:stop] if self.stage == 3 else full, kind)
        drop_secondary_partitions(self.module)
        self._skipped_steps = _skipped_steps(state.source) if state.with_optimizer else 0

    def resume_at(self, step: int) -> None:
        """Continue the engine's step counters from zerodp's `step`, as DeepSpeed's own loader would
        (an optional ability: `zerodp.checkpoint.store.load` calls it after every resume, whatever wrote the
        checkpoint; `model.init_from` does not, and stays at 0). Left at 0, they restart at every
        resume: DeepSpeed's files (global_steps, global_samples, skipped_steps) would count the steps
        since the resume, and a DeepSpeed folder imported with `zerodp convert ... --to zerodp` would
        resume there, replaying data and learning rate. AdamW's own step per group came with the
        moments (`_create_optimizer_state`); DeepSpeed has no scheduler here (zerodp owns the lr)."""
        self.model.global_steps = step
        self.model.micro_steps = step  # the loop calls engine.step() once per optimizer step
        # DeepSpeed's own rule for files that lack it; zerodp's global batch is the engine's train_batch_size
        self.model.global_samples = step * self.model.train_batch_size()
        self.model.skipped_steps = getattr(self, "_skipped_steps", 0)

    def _create_optimizer_state(self, state: FullState) -> None:
        """AdamW creates its state at the first step; create it now over DeepSpeed's flat fp32
        partitions so moments can be written into it, with the step count of the source."""
        zero_opt = self.model.optimizer
        flats = _fp32_flats(zero_opt, self.stage)
        step = max(state.step(n) for n in state.names)
        for flat in flats:
            if flat in self.optimizer.state and self.optimizer.state[flat]:
                self.optimizer.state[flat]["step"] = _adam_step(self.optimizer, flat, step)
                continue
            self.optimizer.state[flat] = {"step": _adam_step(self.optimizer, flat, step),
                                          "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
        if self.stage != 3:  # DeepSpeed links parameter fragments to optimizer state once; relink
            zero_opt._hp_optimizer_states_linked = False
            zero_opt._lazy_init_hp_params_optimizer_state()


def _fp32_flats(zero_opt, stage: int) -> list:
    """The flat fp32 master partitions AdamW steps on: ZeRO-3's, ZeRO-1/2's, or those of BF16_Optimizer,
    which DeepSpeed runs for zero1 in bf16 with fp32 gradient accumulation (engine.py
    `_do_optimizer_sanity_check`)."""
    if stage == 3:
        return zero_opt.fp32_partitioned_groups_flat
    if hasattr(zero_opt, "single_partition_of_fp32_groups"):
        return zero_opt.single_partition_of_fp32_groups
    return zero_opt.fp32_groups_flat_partition


class LossScaleExhausted(UserError):
    """fp16's dynamic loss scale is at its minimum and the gradients overflow again."""


def _loss_scale_exhausted(error: Exception, zero_opt) -> bool:
    """Whether `error` is DeepSpeed's DynamicLossScaler giving up: on an overflow with the scale already
    at `min_scale` (and hysteresis spent) and `raise_error_at_min_scale` (always True: DeepSpeed's config
    cannot change it), `update_scale` raises a bare `Exception` ("Current loss scale already at minimum").
    Recognised by the scaler's state rather than the wording: a plain Exception, nothing derived from it,
    raised while a dynamic scaler that raises at its minimum sits at that minimum."""
    scaler = getattr(zero_opt, "loss_scaler", None)
    return (type(error) is Exception and scaler is not None and getattr(scaler, "dynamic", False)
            and getattr(scaler, "raise_error_at_min_scale", False) and scaler.cur_scale == scaler.min_scale)


# What DynamicLossScaler learns while training; its other fields come from the config.
_DYNAMIC_SCALER_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _skipped_steps(source) -> int:
    """fp16 steps DeepSpeed skipped on overflow (counted in global_steps too), as its files record
    them; 0 for checkpoints of other strategies, which do not count them."""
    from zerodp.convert.deepspeed_ckpt import DeepSpeedSource
    from zerodp.convert.safeload import safe_torch_load

    inner = getattr(source, "inner", source)  # a zerodp checkpoint holding DeepSpeed's files
    if not isinstance(inner, DeepSpeedSource):
        return 0
    return int(safe_torch_load(inner.model_file).get("skipped_steps") or 0)


def _adam_step(optimizer: torch.optim.Optimizer, flat: torch.Tensor, step: float):
    """torch's AdamW keeps the step as a float tensor (where zerodp.optim.adam_step puts it), DeepSpeedCPUAdam
    as an int."""
    return adam_step(optimizer, flat, step) if isinstance(optimizer, torch.optim.AdamW) else int(step)


def _drop_tied_frozen(engine) -> None:
    """Make `engine.module_state_dict(exclude_frozen_parameters=True)` leave out a frozen parameter under
    every name it has: DeepSpeed 0.19 drops the names `named_parameters()` lists, which lists a tied weight
    once, so a LoRA checkpoint of gpt2 (head tied to the embedding) would still carry the whole frozen
    embedding as `lm_head.weight` (ZeRO-1/2 keep it whole in the module's state dict)."""
    real = engine.module_state_dict

    def module_state_dict(*args, exclude_frozen_parameters: bool = False, **kwargs):
        sd = real(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name, p in engine.module.named_parameters(remove_duplicate=False):
                if not p.requires_grad:
                    sd.pop(name, None)
        return sd

    engine.module_state_dict = module_state_dict


def _optimized(p: torch.Tensor) -> bool:
    """Whether DeepSpeed's ZeRO optimizer holds `p` (an fp32 master and AdamW state): trainable and not
    empty (deepspeed.runtime.utils.is_optimized_parameter); a LoRA run's frozen base is not."""
    return p.requires_grad and getattr(p, "ds_numel", p.numel()) > 0


def _partition_range(p: torch.Tensor, rank: int) -> tuple[int, int]:
    """ZeRO-3 partitions each parameter in equal chunks of ceil(numel / world), the last one padded:
    the elements [start, stop) of the flattened parameter that this rank's partition holds."""
    size, numel = p.ds_tensor.numel(), p.ds_numel
    return min(rank * size, numel), min((rank + 1) * size, numel)


def _copy_range(target: torch.Tensor, values: torch.Tensor) -> None:
    """Copy a partition's elements into `target`, zeroing the padding past them."""
    target.zero_()
    target.view(-1)[: values.numel()].copy_(values.to(target.dtype))
