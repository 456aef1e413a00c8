"""`zerodp verify`'s bad inputs (one line, exit 2, nothing created) and its verdict (zerodp.trainer.compare)."""

from __future__ import annotations

import pytest

from zerodp.cli.commands import main
from zerodp.trainer.compare import TOLERANCES, Verdict, tolerance_for


@pytest.mark.parametrize("against, line", [
    ("strategy.nam=fsdp", r"unknown key 'strategy.nam'.*did you mean 'strategy.name'"),
    ("model.n_layer=3", r"--against model.n_layer changes the model's shape"),
    ("strategy.name", r"--against 'strategy.name' is not KEY=VALUE"),
    ("fsdp=1", r"'fsdp' is no section.key \(nor nproc\)"),
    ("nproc=two", r"--against nproc=two is not a number of processes"),
    ("train.max_steps=5", r"--against train.max_steps: zerodp verify sets it for both runs"),
])
def test_bad_against_is_one_line_and_exit_2(tmp_path, capsys, against, line):
    import re

    out = tmp_path / "run"
    code = main(["verify", "configs/tiny.yaml", f"train.out_dir={out}", "--against", against])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(line, err), err
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_the_verdict_names_the_first_step_and_the_tensors_most_apart():
    v = Verdict(TOLERANCES["fp32"], steps=[(1, 0.0, 0.0), (2, 3e-6, 5e-5), (3, 2e-4, 1e-3), (4, 1e-2, 1e-1)],
                weights={"a": 1e-6, "b": 3e-3, "c": 2e-2})
    assert not v.passed and v.first_step == 3 and [n for n, _ in v.differing] == ["c", "b"]
    report = v.report("x", "y")
    assert "FAIL: the first differing step is 3" in report and "most: c 2.00e-02, b 3.00e-03" in report
    assert Verdict(TOLERANCES["fp32"], steps=[(1, 1e-6, 1e-5)], weights={"a": 1e-5}).passed
    assert tolerance_for("fp32", "fp32") is TOLERANCES["fp32"] and tolerance_for("fp32", "bf16") is TOLERANCES["16bit"]


def test_a_verdict_on_steps_without_targets_fails_nothing_was_compared():
    """Two runs whose steps held no target token agree trivially (every loss and gradient 0): no pass."""
    same = dict(steps=[(1, 0.0, 0.0), (2, 0.0, 0.0)], weights={"a": 0.0})
    v = Verdict(TOLERANCES["fp32"], targets=0, **same)
    assert not v.passed
    assert "FAIL: nothing was compared: the 2 steps held no target token" in v.report("x", "y")
    assert Verdict(TOLERANCES["fp32"], targets=97, **same).passed  # a loss mask with targets
    assert Verdict(TOLERANCES["fp32"], targets=None, **same).passed  # every token a target
    assert not Verdict(TOLERANCES["fp32"], weights={"a": 0.0}).passed  # no step at all
