"""Where a run starts: which checkpoint it resumes from, or whether it starts fresh (and from which
weights), decided and checked before anything is written or deleted. `zerodp train` and
`zerodp train --dry-run` call the same `plan_start`.

Refused here, with one line that names the difference and the way out: resuming into a model whose
settings or parameter shapes differ from the checkpoint's, or into other data settings (zerodp.trainer.resume),
a --from-checkpoint this run does not hold intact, and `model.init_from` weights of another model.
Nothing is written on that path, so the run folder stays exactly as it was.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from zerodp.checkpoint import store as checkpoint
from zerodp.checkpoint.manifest import checkpoint_order, is_step_name, step_dir_name
from zerodp.config import Config
from zerodp.convert.lora_base import check_base
from zerodp.errors import UserError
from zerodp.trainer.resume import Carried, carry_over, superseded_note


@dataclass
class StartPlan:
    resume_from: Path | None = None
    """The checkpoint to resume from, or None to start at step 0."""
    weights_only: bool = False
    """The checkpoint (or init_from) holds no AdamW moments: AdamW starts fresh."""
    init_from: str | None = None
    """Weights to start from at step 0 (model.init_from), when not resuming; for a LoRA run on resume too:
    its base, which its checkpoints do not hold (they hold the adapters)."""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Damaged checkpoints passed over (name, what is wrong), newest first."""
    why: str = ""
    """One line: what the run will do, for the log and --dry-run."""
    set_aside: list[str] = field(default_factory=list)
    """The earlier run's files in out_dir that a start at step 0 moves aside first (none on resume)."""
    step: int = 0
    """The step the run starts at (the checkpoint's)."""
    carried: Carried = field(default_factory=Carried)
    """What the resume carries over: the position in the data, the config's steps (zerodp.trainer.resume)."""
    from_checkpoint: str | None = None
    """The checkpoint --from-checkpoint chose, for `latest` to name once the checks passed."""
    superseded: str = ""
    """For --dry-run: what the launch would move aside of metrics.jsonl (the launch says it as it does it)."""


# What a run writes at the top of its out_dir: a run that starts over moves these aside together.
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", "tensorboard", "wandb")


def earlier_run(out_dir: Path) -> list[str]:
    """The files of an earlier run in `out_dir` (a lone config.yaml, of a launch that stopped at its
    start-up checks, is no earlier run: it is rewritten)."""
    present = [n for n in RUN_FILES if (out_dir / n).exists()]
    # what its resumes kept (zerodp.trainer.resume): earlier settings, superseded records
    present += sorted(p.name for pattern in ("config.steps-*.yaml", "superseded-*") for p in out_dir.glob(pattern))
    checkpoints = out_dir / "checkpoints"
    if "checkpoints" in present and checkpoints.is_dir() and not any(checkpoints.iterdir()):
        present.remove("checkpoints")
    return present if set(present) - {"config.yaml"} else []


