"""Checkpoints: atomic publication, integrity manifest, metadata for conversion, resume discovery.

Layout of one checkpoint (`<out_dir>/checkpoints/step_00000100/`):
    meta.json          written last: format version, strategy, world size, step, config, parameter
                       names/shapes/dtypes, and every file's size and sha256
    trainer.json       step, tokens seen, and what the loop needs to continue
    rng_rank{r}.safetensors   each rank's RNG state
    ...                the strategy's own files (safetensors for single/ddp, DeepSpeed's files for ZeRO,
                       a torch.distributed.checkpoint folder for FSDP)
Every rank writes into `step_XXXXXXXX.tmp/`; then the ranks share the fsync and sha256 of the files,
rank 0 writes the manifest, renames the folder to its final name and only then moves `latest`. A crash
at any point leaves either the previous checkpoint as newest or a `.tmp` folder that is never mistaken
for a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from zerodp.checkpoint.manifest import (  # noqa: F401
    FORMAT_VERSION,
    META,
    checkpoint_order,
    file_record,
    is_step_dir,
    latest_name,
    recorded_step,
    sha256_file,
    stale_latest,
    step_dir_name,
    verify,
)
from zerodp.distributed.process_group import broadcast_object
from zerodp.errors import CheckpointError


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def set_aside(ckpt: Path, reason: str) -> Path:
    """Rename a damaged checkpoint out of the way (never delete what was saved); say so once, here."""
    target = ckpt.with_name(ckpt.name + ".damaged")
    n = 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{ckpt.name}.damaged{n}")
    os.replace(ckpt, target)
    print(f"zerodp: warning: checkpoint {ckpt.name} is damaged ({reason}); set aside as {target}", file=sys.stderr)
    return target


def _fsync_tree(root: Path, files: list[Path]) -> None:
    """fsync `files` and every folder under `root` (the data files were synced by their ranks)."""
    for p in files:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(strategy, out_dir: str | Path, step: int, trainer_state: dict, meta: dict, keep_last: int) -> Path:
    """Collective: save the strategy's state and the trainer state at `step`; return the final folder.

    If any rank cannot write (disk full, permissions), every rank raises CheckpointError together; the
    partial folder is removed and the previous checkpoint stays the newest."""
    root = checkpoint_root(out_dir)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    if rank == 0:
        error = _attempt(lambda: _fresh_dir(tmp))
    _agree(error, tmp, step, root)
    error = _attempt(lambda: _write_rank_files(strategy, tmp, rank, trainer_state))
    _agree(error, tmp, step, root)  # every rank's files are on disk
    share: dict = {}
    error = _attempt(lambda: share.update(_manifest_share(tmp, rank, world)))
    _agree(error, tmp, step, root)
    shares = [None] * world
    dist.all_gather_object(shares, share)
    if rank == 0:
        files = {rel: info for part in shares for rel, info in part.items()}
        error = _attempt(lambda: _publish(tmp, final, root, dict(sorted(files.items())), meta, step, keep_last))
    _agree(error, tmp, step, root)
    return final


def _fresh_dir(tmp: Path) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _write_rank_files(strategy, tmp: Path, rank: int, trainer_state: dict) -> None:
    strategy.save(tmp)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, tmp / f"rng_rank{rank}.safetensors")
    if rank == 0:
        (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=1))


def _manifest_share(tmp: Path, rank: int, world: int) -> dict:
    """fsync and hash every world-th file of the folder: the ranks share the work, which for a large
    model's checkpoint is terabytes that one rank would take hours to read."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    share = {}
    mode = 0o666 & ~_umask()
    for p in files[rank::world]:
        if p.stat().st_mode & 0o777 != mode:  # safetensors writes 0600: give every file the umask's mode
            os.chmod(p, mode)
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        share[str(p.relative_to(tmp))] = file_record(p)
    return share


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(tmp: Path, final: Path, root: Path, files: dict, meta: dict, step: int, keep_last: int) -> None:
    meta = dict(meta, format_version=FORMAT_VERSION, step=step, files=files)
    (tmp / META).write_text(json.dumps(meta, indent=1))
    _fsync_tree(tmp, [tmp / META])
    old = None
    if final.exists():  # the same step from an earlier attempt: damaged ones are kept, set aside
        problem = verify(final, deep=False)
        if problem:
            set_aside(final, problem)
        else:
            old = final.with_name(final.name + ".replaced")
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
    os.replace(tmp, final)
    _write_atomic(root / "latest", final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _apply_retention(root, keep_last, final)


def _attempt(fn) -> str | None:
    """Run an I/O step; return what went wrong with the disk, or None. Other errors propagate."""
    try:
        fn()
    except OSError as e:
        return f"{e.strerror or e} ({e.filename or ''})".replace(" ()", "")
    except (SafetensorError, RuntimeError) as e:  # safetensors' and torch.save's wrappers of an OSError
        text = str(e)
        if not any(s in text for s in ("os error", "No space", "Permission denied", "failed writing", "write failed")):
            raise
        return text.split("I/O error: ")[-1].strip()
    return None


def _agree(error: str | None, tmp: Path, step: int, root: Path, group=None) -> None:
    """All ranks learn whether any rank failed (over `group`, the world's by default); if one did,
    clean up and raise everywhere."""
    import socket

    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors,
                           None if error is None else f"rank {dist.get_rank()} on {socket.gethostname()}: {error}",
                           group=group)
    failed = [e for e in errors if e]
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = root / "latest"
    previous = latest.read_text().strip() if latest.is_file() else None
    kept = f"the newest intact checkpoint is still {previous}" if previous else "no earlier checkpoint exists"
    raise CheckpointError(f"could not write checkpoint {step_dir_name(step)} in {root}: {failed[0]}; free space "
                          f"or fix permissions, or set train.out_dir elsewhere, then rerun the same command "
                          f"({kept})")


