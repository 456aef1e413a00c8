"""`zerodp convert` never costs data (issue 9, item 1): an output that overlaps an input, a training
run or checkpoint, foreign files, or the other target's output is refused, with or without
--overwrite, before anything is touched; an earlier output of the same kind is replaced only once the
new one is complete; a failure midway leaves the old output as it was and no staging folder behind."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.cli_checks import zerodp_here
from tests.support.harness import run_distributed
from zerodp.checkpoint import store as checkpoint
from zerodp.cli.commands import main
from zerodp.convert import open_checkpoint, write_safetensors, write_zerodp
from zerodp.errors import UserError

STEP2, STEP4 = "checkpoints/step_00000002", "checkpoints/step_00000004"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A real training run folder: config.yaml, metrics.jsonl, checkpoints step 2 and 4 (strategy single)."""
    from tests.conftest import TINY

    out = tmp_path_factory.mktemp("safety") / "run"
    run_distributed("tests.support.workers:train_runs", 1, {"runs": [{"overrides": TINY + [
        "strategy.name=single", "train.max_steps=4", "checkpoint.every=2", f"train.out_dir={out}"]}]})
    assert {"config.yaml", "metrics.jsonl", "checkpoints"} <= {p.name for p in out.iterdir()}
    assert (out / STEP2 / "meta.json").is_file() and (out / STEP4 / "meta.json").is_file()
    return out


@pytest.fixture
def run(trained_run, tmp_path) -> Path:
    """This test's own copy of the run (tests may try to damage it)."""
    shutil.copytree(trained_run, tmp_path / "run")
    return tmp_path / "run"


def snapshot(root: Path) -> dict[str, str]:
    """Every file's sha256 and every folder under `root`: equal snapshots mean byte-identical trees."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
            for p in sorted(root.rglob("*"))}


def staging_left(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def cli(*args) -> subprocess.CompletedProcess:
    """`zerodp convert ARGS --no-progress`, run in this process (its exit code and lines, as a new python's)."""
    return zerodp_here("convert", *args, "--no-progress")


def assert_refused(args, match: str) -> None:
    r = cli(*args)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("zerodp: error: "), r.stderr[-3000:]
    assert match in r.stderr, r.stderr


def test_dst_is_the_run_folder_holding_src_is_refused_and_the_run_untouched(run, tmp_path):
    """The user's report: `convert runs/y/checkpoints/step_00000006 runs/y --overwrite` deleted the run."""
    before = snapshot(run)
    src = run / STEP4
    for extra in ([], ["--overwrite"], ["--overwrite", "--to", "zerodp"]):
        assert_refused([src, run, *extra], f"the output {run} holds the input {src}; writing it could destroy")
    (tmp_path / "link").symlink_to(run)  # the same run under another name
    assert_refused([src, tmp_path / "link", "--overwrite"], f"the output {tmp_path / 'link'} holds the input {src}")
    assert snapshot(run) == before and staging_left(tmp_path) == []


def test_dst_inside_src_is_refused(run, tmp_path):
    """`convert runs/tiny runs/tiny/checkpoints/step_00000500 --to zerodp --overwrite` deleted the very
    checkpoint it read (the run's latest), and the next training run started from step 0."""
    before = snapshot(run)
    assert_refused([run, run / STEP4, "--to", "zerodp", "--overwrite"],
                   f"the output {run / STEP4} lies inside the input {run}")
    # A new folder inside the source's folder is refused too: it would be written into the checkpoint.
    assert_refused([run / STEP4, run / STEP4 / "export"], f"the output {run / STEP4 / 'export'} lies inside the input")
    assert_refused([run / STEP4, run / STEP4, "--overwrite"], f"the output {run / STEP4} is the input {run / STEP4}")
    # The library checks the folder the source reads from, whatever path opened it.
    with pytest.raises(UserError, match=r"lies inside the input .*step_00000004"):
        write_zerodp(open_checkpoint(run), run / STEP4 / "sub", progress=False)
    assert snapshot(run) == before


def test_src_inside_dst_is_refused_even_for_an_earlier_output(run, tmp_path):
    before = snapshot(run)
    assert_refused([run / STEP2, run / "checkpoints", "--overwrite"],
                   f"the output {run / 'checkpoints'} holds the input {run / STEP2}")
    # An earlier export may be replaced, but not by a conversion that reads from it.
    export = tmp_path / "export"
    assert cli(run / STEP4, export).returncode == 0
    exported = snapshot(export)
    assert_refused([export / "model.safetensors", export, "--overwrite"],
                   f"the output {export} holds the input {export / 'model.safetensors'}")
    assert_refused([export, export, "--overwrite"], f"the output {export} is the input {export}")
    assert snapshot(export) == exported and snapshot(run) == before and staging_left(tmp_path) == []


def test_training_runs_and_checkpoints_are_never_replaced(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    before = snapshot(other)
    src = run / STEP4
    for to in ("safetensors", "zerodp"):
        assert_refused([src, other, "--to", to, "--overwrite"],
                       f"{other} is a training run folder (it has checkpoints); zerodp convert --to {to} never "
                       f"replaces it, even with --overwrite; choose a new folder")
        assert_refused([src, other / STEP2, "--to", to, "--overwrite"],
                       f"{other / STEP2} is a checkpoint written by training (its meta.json has no converted_from)")
    assert snapshot(other) == before
    for marker in ("metrics.jsonl", "config.yaml"):  # any one of them makes a run folder
        lone = tmp_path / f"lone_{marker}"
        lone.mkdir()
        shutil.copy(run / marker, lone / marker)
        assert_refused([src, lone, "--overwrite"], f"{lone} is a training run folder (it has {marker})")
        assert (lone / marker).read_bytes() == (run / marker).read_bytes()
    assert staging_left(tmp_path) == []


def test_foreign_files_are_never_replaced(run, tmp_path):
    src = run / STEP4
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    assert_refused([src, notes, "--overwrite"], f"{notes} holds todo.txt, which zerodp convert did not write")
    # An export folder the user added a file to: replacing it would lose the file.
    export = tmp_path / "export"
    assert cli(src, export).returncode == 0
    (export / "tokenizer.json").write_text("{}")
    assert_refused([src, export, "--overwrite"], f"{export} holds tokenizer.json, which zerodp convert did not write")
    # A model.safetensors from another tool (no zerodp.source in its metadata).
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.ones(3)}, hf / "model.safetensors", metadata={"format": "pt"})
    assert_refused([src, hf, "--overwrite"], f"{hf} holds model.safetensors, which zerodp convert did not write")
    assert (notes / "todo.txt").read_text() == "keep me" and (export / "tokenizer.json").is_file()
    assert load_file(hf / "model.safetensors").keys() == {"w"}
    assert staging_left(tmp_path) == []


