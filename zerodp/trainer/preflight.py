"""The start-up checks of a run, in one place: `zerodp train` runs them before it writes anything, and
`zerodp train --dry-run` runs the very same ones and prints what they found, so that a dry run that
passes is a launch that gets past its start-up.

`preflight` checks, in order: the planner's choices (strategy.name=auto, train.micro_batch_size=auto),
the batch split and the strategy's own settings, that train.out_dir can be written, the loggers'
packages, where the run starts (the checkpoint it resumes from or the init_from weights, against the
configured model), the data (both splits) and, for dpo.reference=precomputed, the reference log-probs
beside it. Each is a user error with one line that names the fix.

Where each check runs is the one difference between the two callers, and it is kept apart from the
checks themselves: `Alone` runs every check in this process with no process group (the dry run);
`Together` runs them under the launcher's process group, a check of rank 0's (the plan, the loggers,
the model against the checkpoint) on rank 0 with its answer shared, the others on every rank, and a
user error on any rank raised on all of them (`agree`). The launch writes out_dir's probe file; the
dry run only checks that it could, and sets no damaged checkpoint aside.
"""

from __future__ import annotations

import copy
import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerodp.config import Config
from zerodp.data.batches import TokenBatches, describe_prepared, load_tokens
from zerodp.data.coverage import unpacked_note
from zerodp.errors import UserError
from zerodp.strategies.catalog import CATALOG
from zerodp.telemetry import loggers
from zerodp.trainer.start import StartPlan, plan_start

if TYPE_CHECKING:
    from zerodp.planner import Plan


@dataclass
class Ready:
    """What the checks found: everything the launch goes on with, and the dry run prints."""

    cfg: Config
    """The config to run: auto settings replaced by the planner's choice."""
    plan: Plan | None
    """The planner's Plan when it chose something (an auto setting), else None."""
    grad_accum: int
    start: StartPlan
    tokens: object
    """The token stream (zerodp.data.batches.load_tokens: a memmap, or a prepare folder's two splits)."""
    train_data: TokenBatches
    val_data: TokenBatches
    prepared_line: str | None
    """For a `zerodp prepare` folder, the line that describes it."""
    searched: bool
    """train.micro_batch_size was auto (the planner chose the micro batch)."""
    notes: list[str] = field(default_factory=list)
    """Lines start-up says about the run's inputs (what data.packing=false never trains, a context past the
    model's), after the data's own line."""


def preflight(cfg: Config, fresh: bool, checks: Alone | Together, on_plan=None, from_checkpoint: str | None = None,
              allow_data_change: bool = False) -> Ready:
    """Run every start-up check of a launch of `cfg` (`fresh`: --fresh; `from_checkpoint`,
    `allow_data_change`: zerodp.trainer.start.plan_start's) where `checks` says; return what they found
    or raise the first UserError. `on_plan(plan)` is called with the planner's choice as soon as it is
    made, before the checks that read the data (the dry run prints it there)."""
    env, searched = checks.env, cfg.train.micro_batch_size == "auto"
    cfg, plan = checks.first(lambda: resolve_strategy(cfg, env.world_size, env.device, env.local_world_size))
    if on_plan is not None and plan is not None:
        on_plan(plan)
    grad_accum = checks.every(lambda: check_settings(cfg, env.world_size))
    # each rank its own file system; created (and probed) only once every check passed: a refused launch
    # leaves no empty run folder behind
    checks.every(lambda: check_out_dir(Path(cfg.train.out_dir), write=False))
    checks.first(lambda: loggers.check(cfg.train), share=False)  # rank 0 logs
    # A checkpoint of another model is refused before anything is written.
    start = checks.every(lambda: plan_start(cfg, fresh, set_aside_damaged=checks.writes, rank=checks.rank,
                                            from_checkpoint=from_checkpoint, allow_data_change=allow_data_change),
                         share=True)
    tokens, train_data, val_data, prepared_line = checks.every(lambda: inputs(cfg))
    notes = checks.every(lambda: start_notes(cfg, train_data))
    if cfg.train.objective == "dpo":
        from zerodp.trainer.objective import check_reference  # which imports this module's Together

        checks.every(lambda: check_reference(cfg, start.step, (train_data, val_data)))
    if checks.writes and start.step < cfg.train.max_steps:  # a run with nothing to train writes nothing
        checks.every(lambda: check_out_dir(Path(cfg.train.out_dir), write=True))
    return Ready(cfg, plan, grad_accum, start, tokens, train_data, val_data, prepared_line, searched, notes)


