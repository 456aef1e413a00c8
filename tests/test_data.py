"""Data: the global batch of step k is a pure function of (seed, k), whatever the world size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zerodp.config import load_config
from zerodp.data import TokenBatches, load_tokens, prefetch
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
