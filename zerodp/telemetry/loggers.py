"""Where a run's metrics go besides metrics.jsonl: TensorBoard event files and Weights & Biases.

Both receive every scalar of every metrics.jsonl record, keyed by the record's step, from rank 0 only.
Both packages are optional extras: `check` runs before the model is built, so a missing one is a
one-line error naming the install that fixes it, not a failure after minutes of start-up.
"""

from __future__ import annotations

import importlib
import numbers
from pathlib import Path

from zerodp.errors import UserError

EXTRAS = {"tensorboard": ("train.tensorboard=true", "tensorboard"), "wandb": ("train.wandb", "wandb")}


def _require(package: str) -> None:
    key, extra = EXTRAS[package]
    try:
        importlib.import_module(package)
    except ImportError:
        raise UserError(f"{key} needs the {package} package, which is not installed: "
                        f"pip install 'zerodp[{extra}]'") from None


def check(train_cfg) -> None:
    """Raise UserError if a logger the config asks for cannot be imported."""
    if train_cfg.tensorboard:
        _require("tensorboard")
    if train_cfg.wandb:
        _require("wandb")


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers (step excluded: it is the x axis), a mapping's under `key/sub` (comm_bytes/
    all_reduce); lists such as `stragglers` are left out."""
    def number(v) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    out = {k: float(v) for k, v in record.items() if k != "step" and number(v)}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update({f"{k}/{sub}": float(x) for sub, x in v.items() if number(x)})
    return out


class MetricLoggers:
    """The loggers `cfg.train` asks for, opened on the calling rank (rank 0); UserError if W&B cannot
    start a run.

    `start` is the step the run resumes from: TensorBoard drops the events of the earlier attempt past
    it (as metrics.jsonl drops its lines), and a W&B run is one attempt."""

    def __init__(self, cfg, out_dir: Path, start: int):
        self.tensorboard = self.wandb = None
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start + 1 if start else None)
        if cfg.train.wandb:
            import wandb

            try:
                self.wandb = wandb.init(project=cfg.train.wandb, dir=str(out_dir), config=cfg.to_dict(),
                                        name=out_dir.name)
            except wandb.errors.Error as e:  # no API key, no network, a project it may not write to
                self.close()
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise UserError(f"train.wandb={cfg.train.wandb}: Weights & Biases could not start a run ({first}); "
                                f"run `wandb login`, or set WANDB_MODE=offline to keep the run in "
                                f"{out_dir / 'wandb'} and `wandb sync` it later") from None

    def log(self, record: dict) -> None:
        values = scalars(record)
        if self.tensorboard is not None:
            for k, v in values.items():
                self.tensorboard.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(values, step=record["step"])

    def flush(self) -> None:
        """At checkpoints: what a crash after the save loses is what metrics.jsonl loses."""
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
