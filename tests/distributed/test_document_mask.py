"""Document masking through every strategy's wrapper (zerodp.models.docmask): DDP, the DeepSpeed engine
(zero2, zero3; zero1 is the same engine) and FSDP pass `strategy.model(x, y, doc_ids)`'s third argument to
the model as it is, so each computes the unwrapped model's masked loss, and one step gives every strategy
the same weights, which differ from an unmasked step's. One launch of two ranks for all of them; the
per-family numbers: tests/unit/test_document_mask.py. On a GPU machine: flex attention (compiled) against
the SDPA mask, without a host sync."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY
from tests.support.harness import run_distributed
from tests.support.reference import WEIGHT_TOLERANCE

STRATEGIES = ["ddp", "zero2", "zero3", "fsdp"]
LLAMA = ["model.arch=llama", "model.n_head=4", "model.n_kv_head=2", "model.intermediate_size=64"]


def test_every_strategy_passes_doc_ids_to_the_model():
    cases = [(name, True) for name in STRATEGIES] + [("ddp", False)]
    ranks = run_distributed("tests.support.docmask_workers:one_step", 2, {"overrides": TINY + LLAMA, "cases": cases})
    for rank in ranks:
        for (name, _), got in zip(cases, rank):
            assert abs(got["loss"] - got["alone"]) <= 1e-6, name
    ref = ranks[0][0]["weights"]
    for (name, _), got in zip(cases[1:-1], ranks[0][1:-1]):
        worst = max((got["weights"][k] - ref[k]).abs().max().item() for k in ref)
        assert worst <= WEIGHT_TOLERANCE, (name, worst)
    plain = ranks[0][-1]["weights"]
    assert max((plain[k] - ref[k]).abs().max().item() for k in ref) > 1e-3  # the mask changed the step
    assert all(abs(rank[-1]["loss"] - rank[0]["loss"]) > 1e-4 for rank in ranks)


@pytest.mark.gpu(1)
def test_on_cuda_flex_attention_computes_the_masks_numbers_without_a_host_sync():
    got = run_distributed("tests.support.docmask_workers:cuda_kernels", 1, device="cuda")[0]
    for kind in ("flex", "sdpa"):
        assert got[kind]["worst"] <= 1e-4, (kind, got[kind]["worst"])
    assert abs(got["flex"]["loss"] - got["sdpa"]["loss"]) <= 1e-5
    for a, b in zip(got["flex"]["grads"], got["sdpa"]["grads"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
