"""Which checkpoint a run continues from, and what a run that starts over keeps: one rule for resume,
retention, `zerodp inspect` and `--dry-run` (the checkpoint `latest` names when it is intact, else the
newest intact one by the step its meta.json records, never by folder name), an import refused when its
folder is named for another step, and `--fresh` moving the whole earlier run aside. Through the
command line, as a user runs it (the README's import recipe)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.distributed.test_cli import one_line_error, zerodp
from tests.support.cli_checks import zerodp_here
from tests.support.harness import ROOT

SMALL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "data.max_bytes=200000",
         "data.prefetch=0", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
         "train.sample_tokens=0", "train.progress=false", "strategy.name=single", "checkpoint.every=1"]


def train(out: Path, *extra, fresh=False):
    r = zerodp("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={out}", *extra,
               *(["--fresh"] if fresh else []))
    assert r.returncode == 0, r.stderr
    return r


def resumed_at(r) -> tuple[str, int] | None:
    """(checkpoint folder name, step) from a run's or a dry run's "resuming from" line."""
    m = re.search(r"resuming from \S*/(step_\d{8}) at step (\d+)", r.stdout + r.stderr)
    return (m.group(1), int(m.group(2))) if m else None


def inspected_step(path: Path) -> int:
    r = zerodp_here("inspect", path)
    assert r.returncode == 0, r.stderr
    return int(re.search(r"^step:\s+(\d+)", r.stdout, re.M).group(1))


def steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if re.fullmatch(r"step_\d{8}", p.name))


def latest(out: Path) -> str:
    return (out / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished 2-step run: the checkpoint the README's recipe imports (step 2)."""
    out = tmp_path_factory.mktemp("source") / "run"
    train(out, "train.max_steps=2", "checkpoint.every=2")
    return out


def test_import_into_a_folder_named_for_another_step_is_refused(source, tmp_path):
    dst = tmp_path / "new" / "checkpoints" / "step_00001000"
    r = zerodp_here("convert", source, dst, "--to", "zerodp", "--no-progress")
    one_line_error(r, r"step_00001000 is named for step 1000 but the source records step 2: name it "
                      r"\S*/checkpoints/step_00000002, or pass --step 1000")
    assert not (tmp_path / "new").exists()  # nothing written
    r = zerodp_here("convert", source, dst, "--to", "zerodp", "--step", "1000", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert json.loads((dst / "meta.json").read_text())["step"] == 1000


def test_resume_follows_latest_and_the_recorded_step_never_the_folder_name(source, tmp_path):
    """The README's recipe, then a folder an earlier version named for another step: every reader agrees
    on the checkpoint `latest` names, and nothing newer is lost or deleted."""
    run = tmp_path / "new"
    imported = run / "checkpoints" / "step_00000002"
    r = zerodp_here("convert", source, imported, "--to", "zerodp", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert resumed_at(train(run, "train.max_steps=4", "checkpoint.keep_last=3")) == ("step_00000002", 2)
    assert latest(run) == "step_00000004" and steps(run) == ["step_00000002", "step_00000003", "step_00000004"]
    # What earlier versions let an import make: a folder named for a later step than it holds.
    shutil.copytree(imported, run / "checkpoints" / "step_00001000")
    assert inspected_step(run) == 4
    assert resumed_at(zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={run}",
                             "train.max_steps=6", "--dry-run")) == ("step_00000004", 4)
    assert resumed_at(train(run, "train.max_steps=6", "checkpoint.keep_last=3")) == ("step_00000004", 4)
    # Retention counts by recorded step: the two step-2 folders are the oldest, whatever their names.
    assert latest(run) == "step_00000006" and steps(run) == ["step_00000004", "step_00000005", "step_00000006"]
    assert resumed_at(train(run, "train.max_steps=7")) == ("step_00000006", 6)
    # An import older than `latest` is said to be passed over, with the way to choose it.
    r = zerodp_here("convert", source, run / "checkpoints" / "step_00000002", "--to", "zerodp", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"resumes from step_00000007 (step 7: `latest` names it), not from this import; to resume from it: " \
           f"echo step_00000002 > {run / 'checkpoints' / 'latest'}" in r.stdout


def test_a_checkpoint_chosen_with_latest_is_where_every_reader_starts(source, tmp_path):
    run = tmp_path / "run"
    train(run, "train.max_steps=4", "checkpoint.keep_last=4")
    assert steps(run) == ["step_00000001", "step_00000002", "step_00000003", "step_00000004"]
    (run / "checkpoints" / "latest").write_text("step_00000002\n")  # what docs/checkpoints.md tells users
    assert inspected_step(run) == 2
    before = (run / "metrics.jsonl").read_text().splitlines()
    dry = zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={run}", "train.max_steps=3",
                 "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert resumed_at(dry) == ("step_00000002", 2)
    r = train(run, "train.max_steps=3", "checkpoint.keep_last=1")
    assert resumed_at(r) == ("step_00000002", 2)
    # Step 3 was saved again from step 2; step 4 records a later step and is left alone.
    assert latest(run) == "step_00000003" and steps(run) == ["step_00000003", "step_00000004"]
    assert inspected_step(run) == 3
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == [1, 2, 3]
    # The records of steps 3-4 the resume supersedes are kept beside the run, byte for byte, and said where.
    (aside,) = run.glob("superseded-*")
    assert (aside / "metrics.jsonl").read_text().splitlines() == before[2:]
    assert f"supersedes metrics.jsonl's records of steps 3-4: moved to {aside}/metrics.jsonl" in r.stderr
    # A `latest` that names no checkpoint: the newest intact one by step, with a warning.
    (run / "checkpoints" / "latest").write_text("step_00000099\n")
    dry = zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={run}", "train.max_steps=5",
                 "--dry-run")
    assert resumed_at(dry) == ("step_00000004", 4)
    assert "latest names 'step_00000099', which is not a checkpoint folder here" in dry.stderr
    assert inspected_step(run) == 4


@pytest.mark.parametrize("how", ["--fresh", "checkpoint.resume=false"])
def test_a_run_that_starts_over_moves_the_whole_earlier_run_aside(source, tmp_path, how):
    run = tmp_path / "run"
    shutil.copytree(source, run)  # a finished 2-step run
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    r = train(run, "train.max_steps=1", *([how] if how != "--fresh" else []), fresh=how == "--fresh")
    (aside,) = run.glob("earlier-*")
    assert f"moved the earlier run (checkpoints, metrics.jsonl, config.yaml) to {aside}" in r.stderr
    assert r.stderr.count("earlier run") == 1 and "<date>" not in r.stderr, r.stderr  # said once, where it went
    for name, data in before.items():
        assert (aside / name).read_bytes() == data  # the earlier history, byte for byte
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (aside / "checkpoints" / "step_00000002" / "meta.json").is_file()
    assert inspected_step(aside) == 2  # still a run zerodp reads
    assert steps(run) == ["step_00000001"]


def dry_run(run: Path, capsys, *args) -> tuple[int, str, str]:
    """`zerodp train RUN ARGS --dry-run` in this process (a dry run starts no process group): code, out, err."""
    from zerodp.cli.commands import main

    capsys.readouterr()
    code = main(["train", str(run), *map(str, args), "--dry-run"])
    out, err = capsys.readouterr()
    return code, out, err


def files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}


