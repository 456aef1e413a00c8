"""Data: the global batch of step k is a pure function of (seed, k), whatever the world size."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from zerodp.config import load_config
from zerodp.data.batches import TokenBatches, load_tokens, pin_batches, prefetch
from zerodp.errors import UserError


def test_rank_slices_concatenate_to_the_same_global_batch(tiny):
    cfg = load_config(None, tiny)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    G = cfg.train.global_batch_size
    full_x, full_y = data.rows(data.offsets(5, G))
    for world in (1, 2, 3, 6):
        parts = [mb for r in range(world) for mb in data.rank_micro_batches(5, G, 2, r, world)]
        assert torch.equal(torch.cat([x for x, _ in parts]), full_x)
        assert torch.equal(torch.cat([y for _, y in parts]), full_y)
    assert torch.equal(full_x[:, 1:], full_y[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(data.rows(data.offsets(6, G))[0], full_x)


def test_builtin_corpus_is_python_source(tiny):
    cfg = load_config(None, tiny)
    tokens = load_tokens(cfg)
    assert len(tokens) == cfg.data.max_bytes
    text = bytes(np.asarray(tokens[:2000], dtype=np.uint8)).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_text_folder_and_bin_file(tmp_path, tiny):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world " * 500)
    cfg = load_config(None, tiny + [f"data.source={tmp_path / 'docs'}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert bytes(np.asarray(load_tokens(cfg)[:5], dtype=np.uint8)) == b"hello"
    ids = np.arange(5000, dtype=np.uint32) % 1000
    ids.tofile(tmp_path / "train.bin")
    cfg = load_config(None, tiny + [f"data.source={tmp_path / 'train.bin'}", "data.token_dtype=uint32",
                                    "model.vocab_size=1000"])
    assert np.array_equal(load_tokens(cfg)[:5], ids[:5])
    small = load_config(None, tiny + [f"data.source={tmp_path / 'train.bin'}", "data.token_dtype=uint32",
                                      "model.vocab_size=512"])
    with pytest.raises(UserError, match=r"holds token id 999 >= model.vocab_size=512; raise model.vocab_size"):
        load_tokens(small)


def test_prefetch_yields_the_same_batches_as_direct_calls(tiny):
    cfg = load_config(None, tiny)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    got = list(prefetch(data, range(3, 7), cfg, rank=1, world=2, depth=2))
    assert [s for s, _ in got] == [3, 4, 5, 6]
    for s, mbs in got:
        want = data.rank_micro_batches(s, cfg.train.global_batch_size, cfg.train.micro_batch_size, 1, 2)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(mbs, want))


def test_batches_are_pinned_for_a_cuda_device_only(tiny):
    """The prefetch thread pins what it hands over only for CUDA; CPU batches are the plain tensors a
    direct call gives (same values, same dtype, not pinned). For a CUDA device the thread calls
    pin_memory: on this CPU-only machine torch refuses, and the refusal reaches the training thread
    (on a GPU the batches arrive pinned: tests/distributed/test_speed_gpu.py)."""
    assert pin_batches(torch.device("cuda", 0)) and pin_batches("cuda")
    assert not pin_batches(torch.device("cpu")) and not pin_batches(None)
    cfg = load_config(None, tiny)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    for device in (torch.device("cpu"), None):
        got = list(prefetch(data, range(2), cfg, rank=0, world=1, depth=2, device=device))
        for s, mbs in got:
            want = data.rank_micro_batches(s, cfg.train.global_batch_size, cfg.train.micro_batch_size, 0, 1)
            for (x, y), (wx, wy) in zip(mbs, want, strict=True):
                assert torch.equal(x, wx) and torch.equal(y, wy) and x.dtype == torch.int64
                assert not x.is_pinned() and not y.is_pinned()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="accelerator"):
            list(prefetch(data, range(2), cfg, rank=0, world=1, depth=2, device=torch.device("cuda")))


def test_a_users_text_is_read_whole_and_what_was_read_is_said(tmp_path, tiny, capsys):
    """data.max_bytes (200,000 in `tiny`) bounds the built-in corpus only: a user's text is never cut."""
    big = tmp_path / "big.txt"
    big.write_bytes(bytes(range(32, 127)) * 3158 + b"the end")  # 300,017 bytes
    cfg = load_config(None, tiny + [f"data.source={big}", f"data.cache_dir={tmp_path / 'cache'}"])
    tokens = load_tokens(cfg)
    assert len(tokens) == 300_017 and bytes(np.asarray(tokens[-7:], dtype=np.uint8)) == b"the end"
    said = f"zerodp: data.source={big}: read 1 file, 300,017 bytes -> 300,017 byte-level tokens"
    assert capsys.readouterr().err == said + "\n"
    load_tokens(cfg)
    assert capsys.readouterr().err == said + " (cached)\n"

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"a" * 150_000)
    (folder / "b.md").write_bytes(b"b" * 100_001)
    (folder / "empty.txt").write_bytes(b"")
    cfg = load_config(None, tiny + [f"data.source={folder}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert len(load_tokens(cfg)) == 250_001
    assert capsys.readouterr().err == (f"zerodp: data.source={folder}: read 2 of 3 files, 250,001 bytes -> "
                                       f"250,001 byte-level tokens\n")


def test_the_builtin_corpus_stops_at_max_bytes_and_says_so(tmp_path, tiny, capsys):
    cfg = load_config(None, tiny + ["data.max_bytes=150000", f"data.cache_dir={tmp_path}"])
    assert len(load_tokens(cfg)) == 150_000
    err = capsys.readouterr().err
    assert re.fullmatch(r"zerodp: data\.source=builtin: read \d+ of \d+ files, 150,000 bytes -> 150,000 byte-level "
                        r"tokens \(the built-in corpus stops at data\.max_bytes=150,000\)\n", err), err


def test_only_rank_0_says_what_was_read(tmp_path, tiny, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    cfg = load_config(None, tiny + [f"data.source={tmp_path / 'a.txt'}", f"data.cache_dir={tmp_path / 'cache'}"])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    assert len(load_tokens(cfg)) == 1200
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    load_tokens(cfg)
    assert "read 1 file, 1,200 bytes -> 1,200 byte-level tokens" in capsys.readouterr().err