def test_output_of_the_other_target_is_refused(run, tmp_path):
    src = run / STEP4
    export, ckpt = tmp_path / "export", tmp_path / "ckpt"
    assert cli(src, export, "--max-shard-size", "20KB").returncode == 0
    assert cli(src, ckpt, "--to", "zerodp").returncode == 0
    before = snapshot(tmp_path)
    assert_refused([src, export, "--to", "zerodp", "--overwrite"],
                   f"{export} is the output of `zerodp convert --to safetensors`; zerodp convert --to zerodp never")
    assert_refused([src, ckpt, "--overwrite"],
                   f"{ckpt} is the output of `zerodp convert --to zerodp`; zerodp convert --to safetensors never")
    assert_refused([src, export], f"{export} already exists and is not empty; choose a new folder or pass --overwrite")
    assert snapshot(tmp_path) == before


def _old_output_stays_while_writing(monkeypatch, dst: Path) -> list[int]:
    """Patch the writer's file writer to check, before each file, that `dst` still holds the old output."""
    import zerodp.convert.writers as writers

    old, real, calls = snapshot(dst), writers.write_safetensors_file, []

    def checking(*args, **kwargs):
        assert snapshot(dst) == old, "the old output was touched before the new one was complete"
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(writers, "write_safetensors_file", checking)
    return calls


def test_earlier_safetensors_export_is_replaced_once_the_new_one_is_complete(run, tmp_path, monkeypatch):
    export = tmp_path / "export"
    assert main(["convert", str(run / STEP2), str(export), "--max-shard-size", "20KB", "--no-progress"]) == 0
    assert len(list(export.glob("model-*-of-*.safetensors"))) > 1
    calls = _old_output_stays_while_writing(monkeypatch, export)
    assert main(["convert", str(run / STEP4), str(export), "--overwrite", "--no-progress"]) == 0
    assert calls  # the check ran
    assert sorted(p.name for p in export.iterdir()) == ["model.safetensors"]  # no stale shard or index
    src = open_checkpoint(run / STEP4)
    got = load_file(export / "model.safetensors")
    assert got.keys() == set(src.param_names()) and all(torch.equal(got[n], src.get(n)) for n in got)
    assert staging_left(tmp_path) == []