def check_settings(cfg: Config, world_size: int) -> int:
    """The batch split over `world_size` ranks and the strategy's own settings (what its setup would
    refuse); return the gradient accumulation steps."""
    from zerodp.strategies import check_config

    grad_accum = cfg.check_batch_split(world_size)
    check_config(cfg, world_size, grad_accum)
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not cfg.checkpoint.enabled and restarts not in ("", "0"):
        raise UserError(f"checkpoint.enabled=false writes no checkpoint, but torchrun restarts failed workers "
                        f"(--max-restarts={restarts}) and a restart resumes from one; drop --max-restarts or "
                        f"enable checkpoints")
    return grad_accum


def inputs(cfg: Config):
    """The token stream, both splits' batches and the prepared folder's line (or None)."""
    tokens = load_tokens(cfg)
    return tokens, TokenBatches(tokens, cfg, "train"), TokenBatches(tokens, cfg, "val"), describe_prepared(cfg, tokens)


def start_notes(cfg: Config, train_data: TokenBatches) -> list[str]:
    """What start-up says besides the data's line: the targets data.packing=false never trains
    (zerodp.data.coverage, which refuses a run with none), and a model.block_size past the positions the
    model.hf_config model was trained for (RoPE extrapolates there)."""
    notes = [unpacked_note(train_data)]
    if cfg.model.hf_config:
        from zerodp.models.hf import read_hf_config

        raw, path = read_hf_config(cfg.model.hf_config)
        longest = raw.get("max_position_embeddings", raw.get("n_positions"))
        if isinstance(longest, int) and cfg.model.block_size > longest:
            notes.append(f"warning: model.block_size={cfg.model.block_size} is past the {longest:,} positions of "
                         f"{path} (max_position_embeddings): the model never saw positions past {longest:,}; "
                         f"set model.block_size={longest} or fewer unless you mean to extend its context")
    return [n for n in notes if n]


def check_out_dir(out_dir: Path, write: bool = True) -> None:
    """train.out_dir can be written: created and a probe file written and removed (`write`), or, for
    the dry run, the same verdict without touching anything."""
    try:
        if write:
            out_dir.mkdir(parents=True, exist_ok=True)
            probe = out_dir / f".write_test_{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        else:
            _could_write(out_dir)
    except OSError as e:
        raise UserError(f"train.out_dir {out_dir} is not writable ({e.strerror}); choose a directory you can "
                        f"write to") from None


def _could_write(out_dir: Path) -> None:
    """Raise the OSError that creating `out_dir` and writing into it would raise, writing nothing."""
    folder = out_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        code = errno.EEXIST if folder == out_dir else errno.ENOTDIR
        raise OSError(code, os.strerror(code))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))


# -- where the checks run ------------------------------------------------------------------------------------

@dataclass
class Machine:
    """This process's place in the job the launcher would start (DistEnv's fields that the checks read)."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @classmethod
    def from_environment(cls, cfg: Config) -> Machine:
        """From the launcher's variables, without a process group."""
        use_cuda = torch.cuda.is_available() and cfg.train.device in ("auto", "cuda")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                   int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1"))), device)


class Alone:
    """No process group (the dry run): every check runs in this process, rank 0's included; nothing
    is written."""

    rank = 0  # no other process checks rank 0's part
    writes = False

    def __init__(self, machine: Machine):
        self.env = machine

    def first(self, fn, share: bool = True):
        return fn()

    def every(self, fn, share: bool = False):
        return fn()


