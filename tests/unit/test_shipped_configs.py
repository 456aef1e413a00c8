"""The configs zerodp ships: each loads, writes activation checkpointing as a mode's name (YAML reads a
bare `off` as false, `true` as true: a mode shows what it does), launches through zerodp's own launcher
form, and names a strategy that fits the GPUs its header names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.harness import ROOT
from zerodp.config import load_config
from zerodp.models.chunking import CHECKPOINTING

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_shipped_config_writes_a_checkpointing_mode_and_the_launcher_form(path: Path):
    raw = yaml.safe_load(path.read_text())
    written = raw.get("model", {}).get("activation_checkpointing", "off")
    assert isinstance(written, str) and written in CHECKPOINTING, written
    if "hf_config" not in raw.get("model", {}):  # the SFT recipes name path/to/llama, the user's folder
        assert load_config(str(path)).model.activation_checkpointing == written
    assert "torchrun --" not in path.read_text()  # python -m zerodp.distributed.launcher, as the README


def test_the_8b_config_names_a_strategy_that_fits_its_node():
    from zerodp.planner import plan_for_training

    cfg = load_config(str(ROOT / "configs/llama3-8b.yaml"))
    plan = plan_for_training(cfg, 8, 80 * 10**9, "cuda")
    row = next(e for e in plan.estimates if e.strategy == cfg.strategy.name)
    assert row.fits and round(row.total_bytes / 1e9, 1) == 61.4


def test_the_docs_launch_with_zerodps_launcher_not_plain_torchrun():
    """A launch line in the docs is `python -m zerodp.distributed.launcher ...` (the ranks' own line and exit
    code), as the README's; plain torchrun is named only where its own behaviour is the subject."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "torchrun --nproc-per-node" not in doc.read_text(), doc.name
