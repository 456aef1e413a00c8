"""The sampler (zerodp.data.samples, zerodp.data.batches): every sample exactly once an epoch whatever the
world size and micro batch, a new order each epoch, step 10^6 found directly, blends within one sample
of their weights over every window, document ids from the index, and every bad input one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.support.cli_checks import zerodp_here
from tests.support.sampler_workers import write_prepared
from zerodp.config import load_config
from zerodp.data.batches import TokenBatches, load_tokens
from zerodp.data.samples import Blend, SampleIndex, doc_ids
from zerodp.errors import ConfigError, UserError

T, G, SAMPLES = 32, 12, 60  # block, global batch, samples an epoch: 5 steps an epoch


@pytest.fixture
def folder(tmp_path):
    """A prepared folder whose train.bin holds SAMPLES * T + 1 tokens (SAMPLES samples) in documents of
    varied lengths."""
    rng = np.random.default_rng(0)
    lengths, total = [], 0
    while total < SAMPLES * T + 1:
        lengths.append(min(int(rng.integers(5, 90)), SAMPLES * T + 1 - total))
        total += lengths[-1]
    return write_prepared(tmp_path / "data", lengths, [40] * 10)


def config(tiny, *more):
    return load_config(None, [*tiny, f"model.block_size={T}", f"train.global_batch_size={G}", *more])


def test_every_sample_once_an_epoch_at_world_sizes_1_2_3(tiny, folder):
    cfg = config(tiny, f"data.source={folder}")
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    stream = np.fromfile(folder / "train.bin", dtype=np.uint16)
    assert data.samples_per_epoch() == [SAMPLES]
    epoch = np.concatenate([data.offsets(k, G) for k in range(SAMPLES // G)])
    assert sorted(epoch // T) == list(range(SAMPLES)) and (epoch % T == 0).all()  # each sample once
    for world, micro in ((1, 2), (1, 12), (2, 3), (2, 6), (3, 2), (3, 4)):
        for k in range(SAMPLES // G):
            parts = [mb for r in range(world) for mb in data.rank_micro_batches(k, G, micro, r, world)]
            assert all(len(mb) == 2 and mb[0].shape == (micro, T) for mb in parts)
            x, y = torch.cat([mb[0] for mb in parts]), torch.cat([mb[1] for mb in parts])
            starts = epoch[k * G : (k + 1) * G]  # the same global batch, the same order
            assert x.tolist() == [stream[s : s + T].tolist() for s in starts]
            assert y.tolist() == [stream[s + 1 : s + T + 1].tolist() for s in starts]
    # consecutive samples share their boundary token: sample i's label end is sample i+1's first input
    assert stream[T] == stream[1 * T : 2 * T + 1][0]


def test_the_epoch_boundary_and_a_new_order_the_next_epoch(tiny, folder):
    cfg = config(tiny, f"data.source={folder}")
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    first = np.concatenate([data.offsets(k, G) for k in range(5)]) // T
    second = np.concatenate([data.offsets(k, G) for k in range(5, 10)]) // T
    assert sorted(second) == list(range(SAMPLES)) and not np.array_equal(first, second)
    assert data.epochs(5, G) == [1.0] and data.epochs(6, G) == [1.2]
    odd = TokenBatches(load_tokens(cfg), config(tiny, f"data.source={folder}", "train.global_batch_size=7",
                                                   "train.micro_batch_size=1"), "train")
    across = odd.offsets(8, 7) // T  # positions 56..62: the last 4 of epoch 0, the first 3 of epoch 1
    zero, one = first_order(cfg)
    assert across[:4].tolist() == zero[56:].tolist() and across[4:].tolist() == one[:3].tolist()
    assert zero.tolist() == first.tolist() and one.tolist() == second.tolist()
    other = TokenBatches(load_tokens(cfg), config(tiny, f"data.source={folder}", "train.seed=1"), "train")
    assert not np.array_equal(other.offsets(0, G), data.offsets(0, G))  # the seed picks the order


def test_a_resume_with_another_global_batch_takes_each_sample_once(tiny, folder):
    """3 steps of 12, then (resumed at the 36 samples consumed) steps of 8: the epoch's 60 samples once
    each, in the order of the epoch, and the epoch counts where the data stands."""
    cfg = config(tiny, f"data.source={folder}")
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    before = np.concatenate([data.offsets(k, G) for k in range(3)])
    data.continue_from(3, 3 * G)
    after = np.concatenate([data.offsets(k, 8) for k in range(3, 6)])  # 24 samples: the epoch's last
    zero, _ = first_order(cfg)
    assert (np.concatenate([before, after]) // T).tolist() == zero.tolist()
    assert data.epochs(6, 8) == [1.0] and data.position(3, 8) == 36


def first_order(cfg):
    ix = SampleIndex(SAMPLES * T + 1, T, [cfg.train.seed, 0, 0])
    return ix.permutation(0).copy(), ix.permutation(1).copy()


def test_step_a_million_is_found_directly(tiny, folder, monkeypatch):
    """Resuming at step 10^6 builds the one permutation of its epoch, as step 1 does, and then O(B)."""
    cfg = config(tiny, f"data.source={folder}")
    built = []
    real = np.random.PCG64
    monkeypatch.setattr(np.random, "PCG64", lambda key: built.append(list(key)) or real(key))  # counts builds only
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    got = data.offsets(10**6, G) // T
    epoch = 10**6 * G // SAMPLES  # 200,000: step 10^6 starts an epoch (G divides SAMPLES)
    assert built == [[cfg.train.seed, 0, 0, epoch]]
    monkeypatch.setattr(np.random, "PCG64", real)
    want = SampleIndex(SAMPLES * T + 1, T, [cfg.train.seed, 0, 0]).permutation(epoch)[:G]
    assert got.tolist() == want.tolist()
    assert data.epochs(10**6, G) == [float(epoch)]


def test_a_blend_is_within_one_sample_of_its_weights_over_every_window(tiny, tmp_path):
    a = write_prepared(tmp_path / "a", [50] * 40, [40] * 4)
    b = write_prepared(tmp_path / "b", [30] * 30, [40] * 4)
    B = 10
    cfg = config(tiny, f"train.global_batch_size={B}",
                 f"data.sources=[{{path: {a}, weight: 0.7}}, {{path: {b}, weight: 0.3}}]")
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    steps = 400  # a, 62 samples an epoch: 4.5 epochs; b, 28: 4.3 epochs
    per_step = np.array([np.bincount(data.locate(k, B).source, minlength=2) for k in range(steps)])
    windows = np.array([per_step[k : k + 20].sum(axis=0) for k in range(steps - 20 + 1)])
    assert (np.abs(windows - np.array([0.7, 0.3]) * 20 * B) <= 1).all()
    # each source keeps its own epochs: every sample of a exactly once in its first 62 draws
    where = [data.locate(k, B) for k in range(steps)]
    a_samples = np.concatenate([w.sample[w.source == 0] for w in where])
    assert sorted(a_samples[:62]) == list(range(62)) and sorted(a_samples[62:124]) == list(range(62))
    assert not np.array_equal(a_samples[:62], a_samples[62:124])
    assert data.epochs(steps, B) == pytest.approx([0.7 * steps * B / 62, 0.3 * steps * B / 28], abs=1 / 28)
    # the rows come from each source's own train.bin
    x, _ = data.rows(data.offsets(3, B))
    w = data.locate(3, B)
    streams = [np.fromfile(f / "train.bin", dtype=np.uint16) for f in (a, b)]
    assert x.tolist() == [streams[d][s : s + T].tolist() for d, s in zip(w.source, w.start)]
    # validation: each source alone
    val = TokenBatches(load_tokens(cfg), cfg, "val")
    assert [name for name, _ in val.per_source()] == ["a", "b"]


def test_blends_of_three_and_four_sources_stay_within_two_samples(tiny):
    for weights in ([0.5, 0.3, 0.2], [1 / 2, 1 / 3, 1 / 6], [0.6, 0.25, 0.1, 0.05]):
        blend = Blend(weights)
        source, within = blend.assign(np.arange(50_000))
        counts = np.vstack([np.zeros(len(weights), int), np.cumsum(np.eye(len(weights), dtype=int)[source], axis=0)])
        for d in range(len(weights)):  # positions within a source run 0, 1, 2, ...
            assert (within[source == d] == np.arange((source == d).sum())).all()
        assert (counts[-1] == blend.counts(50_000)).all()
        for L in (1, 7, 20, 333, 4096):
            window = counts[L:] - counts[:-L]
            err = np.abs(window - np.array(weights) * L)
            assert err.max() <= 2 and err[:, 0].max() < 1, (weights, L, err.max(axis=0))


def test_doc_ids_number_the_documents_of_each_row(tiny, tmp_path):
    folder = write_prepared(tmp_path / "d", [5, 40, 3, 3, 60, 10, 20, 7, 30, 2, 50], [40] * 3)
    cfg = config(tiny, f"data.source={folder}", "model.block_size=16")
    data = TokenBatches(load_tokens(cfg), cfg, "train", document_masking=True)
    index = np.fromfile(folder / "train.idx", dtype=np.int64)
    for k in range(3):
        offsets = data.offsets(k, G)
        x, y, ids = data.rows(offsets)
        assert ids.shape == x.shape == (G, 16) and ids.dtype == torch.int64
        doc = np.searchsorted(index, offsets[:, None] + np.arange(16), side="right") - 1  # per token, brute force
        assert ids.tolist() == (doc - doc[:, :1]).tolist()
    micro = data.rank_micro_batches(0, G, 3, 1, 2)
    assert all(len(mb) == 3 for mb in micro)
    assert doc_ids(np.array([0, 5]), np.array([5]), 4).tolist() == [[0, 0, 0, 0]]  # a row starting a document


def test_without_an_index_the_same_sampler_and_one_note(tiny, tmp_path):
    old = write_prepared(tmp_path / "old", [50] * 40, [40] * 4, index=False)
    cfg = config(tiny, f"data.source={old}")
    masked = TokenBatches(load_tokens(cfg), cfg, "train", document_masking=True)
    plain = TokenBatches(load_tokens(cfg), cfg, "train")
    assert not masked.with_doc_ids and plain.note is None
    assert masked.note.startswith(f"data.document_masking is off: {old / 'train.bin'} has no document index")
    assert "\n" not in masked.note and np.array_equal(masked.offsets(4, G), plain.offsets(4, G))
    assert len(masked.rank_micro_batches(0, G, 2, 0, 1)[0]) == 2
    text = TokenBatches(load_tokens(config(tiny)), config(tiny), "train", document_masking=True)  # builtin
    assert text.note is not None and sorted(np.concatenate([text.offsets(k, G) for k in range(2)]) % T) == [0] * 24


def test_bad_sources_are_one_line_errors(tiny, tmp_path):
    a = write_prepared(tmp_path / "a", [50] * 40, [40] * 4)
    other = write_prepared(tmp_path / "other", [50] * 40, [40] * 4, sha256="b" * 64)
    with pytest.raises(ConfigError, match=r"^data.sources\[1\].weight=0 \(.*\) must be a positive number"):
        config(tiny, f"data.sources=[{{path: {a}, weight: 1}}, {{path: {other}, weight: 0}}]")
    with pytest.raises(ConfigError, match=r"data.source=.* and data.sources are both set; give one"):
        config(tiny, f"data.source={a}", f"data.sources=[{{path: {a}, weight: 1}}]")
    mixed = config(tiny, f"data.sources=[{{path: {a}, weight: 1}}, {{path: {other}, weight: 1}}]")
    with pytest.raises(UserError, match=rf"^data.sources mixes tokenizers: {a} was prepared with {a}/tokenizer.json, "
                                        rf"{other} with {other}/tokenizer.json \(sha256 differs\)"):
        load_tokens(mixed)
    text = tmp_path / "t.txt"
    text.write_text("hello")
    with pytest.raises(UserError, match=rf"^data.sources\[1\].path {text} is not a zerodp prepare folder"):
        load_tokens(config(tiny, f"data.sources=[{{path: {a}, weight: 1}}, {{path: {text}, weight: 1}}]"))
    (a / "val.idx").unlink()
    with pytest.raises(UserError, match=r"val.idx, the document index .* is missing"):
        load_tokens(config(tiny, f"data.source={a}"))


def test_the_cli_refuses_a_bad_mixture_in_one_line(tiny, tmp_path):
    a = write_prepared(tmp_path / "a", [50] * 40, [40] * 4)
    for sources, said in ((f"[{{path: {a}, weight: -1}}]", "must be a positive number"),
                          (f"[{{path: {tmp_path}, weight: 1}}]", "is not a zerodp prepare folder")):
        r = zerodp_here("data", "stats", "configs/tiny.yaml", "model.vocab_size=256", f"data.sources={sources}")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr


def test_data_batch_and_stats_say_what_the_sampler_draws(tiny, tmp_path, capsys):
    from zerodp.cli.commands import main

    a = write_prepared(tmp_path / "a", [50] * 40, [40] * 4)
    b = write_prepared(tmp_path / "b", [30] * 30, [40] * 4)
    over = [*tiny, f"model.block_size={T}", "train.global_batch_size=12", "train.max_steps=100",
            f"data.sources=[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]"]
    assert main(["data", "batch", "configs/tiny.yaml", *over, "--step", "7", "--world", "2", "--micro", "3",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    cfg = load_config("configs/tiny.yaml", over)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    where = data.locate(7, 12)
    assert [r["sample"] for r in got["rows"]] == where.sample.tolist()
    assert [r["source"] for r in got["rows"]] == [["a", "b"][d] for d in where.source]
    assert [(r["rank"], r["micro"]) for r in got["rows"]] == [(j // 6, j % 6 // 3) for j in range(12)]
    assert all(r["tokens"] == [s * T, s * T + T + 1] for r, s in zip(got["rows"], where.sample))
    first = got["rows"][0]
    assert first["documents"] == [first["tokens"][0] // (50 if first["source"] == "a" else 30),
                                  (first["tokens"][1] - 1) // (50 if first["source"] == "a" else 30)]
    assert main(["data", "stats", "configs/tiny.yaml", *over, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["sources"]
    assert [(s["source"], s["documents"], s["tokens"], s["samples_per_epoch"]) for s in stats] == \
        [("a", 40, 2000, 62), ("b", 30, 900, 28)]
    assert stats[0]["epochs_at_max_steps"] == pytest.approx(0.75 * 1200 / 62, abs=1 / 62)
    assert stats[0]["weight"] == 0.75 and stats[1]["val_tokens"] == 160


def test_the_model_takes_the_micro_batch_with_doc_ids(tiny, tmp_path):
    """model(*micro_batch): with doc_ids the loss is the masked one (documents attend within themselves)."""
    from zerodp.models import build_model

    folder = write_prepared(tmp_path / "d", [5, 40, 3, 3, 60, 10, 20, 7, 30, 2, 50], [40] * 3)
    cfg = config(tiny, f"data.source={folder}", "model.block_size=16", "data.document_masking=true")
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    assert data.with_doc_ids and data.note is None
    batch = data.rank_micro_batches(0, G, 4, 0, 1)[0]
    assert len(batch) == 3 and int(batch[2].max()) > 0  # some row holds a document start
    model = build_model(cfg.model, cfg.train.seed)
    with torch.no_grad():
        masked, plain = model(*batch).item(), model(*batch[:2]).item()
        assert masked == pytest.approx(model(batch[0], batch[1], batch[2]).item()) and masked != plain
