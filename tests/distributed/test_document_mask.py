"""Document masking on a GPU: flex attention (compiled) computes the SDPA mask's numbers, without a host
sync. On the CPU: the per-family numbers are tests/unit/test_document_mask.py's, and every strategy at
world 2 and 3 follows one process with data.document_masking on in tests/distributed/test_equivalence.py
(DDP, the DeepSpeed engine and FSDP pass `strategy.model(x, y, doc_ids)`'s third argument through)."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_distributed


@pytest.mark.gpu(1)
def test_on_cuda_flex_attention_computes_the_masks_numbers_without_a_host_sync():
    got = run_distributed("tests.support.docmask_workers:cuda_kernels", 1, device="cuda")[0]
    for kind in ("flex", "sdpa"):
        assert got[kind]["worst"] <= 1e-4, (kind, got[kind]["worst"])
    assert abs(got["flex"]["loss"] - got["sdpa"]["loss"]) <= 1e-5
    for a, b in zip(got["flex"]["grads"], got["sdpa"]["grads"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)
