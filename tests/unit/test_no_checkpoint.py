"""checkpoint.enabled=false: refused in one line where a checkpoint is asked for (the run itself:
tests/distributed/test_loop.py::test_a_run_without_checkpoints_writes_none_and_says_so)."""

from __future__ import annotations

import pytest

from tests.support.cli_checks import one_line_error
from zerodp.cli.commands import main

BASE = ["train", "configs/tiny.yaml", "checkpoint.enabled=false", "--dry-run"]


@pytest.mark.parametrize("extra, pattern", [
    (["checkpoint.async_save=true"], r"^zerodp: error: checkpoint.enabled=false writes no checkpoint, but "
                                     r"checkpoint.async_save=true asks for background saves; remove one of the two$"),
    (["train.preempt_grace_s=30"], r"checkpoint.enabled=false writes no checkpoint, but train.preempt_grace_s=30 "
                                   r"asks for a save on preemption; remove one of the two$"),
])
def test_a_setting_that_needs_a_checkpoint_is_refused(capsys, extra, pattern):
    one_line_error(capsys, main(BASE + extra), pattern)


def test_torchrun_restarts_are_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    one_line_error(capsys, main(BASE + [f"train.out_dir={tmp_path}"]),
                   r"checkpoint.enabled=false writes no checkpoint, but torchrun restarts failed workers "
                   r"\(--max-restarts=3\) and a restart resumes from one; drop --max-restarts or enable checkpoints$")
