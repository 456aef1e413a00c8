"""Replica checks (zerodp.resilience.replicas) with a real fault: one bit of one weight flipped on one
rank of three, in the middle of a ddp run, of a zero2 run and of an HSDP run (fsdp with
strategy.hybrid_shard, three replica groups of one rank: each holds its own copy of the shards). The
check after it names that rank and the step, the run stops before the next checkpoint (exit code 1's
PeerFailure), `latest` stays the checkpoint from before the flip, and the step's metrics record says
what was found. Under zero3 and fsdp, whose shards no two ranks share, the bit is flipped in one
rank's gathered copy of a weight in the forwards after step 5 (the shard stays right): the check
before the save of step 6 names that rank and the gathered weight, and `latest` stays step 4."""

from __future__ import annotations

import pytest

from tests.support.harness import run_distributed

FLIPPED_RANK, AFTER_STEP = 1, 4  # zero2 heals a flip in its working weights at the next step: flip after a checked one
STRATEGIES = {"ddp": ["strategy.name=ddp"], "zero2": ["strategy.name=zero2"],
              "hsdp": ["strategy.name=fsdp", "strategy.hybrid_shard=true", "strategy.shard_group_size=1"]}


@pytest.fixture(scope="module")
def launched(tiny, tmp_path_factory):
    """Both flipped-bit launches below, one after the other on the same 3 fresh ranks (each puts the loop
    back after its runs): (runs with a flip in the weights, runs with a flip in a gathered copy)."""
    tmp = tmp_path_factory.mktemp("replicas")
    runs = [{"overrides": tiny + strategy + ["train.max_steps=6", "train.log_every=1",
                                             "train.check_replicas_every=4", "checkpoint.every=2",
                                             "checkpoint.keep_last=5", f"train.out_dir={tmp / name}"]}
            for name, strategy in STRATEGIES.items()]
    gathered = [{"overrides": tiny + [f"strategy.name={name}", "train.max_steps=6", "train.log_every=1",
                                      "train.check_replicas_every=4", "checkpoint.every=2", "checkpoint.keep_last=5",
                                      f"train.out_dir={tmp / 'gathered' / name}"], "gathered": True}
                for name in ("zero3", "fsdp")]
    calls = [{"target": "tests.support.replica_workers:flip_one_bit",
              "kwargs": {"runs": runs, "rank": FLIPPED_RANK, "after_step": AFTER_STEP}},
             {"target": "tests.support.replica_workers:flip_one_bit",
              "kwargs": {"runs": gathered, "rank": FLIPPED_RANK, "after_step": 5}}]
    return run_distributed("tests.support.workers:several", 3, {"calls": calls}, fresh=True)[0]


@pytest.fixture(scope="module")
def flipped(launched):
    return dict(zip(STRATEGIES, launched[0]))


@pytest.fixture(scope="module")
def gathered(launched):
    return dict(zip(("zero3", "fsdp"), launched[1]))


@pytest.fixture(scope="module")
def tiny():
    from tests.conftest import TINY

    return list(TINY) + ["train.global_batch_size=6"]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_flipped_bit_is_named_and_nothing_after_it_is_saved(flipped, name):
    got = flipped[name]
    # checks after step 1 (the first sync point), 2 (a save), then 4: the save of step 4 is never written
    assert got["error"] is not None and "replica check after step 4 (they agreed after step 2)" in got["error"], got
    assert f"rank {FLIPPED_RANK} on " in got["error"] and "rank 0 on" not in got["error"], got["error"]
    assert "param/" in got["error"], got["error"]
    assert got["latest"] == "step_00000002" and got["published"] == ["step_00000002"], got
    assert got["last_step"] == 4, got
    [record] = got["mismatches"]
    m = record["replica_mismatch"]
    assert record["step"] == 4 and m["ranks"] == [FLIPPED_RANK] and not m["no_majority"], m
    assert any(t.startswith("param/") for t in m["tensors"]), m


@pytest.mark.parametrize("name", ["zero3", "fsdp"])
def test_a_flipped_bit_in_a_gathered_copy_is_named_before_the_save(gathered, name):
    got = gathered[name]
    # checks after step 1, 2 and 4 (saves) agree; the forwards of step 6 gather the flipped copy on rank 1
    assert got["error"] is not None and "replica check after step 6 (they agreed after step 4)" in got["error"], got
    assert f"rank {FLIPPED_RANK} on " in got["error"] and "rank 0 on" not in got["error"], got["error"]
    assert "gathered/" in got["error"], got["error"]
    assert got["latest"] == "step_00000004" and got["published"] == ["step_00000002", "step_00000004"], got
    [record] = got["mismatches"]
    m = record["replica_mismatch"]
    assert record["step"] == 6 and m["ranks"] == [FLIPPED_RANK] and not m["no_majority"], m
    assert all(t.startswith("gathered/") for t in m["tensors"]), m
