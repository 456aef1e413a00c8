"""Validation with a loss mask reports the loss over the target tokens of all its batches: the sum of
their losses over their count (the token-weighted mean), not the mean of per-micro-batch means; the
same set at every world size, and `zerodp eval RUN` prints the val_loss the run logged: the same
samples, loss mask, document masking and packing (zerodp.trainer.validate)."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY
from tests.support.cli_checks import one_line_error
from tests.support.sampler_workers import write_prepared
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.data.batches import IGNORE_INDEX, TokenBatches, load_tokens
from zerodp.models import build_model
from zerodp.trainer.validate import evaluate, rank_batches, validation_sums

TARGETS = [0.0, 1.0, 0.05, 0.6, 0.0, 0.0, 0.3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    docs = np.random.default_rng(0).integers(4, 61, size=200).tolist()
    return write_prepared(tmp_path_factory.mktemp("masked") / "data", docs, docs[:150], targets=TARGETS)


def token_mean(model, rows):
    """One cross-entropy over every target of every (x, y) in `rows`."""
    logits = torch.cat([model(x).flatten(0, 1) for x, _ in rows])
    return F.cross_entropy(logits, torch.cat([y.flatten() for _, y in rows])).item()


def test_validation_is_the_token_weighted_mean_over_all_eval_batches(folder, group):
    cfg = load_config(None, TINY + [f"data.source={folder}", "train.micro_batch_size=1", "train.eval_batches=6",
                                    "train.eval_every=1"])
    data = TokenBatches(load_tokens(cfg), cfg, "val")
    model = build_model(cfg.model, seed=1)
    strategy = SimpleNamespace(model=model, autocast=contextlib.nullcontext)
    env = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    got = evaluate(strategy, data, cfg, env)["val_loss"]
    rows = [data.rank_micro_batches(i, 1, 1, 0, 1)[0] for i in range(6)]
    counts = [int((y != IGNORE_INDEX).sum()) for _, y in rows]
    assert max(counts) > 3 * max(1, min(counts)), counts  # uneven micro batches: the test can fail
    with torch.no_grad():
        whole = token_mean(model, rows)
        plain = np.mean([model(x, y).item() for x, y in rows if (y != IGNORE_INDEX).any()])
    assert got == pytest.approx(whole, rel=1e-5)
    assert abs(plain - whole) > 1e-3, (plain, whole)


def test_the_validation_set_is_the_same_at_every_world_size(folder):
    """Rank r of world w computes micro batches r, r + w, ... of the one validation set (every rank as many
    forwards, a short rank one without targets): the ranks' sums add up to one process's, micro batch by
    micro batch, so the val_loss is the same at every world size and strategy."""
    cfg = load_config(None, TINY + [f"data.source={folder}", "train.micro_batch_size=2", "train.eval_batches=5",
                                    "train.eval_every=1", "data.document_masking=true"])
    data = TokenBatches(load_tokens(cfg), cfg, "val")
    model = build_model(cfg.model, seed=1).eval()
    with torch.no_grad():
        one = validation_sums(lambda b: model(*b), data, cfg)
        for world in (2, 3):
            shares = [rank_batches(5, r, world) for r in range(world)]
            assert len({len(s) for s in shares}) == 1  # as many forwards on every rank
            assert sorted(i for s in shares for i in s if i is not None) == list(range(5))
            ranks = sum(validation_sums(lambda b: model(*b), data, cfg, r, world) for r in range(world))
            assert ranks[0, 1] == one[0, 1] and float(ranks[0, 0]) == pytest.approx(float(one[0, 0]), rel=1e-12)
    # before, each rank took eval_batches micro batches of its own: world 2 evaluated twice the samples
    assert one[0, 1] == sum(int(data.target_counts(data.offsets(i, 2)).sum()) for i in range(5))


def run_and_eval(folder, tmp_path, capsys, packing: str) -> tuple[float, dict, dict]:
    """Train 1 step of an SFT-like run (loss mask, document masking, `packing`) that validates at its end,
    export it --to hf: (the val_loss it logged, zerodp eval RUN's result, zerodp eval RUN --all's)."""
    run = tmp_path / f"run-{packing}"
    assert main(["train", "configs/tiny.yaml", *TINY, f"data.source={folder}", "data.document_masking=true",
                 f"data.packing={packing}", "train.max_steps=1", "train.eval_every=1", "train.eval_batches=3",
                 "train.global_batch_size=2", "strategy.name=single", f"train.out_dir={run}",
                 "checkpoint.every=1"]) == 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]
    assert main(["convert", str(run), str(tmp_path / f"hf-{packing}"), "--to", "hf", "--no-progress"]) == 0
    capsys.readouterr()
    results = []
    for extra in ([], ["--all", "--batch-size", "64"]):
        assert main(["eval", str(run), "--json", "--no-progress", *extra]) == 0
        results.append(json.loads(capsys.readouterr().out))
    return logged, *results


@pytest.mark.parametrize("packing", ["true", "false"])
def test_eval_of_the_run_is_the_val_loss_training_logged_and_the_export_the_same(folder, tmp_path, capsys, packing):
    logged, validation, whole = run_and_eval(folder, tmp_path, capsys, packing)
    assert validation["set"] == "validation" and validation["samples"] == 3 * 2
    assert abs(validation["val_loss"] - logged) < 1e-6, (validation, logged)
    assert (validation["documents_masked"], validation["packing"]) == (True, packing == "true")
    # the whole split with the same data settings: the export, its data named, computes what the run does
    assert whole["set"] == "split" and whole["samples"] > validation["samples"]
    data = [f"data.source={folder}", "data.document_masking=true", f"data.packing={packing}"]
    assert main(["eval", str(tmp_path / f"hf-{packing}"), *data, "--json", "--no-progress", "--batch-size", "64"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert (exported["set"], exported["targets"], exported["samples"]) == ("split", whole["targets"], whole["samples"])
    assert exported["val_loss"] == pytest.approx(whole["val_loss"], abs=1e-5)
    if packing == "false":
        return  # one conversation a row: document masking changes nothing
    # without the run's document masking the same export computes another loss, and says so
    assert main(["eval", str(tmp_path / f"hf-{packing}"), data[0], "--no-progress", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "document masking off" in out and f"val_loss {whole['val_loss']:.4f}" not in out


def test_eval_of_a_split_without_targets_says_what_to_do(tmp_path, capsys):
    folder = write_prepared(tmp_path / "none", [40] * 20, [40] * 5, targets=[0.0])
    run = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", *TINY, f"data.source={folder}", "train.max_steps=1",
                 "train.global_batch_size=2", "strategy.name=single", f"train.out_dir={run}",
                 "checkpoint.every=1"]) == 0
    capsys.readouterr()
    one_line_error(capsys, main(["eval", str(run), "--all", "--no-progress"]),
                   r"^zerodp: error: the validation split \(.*val.bin\) holds no target tokens in the 6 samples "
                   r"evaluated \(its loss mask is all 0 there\); evaluate more of it \(--all\) or prepare with "
                   r"--train-on all$")


def test_a_block_size_past_the_models_positions_is_said_at_start_up(tmp_path, capsys):
    """model.block_size above model.hf_config's max_position_embeddings: one warning line at start-up (the
    dimensions are configs/tiny.yaml's)."""
    hf = tmp_path / "llama"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 256, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    base = ["train", "configs/tiny.yaml", "data.max_bytes=100000", f"model.hf_config={hf}", "strategy.name=single",
            "--dry-run"]
    assert main([*base, "model.block_size=128"]) == 0
    warning = (f"zerodp: warning: model.block_size=128 is past the 64 positions of {hf / 'config.json'} "
               f"(max_position_embeddings): the model never saw positions past 64; set model.block_size=64 or "
               f"fewer unless you mean to extend its context\n")
    assert warning in capsys.readouterr().err
    assert main([*base, "model.block_size=64"]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().err
