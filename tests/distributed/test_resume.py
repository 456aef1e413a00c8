"""Checkpoints: exact resume, atomic publication, integrity fallback, metrics.jsonl."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import TINY
from tests.support.harness import run_distributed
from zerodp.checkpoint import store as checkpoint


def resume_runs(tiny, out, strategy):
    over = tiny + [f"strategy.name={strategy}", "train.max_steps=6"]
    return [
        {"overrides": over + [f"train.out_dir={out / 'straight'}"]},
        {"overrides": over + [f"train.out_dir={out / 'split'}", "train.max_steps=3"]},
        {"overrides": over + [f"train.out_dir={out / 'split'}"], "fresh": False},
    ]


def incomplete_runs(out):
    return [{"overrides": TINY + ["strategy.name=single", "train.max_steps=4", "checkpoint.every=2",
                                  f"train.out_dir={out}"]}]


def fresh_runs(out):
    over = TINY + ["strategy.name=single", "checkpoint.keep_last=1", f"train.out_dir={out}"]
    return [{"overrides": over + ["train.max_steps=3"]}, {"overrides": over + ["train.max_steps=1"], "fresh": True}]


def sha256_runs(out):
    return [{"overrides": TINY + ["strategy.name=ddp", "train.max_steps=4", "checkpoint.every=2",
                                  f"train.out_dir={out}"]}]


IMPORTED = TINY + ["strategy.name=ddp", "train.max_steps=3"]


def imported_source_runs(out):
    return [{"overrides": IMPORTED + ["strategy.name=single", "train.max_steps=2", f"train.out_dir={out}"]}]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The training runs the tests below start from, in one launch per world size rather than one per test
    (each launch costs every rank its start-up): {world: (folder, {test: that test's results on rank 0})}.
    Each test has its own folder under the launch's."""
    plans = {1: {"resume": lambda out: resume_runs(TINY, out, "single"), "incomplete": incomplete_runs,
                 "fresh": fresh_runs, "imported": imported_source_runs},
             2: {"resume": lambda out: resume_runs(TINY, out, "ddp"), "sha256": sha256_runs}}
    launched = {}
    for world, plan in plans.items():
        tmp = tmp_path_factory.mktemp(f"world{world}")
        runs = {name: make(tmp / name) for name, make in plan.items()}
        results = run_distributed("tests.support.workers:train_runs", world,
                                  {"runs": [r for rs in runs.values() for r in rs]})[0]
        by_test, i = {}, 0
        for name, rs in runs.items():
            by_test[name], i = results[i:i + len(rs)], i + len(rs)
        launched[world] = (tmp, by_test)
    return launched