def _apply_retention(root: Path, keep_last: int, current: Path) -> None:
    """Keep the newest `keep_last` intact checkpoints up to `current` (just published, never deleted)
    and delete older intact ones, newest by the step each records (`checkpoint_order`), never by folder
    name. A damaged one (missing or truncated file, by the manifest's sizes) does not count toward
    `keep_last`: it is set aside, never deleted. The checkpoint `latest` names is never deleted, and
    folders that record a later step than `current` (a run resumed from an earlier `latest`) are left
    alone."""
    step = recorded_step(current)
    named = latest_name(root)
    intact = []
    for p in checkpoint_order(root):
        at = recorded_step(p)
        if p != current and at is not None and step is not None and at > step:
            continue
        problem = None if p == current else verify(p, deep=False)
        if problem:
            set_aside(p, problem)
        else:
            intact.append(p)
    intact.sort(key=lambda p: p != current)  # the one just published counts first
    for old in intact[keep_last:]:
        if old.name != named:
            shutil.rmtree(old, ignore_errors=True)


@dataclass
class ResumePoint:
    """What `resume_point` found: the newest intact checkpoint (or None) and the damaged ones skipped."""

    path: Path | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(checkpoint name, what is wrong with it), newest first."""


def find_resumable(out_dir: str | Path) -> Path | None:
    """The newest complete, intact checkpoint under out_dir; broken newer ones are skipped with a warning."""
    return resume_point(out_dir, set_aside_damaged=False).path


def resume_point(out_dir: str | Path, set_aside_damaged: bool = True, only: str | None = None) -> ResumePoint:
    """The checkpoint a run in out_dir resumes from: the one `latest` names when it is complete and
    intact, else the newest intact one by the step its meta.json records (`checkpoint_order`), skipping
    damaged ones (set aside, i.e.
    renamed `*.damaged` by rank 0 when `set_aside_damaged`, so they are reported once and never counted
    again; otherwise only warned about). With `only` (a step folder's name: --from-checkpoint), that one
    checkpoint when it is intact, else none, what is wrong with it in `skipped`.

    Collective when a process group is up: the ranks share the sha256 reading (each hashes every
    world-th file, as at save time) and all return the same answer."""
    ranked = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if ranked else (0, 1)
    root = checkpoint_root(out_dir)
    candidates = [p.name for p in checkpoint_order(root)] if only is None else [only]
    stale = stale_latest(root) if rank == 0 and only is None else None
    if ranked:  # one listing for all ranks, whatever each one's view of the file system
        candidates = broadcast_object(candidates)
    if stale:
        print(f"zerodp: warning: {stale}; resuming from the newest intact checkpoint by step instead",
              file=sys.stderr)
    found = ResumePoint(None)
    for name in candidates:
        problem = verify(root / name, share=(rank, world))
        if ranked:
            problems = [None] * world
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p), None)
        if problem is None:
            found.path = root / name
            break
        found.skipped.append((name, problem))
        if rank == 0 and only is None:
            if set_aside_damaged:
                set_aside(root / name, problem)
            else:
                print(f"zerodp: warning: skipping checkpoint {name}: {problem}", file=sys.stderr)
    return found


# Model settings that do not change the weights or what they compute: free to differ on resume.
FREE_MODEL_KEYS = ("dropout", "activation_checkpointing", "loss_chunks", "init_from", "hf_config")


@dataclass
class ModelCheck:
    problem: str | None
    """How the checkpoint's model differs from the one configured, or None when they match."""
    has_optimizer: bool
    """Whether the checkpoint holds AdamW moments for every parameter (else it is weights only)."""
    hf_config: bool = False
    """Whether the checkpoint's model settings came from a Hugging Face config.json beside its weights."""
    lora: bool = False
    """Whether the checkpoint is a LoRA run's (its adapters alone, the base left out)."""


def check_model(path: str | Path, model_cfg: dict, shapes: dict[str, tuple], may_lack=(), free=()) -> ModelCheck:
    """Compare the model a checkpoint holds with the configured one, before anything is loaded or
    written: first the model settings it records (meta.json's, or a Hugging Face folder's config.json
    read through zerodp.models.hf: arch, widths, heads, kv heads, tying, norm and rope), naming each
    differing key, then the parameter names and shapes (those of `may_lack` may be missing there: a
    LoRA run's base in its own checkpoints, its adapters in the base model's weights). Keys left null on
    either side count as their family's default; the keys of `free` may differ too (model.lora, where a
    LoRA run starts from a base model's weights). Reads metadata only (headers, manifests), no tensor data."""
    from zerodp.convert import open_checkpoint
    from zerodp.convert.full_state import FullState

    with open_checkpoint(path) as source:
        state = FullState(source, with_optimizer=True)
        saved = _effective((source.meta.get("config") or {}).get("model") or {})
        ours = _effective(model_cfg)
        diffs = [f"model.{k}={saved[k]!r} there, {v!r} here" for k, v in ours.items()
                 if k not in FREE_MODEL_KEYS and k not in free and k not in ("lora", "moe") and k in saved
                 and saved[k] != v]
        if "moe" in ours and "moe" in saved:
            diffs += _moe_diffs(saved["moe"], ours["moe"])
        if "lora" not in free and "lora" in ours and ("lora" in saved or source.meta.get("lora")):
            diffs += _lora_diffs(source.meta.get("lora") or saved.get("lora"), ours["lora"])
        problem = ", ".join(diffs) if diffs else state.mismatch(shapes, may_lack)
        lora = bool((source.meta.get("lora") or ((source.meta.get("config") or {}).get("model") or {}).get("lora")))
        return ModelCheck(problem, state.with_optimizer, "hf_config" in source.meta, lora)


FREE_MOE_KEYS = ("balance", "router_aux_loss_coef")
"""model.moe's training settings (how the balance loss is taken, its weight): no property of the weights."""


def _moe_diffs(theirs: dict | None, ours: dict | None) -> list[str]:
    """How a checkpoint's model.moe differs from the configured one, key by key, its training settings
    (FREE_MOE_KEYS) left out."""
    theirs, ours = theirs or {}, ours or {}
    return [f"model.moe.{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in sorted({*theirs, *ours})
            if k not in FREE_MOE_KEYS and theirs.get(k) != ours.get(k)]


def _lora_diffs(theirs: dict | None, ours: dict | None) -> list[str]:
    """How a checkpoint's LoRA settings (meta.json's `lora` record, else its model.lora) differ from the
    configured model.lora, key by key: rank, alpha and targets shape the adapters and what they compute;
    dropout (a training setting) and init_from (where a run's adapters started) are free to differ."""
    from zerodp.errors import ConfigError
    from zerodp.models.lora_spec import lora_spec

    def spec(section):
        try:
            return lora_spec({k: v for k, v in (section or {}).items()
                              if k in ("rank", "alpha", "targets", "init_from")} or None)
        except ConfigError:
            return None

    a, b = spec(theirs), spec(ours)
    if a is None or b is None:
        if (a is None) != (b is None):
            return [f"model.lora {'not set there (every weight trained)' if a is None else 'set there'}, "
                    f"{'not set here' if b is None else 'set here'}"]
        return []
    show = {"rank": lambda s: s.rank, "alpha": lambda s: f"{s.alpha:g}",
            "targets": lambda s: "[" + ", ".join(s.targets) + "]"}
    return [f"model.lora.{k}={f(a)} there, {f(b)} here" for k, f in show.items() if f(a) != f(b)]


def _effective(model: dict) -> dict:
    """A model section with the keys null means "the family's default" for (kv heads, head width, MLP
    width, biases, tying) replaced by those defaults, so that `null` and its value compare equal."""
    if not model:
        return {}
    from zerodp.config import ModelConfig
    from zerodp.models.arch import arch_of

    a = arch_of(ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}))
    filled = {"n_kv_head": a.n_kv_head, "head_dim": a.head_dim, "intermediate_size": a.ffn, "bias": a.bias,
              "tie_embeddings": a.tied}
    return {**model, **{k: v for k, v in filled.items() if k in model}}


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / META).read_text())