def test_earlier_zerodp_conversion_is_replaced_once_the_new_one_is_complete(run, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    assert main(["convert", str(run / STEP2), str(ckpt), "--to", "zerodp", "--no-progress"]) == 0
    calls = _old_output_stays_while_writing(monkeypatch, ckpt)
    assert main(["convert", str(run / STEP4), str(ckpt), "--to", "zerodp", "--step", "9", "--overwrite",
                 "--no-progress"]) == 0
    assert calls
    assert checkpoint.verify(ckpt) is None
    meta = checkpoint.read_meta(ckpt)
    assert meta["step"] == 9 and meta["converted_from"]["path"] == str(run / STEP4)
    want = run / STEP4
    for f in ("model.safetensors", "optim.safetensors"):
        a, b = load_file(ckpt / f), load_file(want / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert staging_left(tmp_path) == []


@pytest.mark.parametrize("path", ["read", "kernel copy"])
def test_ctrl_c_midway_leaves_the_old_export_intact(run, tmp_path, monkeypatch, path):
    """Interrupted on the third tensor, whether tensors are read and cast (--dtype bf16) or copied file
    to file as stored."""
    from zerodp.convert import source as source_module
    from zerodp.convert.zerodp_ckpt import ZerodpSource

    export = tmp_path / "export"
    write_safetensors(open_checkpoint(run / STEP2), export, progress=False)
    before = snapshot(export)
    owner, attr = (ZerodpSource, "get") if path == "read" else (source_module, "copy_ranges")
    real, calls = getattr(owner, attr), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, interrupted)
    dtype = ["--dtype", "bf16"] if path == "read" else []
    assert main(["convert", str(run / STEP4), str(export), "--overwrite", "--no-progress", *dtype]) == 130
    assert len(calls) == 3 and snapshot(export) == before and staging_left(tmp_path) == []


def test_source_truncated_during_a_kernel_copy_leaves_the_old_export_intact(run, tmp_path, monkeypatch, capsys):
    """A source file cut short while its tensors are copied file to file: one line, exit 2, the old
    export as it was."""
    from zerodp.convert import source as source_module

    export = tmp_path / "export"
    write_safetensors(open_checkpoint(run / STEP2), export, progress=False)
    before = snapshot(export)
    real, calls = source_module.copy_ranges, []

    def truncating(where, *args):
        calls.append(1)
        if len(calls) == 3:
            os.truncate(where.ranges[0][0], where.ranges[0][1] + 4)  # the rest of the file is gone
        return real(where, *args)

    monkeypatch.setattr(source_module, "copy_ranges", truncating)
    assert main(["convert", str(run / STEP4), str(export), "--overwrite", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.safetensors" in err, err
    assert snapshot(export) == before and staging_left(tmp_path) == []


@pytest.mark.parametrize("path", ["read", "kernel copy"])
def test_source_damaged_midway_leaves_the_old_conversion_intact(run, tmp_path, monkeypatch, capsys, path):
    """A source file truncated while it is being read (detected by the real reader, mid-stream): read
    and cast (--to safetensors --dtype bf16), or copied file to file (--to zerodp)."""
    from zerodp.convert import source as source_module
    from zerodp.convert.source import SafetensorsFile

    out = tmp_path / "out"
    if path == "read":
        write_safetensors(open_checkpoint(run / STEP2), out, dtype="bf16", progress=False)
        owner, attr, args = SafetensorsFile, "read", ["--dtype", "bf16"]
    else:
        write_zerodp(open_checkpoint(run / STEP2), out, progress=False)
        owner, attr, args = source_module, "copy_ranges", ["--to", "zerodp"]
    before = snapshot(out)
    real, calls = getattr(owner, attr), []

    def truncating(first, *rest):
        calls.append(1)
        if len(calls) == 3:  # the rest of the file is gone
            os.truncate(first.path if path == "read" else first.ranges[0][0], 8)
        return real(first, *rest)

    monkeypatch.setattr(owner, attr, truncating)
    assert main(["convert", str(run / STEP4), str(out), "--overwrite", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "model.safetensors" in err and "ended" in err, err
    assert snapshot(out) == before and staging_left(tmp_path) == []
    assert path == "read" or checkpoint.verify(out) is None