class Together:
    """Under the launcher's process group (the launch): collective, every rank calls each check."""

    writes = True

    def __init__(self, env):
        self.env, self.rank = env, env.rank

    def first(self, fn, share: bool = True):
        """`fn` on rank 0; its answer on every rank (`share`), its error raised on every rank."""
        from zerodp.distributed.process_group import broadcast_object

        result = agree(self.env, lambda: fn() if self.env.rank == 0 else None)
        return broadcast_object(result) if share else result

    def every(self, fn, share: bool = False):
        """`fn` on every rank; rank 0's answer on all of them when `share`."""
        from zerodp.distributed.process_group import broadcast_object

        result = agree(self.env, fn)
        return broadcast_object(result) if share else result


def agree(env, fn):
    """Run `fn` on every rank; if it raised a UserError on any rank, raise it on all of them (rank 0
    prints it), so that no rank is left waiting in a collective for one that gave up."""
    import torch.distributed as dist

    error = None
    try:
        result = fn()
    except UserError as e:
        error, result = str(e), None
    errors = [None] * env.world_size
    dist.all_gather_object(errors, error)
    first = next(((r, e) for r, e in enumerate(errors) if e), None)
    if first is not None:
        r, e = first
        raise UserError(e if r == 0 or env.world_size == 1 else f"on rank {r} ({env.hosts[r]}): {e}")
    return result


# -- the planner's choices -----------------------------------------------------------------------------------

def device_memory(device: torch.device, local_world_size: int = 1) -> tuple[int, str]:
    """Memory one rank may use and the device's name: the GPU's, or this node's RAM shared by its ranks."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, props.name
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, local_world_size), "cpu"


def resolve_strategy(cfg: Config, world_size: int, device: torch.device, local_world_size: int = 1):
    """The config to run: as given, or with the planner's choices applied: strategy.name=auto (the
    strategy, offload and checkpointing) and train.micro_batch_size=auto (the micro batch and
    checkpointing, for the strategy given or chosen).

    Returns (config, plan); plan is None unless the planner chose something. Pure: no collectives."""
    if (spec := CATALOG.get(cfg.strategy.name)) and spec.single_process and world_size > 1:  # auto: None
        raise UserError(f"strategy.name={spec.name} cannot run on {world_size} processes; use ddp (or launch one "
                        "process)")
    search = cfg.train.micro_batch_size == "auto"
    if cfg.strategy.name != "auto" and not search:
        return cfg, None
    from zerodp.planner import plan_for_training

    memory, name = device_memory(device, local_world_size)
    per_node = local_world_size if world_size % local_world_size == 0 else None
    plan = plan_for_training(cfg, world_size, memory, name, gpus_per_node=per_node,
                             strategy=None if cfg.strategy.name == "auto" else cfg.strategy.name)
    if plan.choice is None:
        what = "strategy.name=auto" if cfg.strategy.name == "auto" else "train.micro_batch_size=auto"
        raise UserError(f"{what}: nothing fits in {memory / 1e9:.1f} GB per rank on {world_size} "
                        f"rank(s). {plan.suggestion or 'Use more GPUs, a smaller micro batch or a smaller model.'}")
    chose_strategy = cfg.strategy.name == "auto"
    cfg = copy.deepcopy(cfg)
    if chose_strategy:
        cfg.strategy.name = plan.choice
        cfg.strategy.offload_optimizer = plan.offload_optimizer
        cfg.strategy.offload_params = plan.offload_params
        if plan.hybrid:  # only fsdp+hybrid: strategy: auto never picks the approximate zero3+zero++
            cfg.strategy.hybrid_shard = True
    cfg.model.activation_checkpointing = str(plan.activation_checkpointing)  # off, selective or full
    if search:
        cfg.train.micro_batch_size = plan.micro_batch
    return cfg, plan


def micro_batch_line(plan) -> str:
    """What train.micro_batch_size=auto chose, and why, in one line."""
    row = plan.chosen
    return (f"train.micro_batch_size=auto: micro batch {row.micro_batch} x {row.grad_accum_steps} accumulation "
            f"on {plan.cluster.world_size} rank(s) (global batch {plan.global_batch}) under {row.name}, "
            f"activation checkpointing {row.activation_checkpointing}, predicted "
            f"{row.tokens_per_s_per_gpu:,.0f} tokens/s per device: "
            + next((r for r in plan.reasons if r.startswith("Micro batch")), "").rstrip("."))
