"""The replica check's verdict and hash (zerodp.resilience.replicas), without processes."""

from __future__ import annotations

import torch

from zerodp.resilience.replicas import bits_hash, odd_ones, odd_ones_in


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


def test_hsdp_compares_each_shard_with_its_copies_in_the_other_replica_groups():
    # 3 replica groups of 2 shards: ranks 0, 2, 4 hold shard A (hashes 10, 20), ranks 1, 3, 5 shard B (30, 40);
    # column 0 is the data order, the same on every rank
    table = [[7, 10, 20], [7, 30, 40]] * 3
    groups = [[0, 2, 4], [1, 3, 5]]  # the columns of the (replicate, shard) mesh
    assert odd_ones_in(table, groups) == ([], [], False)
    table[3] = [7, 30, 41]  # rank 3's copy of shard B
    assert odd_ones_in(table, groups) == ([3], [2], False)
    table[4] = [8, 10, 20]  # rank 4's data order: compared across every rank
    assert odd_ones_in(table, groups) == ([3, 4], [0, 2], False)
    assert odd_ones([[7, 10, 20], [7, 30, 40]] * 3)[2]  # the whole table as one group: no majority, wrong
