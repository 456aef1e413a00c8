"""What a resume carries over from the run it continues, and what it keeps of it (docs/checkpoints.md).

- The position in the data, as samples consumed (trainer.json's "samples"): global batch k holds the
  positions [k*B, (k+1)*B) of the split's sample sequence until the global batch B changes; a run resumed
  at step s with another B' continues at the position the run stopped at, so no sample of the epoch is
  skipped or repeated (zerodp.data.batches.TokenBatches.continue_from). A checkpoint from before this
  field stopped at s times the global batch its config records, the position the old rule gave.
- The sample order: a changed train.seed, data source or mixture (what else decides which samples a
  batch holds) would draw another order without a word, so it is refused unless --allow-data-change.
- The records a resume supersedes: metrics.jsonl's rows past the step it resumes at (an earlier
  checkpoint chosen, a damaged newest one set aside, an attempt that crashed after its last save) are
  moved, never deleted, into <out_dir>/superseded-<date>/ with a copy of the config.yaml that trained them.
- The config: config.yaml holds the settings of the steps since trainer.json's "config_from"; a resume
  that changes them keeps the checkpoint's as config.steps-<from>-<step>.yaml, the steps they trained.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from zerodp.config import Config
from zerodp.config.sources import prepared_meta
from zerodp.errors import UserError

FLAG = "--allow-data-change"


@dataclass
class Carried:
    """What a resume at `step` continues with, decided before anything is written."""

    samples: int = 0
    """The position in the training data (samples of the split's sequence) global batch `step` starts at."""
    config_from: int = 0
    """The step the config to run took effect at: what later checkpoints record as trainer.json's config_from."""
    kept_config: tuple[str, str] | None = None
    """(file name, YAML) of the checkpoint's config when this run's differs: the settings that trained
    steps [config_from there, step)."""
    said: list[str] = field(default_factory=list)
    """What the resume changes, for the start-up line."""


def order_settings(config: dict) -> dict[str, object]:
    """The settings besides the global batch that decide which samples a global batch holds, from a
    config dict (Config.to_dict(), or the one a checkpoint's meta.json records)."""
    data, train = config.get("data") or {}, config.get("train") or {}
    out = {"train.seed": train.get("seed"), "data.packing": data.get("packing", True)}
    if data.get("sources"):
        out["data.sources"] = data["sources"]
        return out
    out["data.source"] = data.get("source")
    if data.get("source") == "builtin":
        out["data.max_bytes"] = data.get("max_bytes")
    elif prepared_meta(str(data.get("source"))) is None:  # a prepare folder holds its own val.bin
        out["data.val_fraction"] = data.get("val_fraction")
        out["data.token_dtype"] = data.get("token_dtype")
    return out


def carry_over(cfg: Config, ckpt: Path, meta: dict, trainer: dict, allow_data_change: bool) -> Carried:
    """What resuming from `ckpt` (its meta.json and trainer.json) carries into a run of `cfg`; raise
    UserError when the sample order would change and `allow_data_change` is off."""
    step, here = int(meta["step"]), json.loads(json.dumps(cfg.to_dict()))
    saved = meta.get("config")  # an import (zerodp convert --to zerodp) may record none
    G = cfg.train.global_batch_size
    saved_G = ((saved or {}).get("train") or {}).get("global_batch_size") or G
    out = Carried(samples=int(trainer.get("samples", step * saved_G)))
    if not saved:
        out.config_from = step
        return out
    ours, theirs = order_settings(here), order_settings(saved)
    # only what the checkpoint records: an import (or an export's config) records the model alone
    changed = [k for k in [*ours, *(k for k in theirs if k not in ours)]
               if theirs.get(k) is not None and theirs.get(k) != ours.get(k)]
    if changed:
        what = ", ".join(f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in changed)
        if not allow_data_change:
            raise UserError(f"{ckpt} was trained with other data settings ({what}): resuming would draw other "
                            f"samples than the run's; rerun with the checkpoint's settings, or pass {FLAG} to "
                            f"continue with these (--fresh starts over)")
        if changed == ["train.seed"]:
            out.said.append(f"{what} ({FLAG}): the batches continue at sample {out.samples:,} of the new order")
        else:
            out.samples = 0
            out.said.append(f"{what} ({FLAG}): the batches start at the first sample of the new data")
    elif saved_G != G:
        out.said.append(f"train.global_batch_size={saved_G} there, {G} here: the data continues at sample "
                        f"{out.samples:,}, where the run stopped")
    if said := micro_batch_balance_note(cfg, ((saved.get("train") or {}).get("micro_batch_size"))):
        out.said.append(said)
    out.config_from = int(trainer.get("config_from", 0))
    if saved != here:
        out.kept_config = (f"config.steps-{out.config_from}-{step}.yaml", yaml.safe_dump(saved, sort_keys=False))
        out.config_from = step
    return out


def keep_config(out_dir: Path, kept: tuple[str, str]) -> str:
    """Write the earlier config (`kept`: name, YAML) beside config.yaml, under a new name if that one is
    taken by other text; return the line that says where."""
    name, text = kept
    path, n = out_dir / name, 1
    while path.exists() and path.read_text() != text:
        n += 1
        path = out_dir / f"{Path(name).stem}-{n}.yaml"
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return f"the settings changed on resume: config.yaml records this run's, {path} those that trained before"


def last_recorded_step(metrics: Path) -> int | None:
    """The step of metrics.jsonl's last record, reading its end only, or None without one."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def superseded_note(out_dir: Path, step: int) -> str:
    """For the start-up line: what keep_superseded will move, or "" when nothing."""
    last = last_recorded_step(out_dir / "metrics.jsonl")
    if last is None or last <= step:
        return ""
    return f"; metrics.jsonl's records of steps {step + 1}-{last} are moved to {out_dir}/superseded-<date>"


def new_folder_beside(out_dir: Path, prefix: str) -> Path:
    """A new, empty folder `<out_dir>/<prefix>-<date>` (`-2`, `-3`... when that one exists): where a run's
    earlier files are moved aside, never over an earlier set."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out_dir / f"{prefix}-{stamp}", 1
    while aside.exists():
        n += 1
        aside = out_dir / f"{prefix}-{stamp}-{n}"
    aside.mkdir()
    return aside


def keep_superseded(out_dir: Path, step: int) -> str | None:
    """Move metrics.jsonl's records past `step` (the run resumes there) into a new folder
    <out_dir>/superseded-<date>/, with a copy of config.yaml, the settings that trained them; return the
    line that says where, or None when there are none. The moved rows are written there before
    metrics.jsonl is swapped for its kept rows: a crash between leaves them twice, never lost."""
    metrics = out_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    kept, later = [], []
    for line in metrics.read_text().splitlines():
        if line:
            (later if json.loads(line)["step"] > step else kept).append(line + "\n")
    if not later:
        return None
    aside = new_folder_beside(out_dir, "superseded")
    (aside / "metrics.jsonl").write_text("".join(later))
    if (out_dir / "config.yaml").exists():
        shutil.copy2(out_dir / "config.yaml", aside / "config.yaml")
    if kept:
        tmp = metrics.with_name(metrics.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, metrics)
    else:
        metrics.unlink()
    first, last = json.loads(later[0])["step"], json.loads(later[-1])["step"]
    return (f"resuming at step {step} supersedes metrics.jsonl's records of steps {first}-{last}: moved to "
            f"{aside}/metrics.jsonl, with the config.yaml that trained them")


def micro_batch_balance_note(cfg: Config, before, chosen: str = "") -> str | None:
    """What a micro batch size other than `before` (a resume: the checkpoint's; None: a first choice, by
    the planner) changes in a mixture of experts whose balance loss is taken per micro batch
    (model.moe.balance=micro_batch, zerodp.models.moe_spec); None where nothing changes."""
    mb = cfg.train.micro_batch_size
    if (cfg.model.moe or {}).get("balance") != "micro_batch" or mb == before:
        return None
    was = f"train.micro_batch_size={before} there, {mb} here" if before is not None else chosen
    return (f"{was} with model.moe.balance=micro_batch: the balance loss is taken over each micro batch of {mb} "
            f"sequences, so the micro batch size changes what is trained (model.moe.balance=sequence does not)")
