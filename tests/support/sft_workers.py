"""Functions run on every rank by tests.support.harness.run_distributed for tests/distributed/test_sft.py."""

from __future__ import annotations

from zerodp.config import load_config
from zerodp.trainer.loop import train


def train_config(path: str, overrides: list[str]) -> dict:
    """Train per the config file `path` with `overrides`; the losses and the run's figures."""
    s = train(load_config(path, overrides), fresh=True)
    return {"losses": s["losses"], "final_step": s["final_step"]}