def plan_start(cfg: Config, fresh: bool, set_aside_damaged: bool, rank: int = 0, from_checkpoint: str | None = None,
               allow_data_change: bool = False) -> StartPlan:
    """Decide where the run starts (`from_checkpoint`: a checkpoint of this run chosen by name or step
    instead of the newest); raise UserError when the checkpoint or init_from weights do not fit the
    configured model, or the data settings differ from the checkpoint's without `allow_data_change`.
    Collective when a process group is up (the resume lookup shares its sha256 reading over the
    ranks); the model check reads metadata on rank 0 only, and the caller shares its verdict
    (`zerodp.trainer.preflight.agree`)."""
    from zerodp.models import arch_of, param_shapes
    from zerodp.models.lora_spec import adapter_shapes, lora_spec

    out_dir = Path(cfg.train.out_dir)
    plan = StartPlan()
    if cfg.model.init_from and not os.path.exists(cfg.model.init_from):  # wrong whether or not it is used
        raise UserError(f"model.init_from {cfg.model.init_from} does not exist: the base model is not there; run where "
                        f"it is or copy it to that path, or pass another checkpoint folder or .safetensors file")
    from zerodp.convert.peft import check_init_from

    check_init_from(cfg.model)  # model.lora.init_from: a PEFT folder of this model's adapters (headers only)
    if fresh and from_checkpoint is not None:
        raise UserError("--fresh starts over and --from-checkpoint resumes from a checkpoint: pass one of the two")
    if fresh or (not cfg.checkpoint.resume and from_checkpoint is None):
        plan.why = "--fresh: starting from step 0" if fresh else "checkpoint.resume=false: starting from step 0"
    else:
        only = None if from_checkpoint is None else chosen_checkpoint(out_dir, from_checkpoint)
        found = checkpoint.resume_point(out_dir, set_aside_damaged=set_aside_damaged and only is None, only=only)
        if only is not None and found.path is None:
            raise UserError(f"--from-checkpoint {from_checkpoint}: {found.skipped[0][1]}; choose another checkpoint "
                            f"of {checkpoint.checkpoint_root(out_dir)}")
        plan.resume_from, plan.skipped, plan.from_checkpoint = found.path, found.skipped, only
        if found.path is None:
            root = checkpoint.checkpoint_root(out_dir)
            if found.skipped:
                what = "set aside" if set_aside_damaged else "would be set aside"
                plan.why = (f"no intact checkpoint in {root} ({len(found.skipped)} damaged, {what}): "
                            f"starting over from step 0")
            else:
                plan.why = f"no checkpoint in {root}: starting from step 0"
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if plan.resume_from is None and not restarted:  # a restarted attempt continues its own first attempt
        plan.set_aside = earlier_run(out_dir)
        if plan.set_aside and not set_aside_damaged:  # a launch says where it moved them, once it has
            plan.why += (f"; the earlier run ({', '.join(plan.set_aside)}) would be moved aside to "
                         f"{out_dir}/earlier-<date>")
    if rank != 0:
        return plan
    model_cfg = cfg.to_dict()["model"]
    spec = lora_spec(cfg.model.lora)
    shapes, adapters = param_shapes(cfg.model), adapter_shapes(arch_of(cfg.model), spec) if spec else {}
    shapes.update(adapters)
    if plan.resume_from is not None:
        # a LoRA checkpoint holds the adapters only: the base comes from model.init_from or the seed
        base = [n for n in shapes if n not in adapters] if adapters else ()
        check = checkpoint.check_model(plan.resume_from, model_cfg, shapes, may_lack=base)
        if check.problem:
            raise UserError(
                f"{plan.resume_from} holds a different model than this config ({check.problem}); rerun with "
                f"the checkpoint's model settings, or start over with --fresh (earlier checkpoints are moved "
                f"aside, not deleted) or another train.out_dir")
        plan.weights_only = not check.has_optimizer
        meta = checkpoint.read_meta(plan.resume_from)
        if adapters:  # the adapters go back onto the base they were trained on, or the run stops here
            check_base(plan.resume_from, meta.get("lora"), cfg)
            plan.init_from = cfg.model.init_from  # the base: the checkpoint holds none
        plan.step = int(meta["step"])
        if plan.step >= cfg.train.max_steps:  # before the data check: a finished run says only this
            plan.why = (f"nothing to train: {plan.resume_from} is at step {plan.step} and train.max_steps is "
                        f"{cfg.train.max_steps}; raise train.max_steps to train further (the run folder is left "
                        f"as it was)")
            return plan
        trainer = json.loads((plan.resume_from / "trainer.json").read_text())
        plan.carried = carry_over(cfg, plan.resume_from, meta, trainer, allow_data_change)
        plan.why = (f"resuming from {plan.resume_from} at step {meta['step']} (saved by {meta['strategy']} on "
                    f"{meta['world_size']} process(es))")
        if plan.weights_only:
            plan.why += "; it holds weights only, no AdamW moments: AdamW starts fresh"
        plan.why += "".join(f"; {line}" for line in plan.carried.said)
        plan.superseded = superseded_note(out_dir, plan.step)
        if plan.init_from:
            plan.why += f"; the base model from {plan.init_from} (model.init_from)"
    elif cfg.model.init_from:
        path = cfg.model.init_from
        _refuse_adapters(path)
        # a base model's weights lack the adapters: they start from their initial values (or model.lora.init_from);
        # under RoPE the context length is no weight: a base may be taken at another block_size
        free = ("lora",) + (() if arch_of(cfg.model).spec.LEARNED_POSITIONS else ("block_size",))
        check = checkpoint.check_model(path, model_cfg, shapes, may_lack=list(adapters), free=free)
        if check.problem and check.lora:
            raise UserError(f"model.init_from {path} is a LoRA run's checkpoint (its adapters alone, not a model); to "
                            f"go on from its adapters, export them with `zerodp convert {path} OUT --to peft` and set "
                            f"model.lora.init_from=OUT, or merge them into a model with `zerodp convert {path} OUT "
                            f"--to hf --merge` and set model.init_from=OUT")
        if check.problem:
            fix = (f"set model.hf_config: {path} (its config.json gives every dimension)" if check.hf_config
                   else "set the model section to the checkpoint's dimensions")
            raise UserError(f"model.init_from {path} holds a different model than this config ({check.problem}); "
                            f"{fix}")
        plan.init_from = path
        plan.why += f"; weights from {path} (model.init_from), a fresh AdamW"
    return plan


def _refuse_adapters(path: str) -> None:
    """model.init_from names weights to start from: a PEFT adapter folder is adapters, not a model."""
    from zerodp.convert.peft import is_peft_folder

    if is_peft_folder(path):
        try:
            base = json.loads((Path(path) / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            base = None
        raise UserError(f"model.init_from {path} is a PEFT adapter folder (adapters, not a model); to go on from "
                        f"its adapters set model.lora.init_from={path} and model.init_from to their base "
                        f"({base or 'the model they were trained on'}), or merge them into a model with "
                        f"`zerodp convert {path} OUT --to hf --merge` and set model.init_from=OUT")


def chosen_checkpoint(out_dir: Path, text: str) -> str:
    """The step folder --from-checkpoint `text` names (a folder name, a step number, or the folder's path)
    among this run's checkpoints; UserError when this run holds none of that name."""
    root = checkpoint.checkpoint_root(out_dir)
    name = step_dir_name(int(text)) if text.isdigit() else Path(text).name
    inside = os.sep not in text or Path(text).resolve().parent == root.resolve()
    if inside and is_step_name(name) and (root / name).is_dir():
        return name
    have = sorted(p.name for p in checkpoint_order(root))
    where = f"choose one of {', '.join(have)}" if have else "it holds none yet"
    if not inside:
        raise UserError(f"--from-checkpoint {text} is not a checkpoint of this run ({root}: {where}); to start "
                        f"from another run's weights, set model.init_from")
    raise UserError(f"--from-checkpoint {text}: there is no checkpoint {name} in {root} (train.out_dir's); {where}")
