"""`zerodp verify` on 2 processes (the launcher's: both runs train in one process group): ddp against
fsdp follows one trajectory (exit 0); another seed or another lr does not (exit 1), and the line names
the first step that differs: step 1 for a seed (other weights, other batches), step 2 for an lr (the
first loss is taken before the first update). The temporary runs are removed."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from tests.support.harness import run_distributed

SMALL = [o for o in TINY if not o.startswith("train.global_batch_size")] + ["train.global_batch_size=4"]


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify")
    cases = {"fsdp": "strategy.name=fsdp", "seed": "train.seed=7", "lr": "optim.lr=5e-3"}
    calls = [["configs/tiny.yaml", *SMALL, "strategy.name=ddp", f"train.out_dir={tmp / name / 'run'}",
              "--against", change, "--steps", "3"] for name, change in cases.items()]
    results = run_distributed("tests.support.verify_workers:verify", 2, {"calls": calls})
    return tmp, dict(zip(cases, results[0])), dict(zip(cases, results[1]))


def test_ddp_against_fsdp_passes(verified):
    tmp, rank0, rank1 = verified
    got = rank0["fsdp"]
    assert got["code"] == 0 and rank1["fsdp"]["code"] == 0, got["stdout"]
    assert "PASS: 3 steps and" in got["stdout"], got["stdout"]
    assert "fp32: the equivalence suite's 1e-5" in got["stdout"]
    assert list((tmp / "fsdp").iterdir()) == [], "verify left its runs behind"


@pytest.mark.parametrize("case, first", [("seed", 1), ("lr", 2)])
def test_a_real_change_fails_naming_the_first_step(verified, case, first):
    _, rank0, _ = verified
    got = rank0[case]
    assert got["code"] == 1, got["stdout"]
    assert f"FAIL: the first differing step is {first} " in got["stdout"], got["stdout"]
    assert "tensors differ, most: " in got["stdout"], got["stdout"]
