"""data.packing=false: one conversation a sample, from the document index, padded to block_size + 1;
the padding is never a target and the step's weights still make its loss the global batch's target mean.
Without a prepare folder with an index it is a one-line error, exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import TINY
from tests.support.cli_checks import one_line_error
from tests.support.sampler_workers import write_prepared
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.data.batches import IGNORE_INDEX, TokenBatches, load_tokens
from zerodp.models import build_model

G, T = 12, 32
TARGETS = [0.0, 1.0, 0.05, 0.6, 0.3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    docs = np.random.default_rng(1).integers(4, 50, size=60).tolist()  # some longer than T + 1 = 33
    return write_prepared(tmp_path_factory.mktemp("unpacked") / "data", docs, docs[:20], targets=TARGETS), docs


def batches(folder, micro=2, packing="false"):
    cfg = load_config(None, TINY + [f"data.source={folder}", f"data.packing={packing}", f"model.block_size={T}",
                                    f"train.global_batch_size={G}", f"train.micro_batch_size={micro}"])
    return cfg, TokenBatches(load_tokens(cfg), cfg, "train")


def test_every_sample_is_one_conversation_from_its_start_and_padding_is_no_target(folder):
    path, docs = folder
    _, data = batches(path)
    tokens, mask, index = data.tokens, data.streams[0].mask, data.streams[0].index
    assert data.samples_per_epoch() == [len(docs)]
    seen = set()
    for step in range(len(docs) // G):
        where = data.locate(step, G)
        assert set(where.start.tolist()) <= set(index.tolist())  # each row starts where a conversation does
        x, y = data.rows(data.offsets(step, G))
        for r, (doc, start) in enumerate(zip(where.sample.tolist(), where.start.tolist())):
            n = min(docs[doc], T + 1)  # its real tokens
            assert start == index[doc]
            assert x[r, :n].tolist() == tokens[start : start + min(n, T)].tolist()
            assert (x[r, n:] == 0).all()  # the padding
            assert (y[r, n - 1 :] == IGNORE_INDEX).all()  # never a target
            real = tokens[start + 1 : start + n].astype(np.int64)
            want = np.where(mask[start + 1 : start + n] == 1, real, IGNORE_INDEX)
            assert y[r, : n - 1].tolist() == want.tolist()
            seen.add(doc)
        assert data.target_counts(data.offsets(step, G)).tolist() == (y != IGNORE_INDEX).sum(dim=1).tolist()
    assert len(seen) == len(docs) // G * G  # without replacement within the epoch


def test_the_weights_give_the_global_batchs_target_mean_unpacked(folder):
    cfg, data = batches(folder[0], micro=3)
    model = build_model(cfg.model, seed=1)
    whole = model(*data.rows(data.offsets(1, G))).item()
    weighted = 0.0
    for rank in range(2):
        mb = data.rank_micro_batches(1, G, 3, rank, 2)
        weighted += sum(w * model(x, y).item() for w, (x, y) in zip(mb.weights, mb)) / (G // 3)
    assert weighted == pytest.approx(whole, rel=1e-5)


def test_packing_true_keeps_fixed_windows(folder):
    _, data = batches(folder[0], packing="true")
    assert (data.locate(0, G).start % T == 0).all()


@pytest.mark.parametrize("source,pattern", [
    ("builtin", r"data.packing=false reads one conversation a sample from a zerodp prepare folder, and builtin is "
                r"none; run zerodp prepare --chat"),
    ("NOINDEX", r"data.packing=false needs the document index \(train.idx\) of .*; prepare it again"),
])
def test_packing_false_without_an_index_is_one_line_exit_2(tmp_path, capsys, source, pattern):
    if source == "NOINDEX":
        source = str(write_prepared(tmp_path / "old", [40] * 20, [40] * 5, index=False))
    code = main(["train", "configs/tiny.yaml", f"data.source={source}", "data.packing=false", "model.vocab_size=256",
                 "--dry-run"])
    one_line_error(capsys, code, pattern)


def test_start_up_says_what_unpacked_samples_never_train(folder, capsys):
    """Conversations longer than a sample lose their targets past block_size + 1 tokens: start-up says how
    many conversations and targets, the numbers the batches themselves give."""
    path, docs = folder
    cfg, data = batches(path)
    mask, index = data.streams[0].mask, data.streams[0].index
    trained = int(data.target_counts(index).sum())  # every conversation's one sample
    total = int(mask.sum())
    long = sum(n > T + 1 for n in docs)
    assert 0 < trained < total and long > 0
    code = main(["train", "configs/tiny.yaml", *TINY, f"data.source={path}", "data.packing=false",
                 f"model.block_size={T}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (f"zerodp: data.packing=false: {long:,} of {len(docs)} conversations of {path / 'train.bin'} are longer "
            f"than a sample, and {total - trained:,} of its {total:,} targets are never trained (a sample is a "
            f"conversation's first model.block_size+1={T + 1} tokens); raise model.block_size, drop them at prepare "
            f"time (--max-len {T + 1} --too-long drop), or set data.packing=true\n") in err, err


@pytest.fixture(scope="module")
def no_targets(tmp_path_factory):
    """Conversations of 40 tokens whose targets are their last 8: none within a sample of 16 + 1 tokens."""
    return write_prepared(tmp_path_factory.mktemp("late") / "data", [40] * 30, [40] * 6, targets=[0.2])


def test_a_run_whose_samples_hold_no_target_is_refused_and_writes_nothing(no_targets, tmp_path):
    """A launch (its own process: a failed launch leaves the process at once) is refused in one line, exit 2,
    before it creates its run folder. It trained `loss 0.0000` every step before, and zerodp verify passed
    on it; verify's runs are refused the same way now (and its verdict needs targets: tests/unit/test_verify.py)."""
    run = tmp_path / "runs" / "late"
    r = subprocess.run([sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", *TINY,
                        f"data.source={no_targets}", "data.packing=false", "model.block_size=16",
                        f"train.out_dir={run}", "train.max_steps=1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert re.fullmatch(r"zerodp: error: data.packing=false: no sample of .*train.bin holds a target: of its 30 "
                        r"conversations, 30 are longer than a sample \(model.block_size\+1=17 tokens\) and none "
                        r"has a target within its first 17 tokens \(240 targets in all\); raise model.block_size "
                        r"or set data.packing=true\n", r.stderr), r.stderr
    assert not (tmp_path / "runs").exists()  # the refused launch left no run folder


def test_data_batch_reports_the_padded_rows_trained(folder, capsys):
    """Unpacked rows: each row's real tokens (a conversation's first block_size + 1 at most), its padding and
    its targets, which add up to the step's target_tokens."""
    path, docs = folder
    cfg, data = batches(path)
    over = [*TINY, f"data.source={path}", "data.packing=false", f"model.block_size={T}", f"train.global_batch_size={G}"]
    assert main(["data", "batch", "configs/tiny.yaml", *over, "--step", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    where = data.locate(3, G)
    assert got["targets"] == data.rank_micro_batches(3, G, 2, 0, 1).targets == sum(r["targets"] for r in got["rows"])
    for r, doc, start in zip(got["rows"], where.sample.tolist(), where.start.tolist()):
        n = min(docs[doc], T + 1)
        assert r["tokens"] == [start, start + n] and r["padding"] == T + 1 - n and r["documents"] == [doc, doc]