def test_a_resume_with_another_global_batch_continues_where_the_data_stopped(source, tmp_path, capsys):
    """Another global batch on resume continues at the samples consumed, and the config that trained the
    steps before is kept; another seed is refused in one line that says how to ask for it."""
    run = tmp_path / "run"
    shutil.copytree(source, run)  # 2 steps at global batch 4
    first = (run / "config.yaml").read_text()
    r = train(run, "train.max_steps=3", "train.global_batch_size=8")
    epoch = {x["step"]: x["epoch"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert epoch[3] == pytest.approx(2 * epoch[2], rel=1e-3)  # 8 + 8 samples, not 3 x 8
    assert json.loads((run / "checkpoints" / "step_00000003" / "trainer.json").read_text())["samples"] == 16
    assert "train.global_batch_size=4 there, 8 here: the data continues at sample 8, where the run stopped" in r.stderr
    assert (run / "config.steps-0-2.yaml").read_text() == first  # the settings that trained steps 1-2
    assert "global_batch_size: 8" in (run / "config.yaml").read_text()
    code, _, err = dry_run(run, capsys, "train.max_steps=4", "train.seed=7", "--from-checkpoint", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(r"step_00000002 was trained with other data settings \(train.seed=1337 there, 7 here\): "
                     r"resuming would draw other samples than the run's; .* pass --allow-data-change", err)


def test_a_finished_run_trains_nothing_and_changes_nothing(source, tmp_path, capsys):
    """Overrides on a finished run: "nothing to train", no planner table or sample, config.yaml still
    what trained; `zerodp train RUN --dry-run` says the same; a --from-checkpoint the run lacks is refused."""
    run = tmp_path / "run"
    shutil.copytree(source, run)
    kept = files(run)
    r = train(run, "train.max_steps=2", "optim.lr=1.0", "train.seed=7")
    assert files(run) == kept  # config.yaml as it trained
    assert "nothing to train: " in r.stderr and "planner" not in r.stderr and "sample:" not in r.stderr
    code, out, _ = dry_run(run, capsys)  # a run folder continues from its config.yaml
    assert code == 0 and "# nothing to train: " in out
    code, _, err = dry_run(run, capsys, "train.max_steps=4", "--from-checkpoint", "step_00000009")
    assert code == 2 and re.search(r"--from-checkpoint step_00000009: there is no checkpoint step_00000009 in "
                                   r"\S+/checkpoints \(train.out_dir's\); choose one of step_00000002$", err.strip())
    assert files(run) == kept