def load(strategy, ckpt: Path, world_size: int) -> dict:
    """Collective: restore the strategy from `ckpt`, whatever strategy and world size saved it; return
    the trainer state.

    The strategy's own loader is used when it can read the files (same strategy and world size, or a
    canonical, topology-free layout read by a strategy that writes one); otherwise the checkpoint is read
    as full fp32 tensors per parameter (weights, AdamW moments and step, via zerodp.convert) and each
    rank keeps its own part."""
    meta = read_meta(ckpt)
    same = meta["strategy"] == strategy.name and meta["world_size"] == world_size
    if same or meta.get("layout") == strategy.layout == "canonical":
        strategy.load(ckpt)
    else:
        from zerodp.convert import open_checkpoint
        from zerodp.convert.full_state import FullState

        with open_checkpoint(ckpt) as source:
            strategy.load_full(FullState(source, with_optimizer=True))
    trainer = json.loads((ckpt / "trainer.json").read_text())
    resume_at = getattr(strategy, "resume_at", None)  # optional: an engine that counts steps itself
    if resume_at is not None:
        resume_at(int(trainer["step"]))
    rng_file = ckpt / f"rng_rank{dist.get_rank()}.safetensors"
    if meta["world_size"] == world_size and rng_file.exists():  # RNG streams are per rank
        rng = load_file(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return trainer


def init_from(strategy, path: str) -> None:
    """Collective: start from pretrained weights (any format zerodp.convert reads); fresh optimizer."""
    from zerodp.convert import open_checkpoint
    from zerodp.convert.full_state import FullState

    with open_checkpoint(path) as source:
        strategy.load_full(FullState(source, with_optimizer=False))
