"""`train.deterministic`: the key, `zerodp.distributed.determinism.apply`, and a real training run that has it on
(what the process reports afterwards, and the same losses as without it: CPU needs no help)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.harness import run_distributed
from zerodp.config import load_config
from zerodp.distributed import determinism
from zerodp.errors import ConfigError, UserError


def test_key_is_off_by_default_and_typed():
    assert load_config(None).train.deterministic is False
    assert load_config(None, ["train.deterministic=true"]).train.deterministic is True
    with pytest.raises(ConfigError, match=r"^train\.deterministic in defaults \(with overrides\) must be true or "
                                          r"false, got 'maybe'$"):
        load_config(None, ["train.deterministic=maybe"])


def test_off_changes_nothing(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    determinism.apply(False)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_non_reproducible_cublas_setting_is_refused(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(UserError, match=r"^train\.deterministic=true needs CUBLAS_WORKSPACE_CONFIG=:4096:8 \(or "
                                        r":16:8\) but the environment sets ':0:0'; unset it, or set "
                                        r"train\.deterministic=false$"):
        determinism.apply(True)
    assert not torch.are_deterministic_algorithms_enabled()  # refused before anything was switched


def report_worker(overrides: list[str]) -> dict:
    """Train per `overrides`; report the determinism settings the process was left with."""
    from zerodp.trainer.loop import train

    summary = train(load_config(None, overrides), fresh=True)
    return {"losses": [summary["losses"][k] for k in sorted(summary["losses"])],
            "algorithms": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark]}


def test_training_run_switches_it_on(tiny, tmp_path, monkeypatch):
    """zero3 on 2 processes (partitions, padding, flat buffers: torch.empty is NaN-filled when on). One
    launch: the run without it first (what a fresh process reports), then the run with it."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the workers inherit this environment
    base = tiny + ["strategy.name=zero3", "train.max_steps=3", "train.global_batch_size=8"]
    per_rank = run_distributed("tests.support.workers:several", 2, {"calls": [
        {"target": "tests.distributed.test_determinism:report_worker",
         "kwargs": {"overrides": base + [f"train.out_dir={tmp_path / 'off'}"]}},
        {"target": "tests.distributed.test_determinism:report_worker",
         "kwargs": {"overrides": base + ["train.deterministic=true", f"train.out_dir={tmp_path / 'on'}"]}}]})
    off, on = [r[0] for r in per_rank], [r[1] for r in per_rank]
    for rank in (0, 1):
        assert on[rank]["algorithms"] and not on[rank]["warn_only"], on[rank]
        assert on[rank]["cublas"] == ":4096:8" and on[rank]["cudnn"] == [True, False], on[rank]
        assert not off[rank]["algorithms"] and off[rank]["cublas"] is None, off[rank]
        assert on[rank]["losses"] == off[rank]["losses"]  # CPU: the same bits either way
    assert len(on[0]["losses"]) == 3
