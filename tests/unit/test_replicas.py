"""The replica check's verdict and hash (zerodp.resilience.replicas), without processes."""

from __future__ import annotations

import torch

from zerodp.resilience.replicas import bits_hash, odd_ones


def test_any_single_flipped_bit_changes_the_hash():
    for dtype, width in ((torch.float32, 32), (torch.bfloat16, 16)):
        t = torch.randn(1000).to(dtype)
        before = bits_hash(t).item()
        for bit in range(width):
            flipped = t.clone()
            flipped.view(-1)[123:124].view(getattr(torch, f"int{width}")).bitwise_xor_(1 << bit)
            assert bits_hash(flipped).item() != before, (dtype, bit)


def test_the_odd_rank_out_is_named_and_a_tie_names_both():
    assert odd_ones([[1, 2], [1, 2], [1, 2]]) == ([], [], False)
    assert odd_ones([[1, 2], [1, 3], [1, 2]]) == ([1], [1], False)
    assert odd_ones([[9, 2], [1, 2], [1, 2]]) == ([0], [0], False)  # rank 0 can be the odd one
    assert odd_ones([[1, 2], [1, 3]]) == ([0, 1], [1], True)  # two ranks: no majority
