"""What a run folder's records say afterwards: `zerodp data batch RUN --step K` names the samples step K
trained, also across a resume that changed the global batch (the config that trained the step and the
position the run recorded), and a rerun with nothing to train leaves every file and folder as it was."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY
from zerodp.cli.commands import main
from zerodp.data.batches import TokenBatches

RUN = [*TINY, "strategy.name=single", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 steps at global batch 4, then resumed to step 3 at global batch 8; `trained`: each step's
    global batch as the run drew it (TokenBatches.offsets of the train split, recorded as it ran)."""
    out = tmp_path_factory.mktemp("records") / "run"
    trained = {}
    draw = TokenBatches.offsets

    def recording(self, step, rows):
        got = draw(self, step, rows)
        if self.split == "train":
            trained[step] = got.tolist()
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TokenBatches, "offsets", recording)
        assert main(["train", "configs/tiny.yaml", *RUN, "train.global_batch_size=4", "train.max_steps=2",
                     f"train.out_dir={out}"]) == 0
        assert main(["train", str(out), "train.max_steps=3", "train.global_batch_size=8"]) == 0
    return out, trained


def batch(run: Path, step: int, capsys) -> list[int]:
    capsys.readouterr()
    assert main(["data", "batch", str(run), "--step", str(step), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    return [r["tokens"][0] for r in got["rows"]]


def test_data_batch_of_a_run_names_what_each_step_trained_across_a_global_batch_change(run, capsys):
    out, trained = run
    assert sorted(trained) == [0, 1, 2] and [len(trained[k]) for k in (0, 1, 2)] == [4, 4, 8]
    assert (out / "config.steps-0-2.yaml").is_file()  # the settings that trained steps 1-2
    for step in (0, 1, 2):  # global batch k trains step k + 1
        assert batch(out, step, capsys) == trained[step], step
    # without a checkpoint of the resumed steps (keep_last removed them, say): the kept configs' batches
    copy = out.parent / "without-step-3"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "checkpoints" / "step_00000003")
    assert batch(copy, 2, capsys) == trained[2]


def test_a_rerun_with_nothing_to_train_touches_nothing(run, capsys):
    out, _ = run

    def state() -> dict:
        return {str(p.relative_to(out)): (p.is_dir(), p.stat().st_size if p.is_file() else 0, p.stat().st_mtime_ns)
                for p in [out, *sorted(out.rglob("*"))]}

    for p in [*out.rglob("*"), out]:  # an old time on each: a write is seen whatever the clock's resolution
        os.utime(p, ns=(10**9, 10**9))
    before = state()
    capsys.readouterr()
    assert main(["train", str(out)]) == 0
    assert "nothing to train: " in capsys.readouterr().err
    assert state() == before