@pytest.mark.parametrize("strategy, world", [("single", 1), ("ddp", 2)])
def test_resume_reproduces_uninterrupted_losses(launched, strategy, world):
    root, by_test = launched[world]
    out = root / "resume"
    straight, first, resumed = by_test["resume"]
    assert straight["strategy"] == first["strategy"] == resumed["strategy"] == strategy
    assert len(first["losses"]) == 3 and len(resumed["losses"]) == 3
    assert first["losses"] + resumed["losses"] == straight["losses"]  # bit-identical in fp32
    for name, w in straight["weights"].items():
        assert (w - resumed["weights"][name]).abs().max().item() == 0.0, name
    records = [json.loads(line) for line in (out / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "max_step_time_s"):
        assert key in records[-1]
    assert records[-1]["tokens"] == 6 * 12 * 32
    # the gradient noise scale's averages come back from trainer.json: the estimate continues exactly
    assert resumed["noise"] == straight["noise"] and straight["noise"][-1]["sequences"] > 0
    meta = checkpoint.read_meta(out / "split" / "checkpoints" / "step_00000006")
    assert meta["strategy"] == strategy and meta["world_size"] == world and meta["step"] == 6
    assert meta["params"]["transformer.wte.weight"]["shape"] == [256, 32]
    assert meta["format_version"] == checkpoint.FORMAT_VERSION


def test_incomplete_and_corrupted_checkpoints_are_skipped(launched, capsys):
    out = launched[1][0] / "incomplete"
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert checkpoint.find_resumable(out) == root / "step_00000004"
    # A save that died before publication leaves only a .tmp folder: never a candidate.
    shutil.copytree(root / "step_00000004", root / "step_00000006.tmp")
    assert checkpoint.find_resumable(out) == root / "step_00000004"
    # A published checkpoint whose shard was later corrupted falls back to the previous one.
    shard = root / "step_00000004" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint.find_resumable(out) == root / "step_00000002"
    err = capsys.readouterr().err
    assert "skipping checkpoint step_00000004" in err and "model.safetensors fails its sha256 check" in err
    # Truncation is caught by size alone.
    shard.write_bytes(bytes(data[:100]))
    assert "truncated" in checkpoint.verify(root / "step_00000004")


def test_resume_lookup_shares_the_sha256_reading_over_ranks(launched):
    """Each rank hashes every world-th file of a candidate; a corruption only rank 1 reads is still
    caught, and both ranks fall back to the same older checkpoint."""
    out = launched[2][0] / "sha256"
    root = out / "checkpoints"
    files = sorted(checkpoint.read_meta(root / "step_00000004")["files"])
    assert len(files) >= 4
    victim = root / "step_00000004" / files[1]  # second file in the sorted manifest: rank 1's share
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    results = run_distributed("tests.support.workers:find_resumable_shared", 2, {"out_dir": str(out)})
    assert [r["found"] for r in results] == [str(root / "step_00000002")] * 2
    assert f"checkpoints/step_00000004/{files[1]}" in results[1]["hashed"]
    older = [[h for h in r["hashed"] if h.startswith("checkpoints/step_00000002/")] for r in results]
    assert not set(older[0]) & set(older[1])  # no file hashed twice
    want = {f"checkpoints/step_00000002/{f}" for f in checkpoint.read_meta(root / "step_00000002")["files"]}
    assert set(older[0]) | set(older[1]) == want  # and none skipped


def test_disk_full_is_a_clear_error_and_keeps_the_previous_checkpoint(tiny, tmp_path):
    """A real full disk: a 1 MiB tmpfs that holds one checkpoint of a model too big for two."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1400k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    try:
        over = [a for a in tiny if not a.startswith("model.n_embd")] + [
            "model.n_embd=48", "strategy.name=ddp", "train.max_steps=4", "checkpoint.every=2",
            "checkpoint.keep_last=3", f"train.out_dir={disk}"]
        with pytest.raises(RuntimeError) as info:
            run_distributed("tests.support.workers:train_runs", 2, {"runs": [{"overrides": over}]})
        message = str(info.value)
        assert "could not write checkpoint step_00000004" in message
        assert "No space left on device" in message and "the newest intact checkpoint is still step_00000002" in message
        root = disk / "checkpoints"
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002"]
        assert checkpoint.verify(root / "step_00000002") is None
    finally:
        subprocess.run(["umount", str(disk)])


def test_fresh_sets_earlier_checkpoints_aside_and_never_mixes_runs(launched):
    out = launched[1][0] / "fresh"
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert checkpoint.find_resumable(out) == root / "step_00000001"
    (aside,) = out.glob("earlier-*")
    assert (aside / "checkpoints" / "step_00000003" / "meta.json").is_file()  # nothing saved is lost


def test_resume_from_an_imported_checkpoint(launched, tmp_path):
    """`zerodp convert model.safetensors run/checkpoints/step_00000002 --to zerodp`, then train resumes."""
    from zerodp.convert import open_checkpoint, write_zerodp

    source = launched[1][0] / "imported"
    with open_checkpoint(source / "checkpoints" / "step_00000002" / "model.safetensors") as src:
        write_zerodp(src, tmp_path / "b" / "checkpoints" / "step_00000002", step=2, progress=False)
    (got,) = run_distributed("tests.support.workers:train_runs", 2, {"runs": [
        {"overrides": IMPORTED + [f"train.out_dir={tmp_path / 'b'}"], "fresh": False}]})[0]
    assert len(got["losses"]) == 1  # resumed at step 2, trained step 3
    records = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3 and records[-1]["tokens"] == 3 * 12 * 32
