"""Rank functions of tests/distributed/test_document_mask.py, run by tests.support.harness.run_distributed."""

from __future__ import annotations

import torch

from zerodp.models import build_model


def batch(rank: int, block_size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's micro batch of 2 packed rows (x, y, doc_ids): 3 documents a row, lengths by rank."""
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randint(0, vocab, (2, block_size + 1), generator=g)
    cut = sorted(torch.randperm(block_size - 2, generator=g)[:2].add(1).tolist())
    lengths = torch.tensor([cut[0], cut[1] - cut[0], block_size - cut[1]])
    doc_ids = torch.repeat_interleave(torch.arange(3), lengths)[None].expand(2, block_size).contiguous()
    return x[:, :-1], x[:, 1:], doc_ids


def cuda_kernels(block_size: int = 256) -> dict:
    """On this rank's GPU, llama with grouped-query heads in fp32 (TF32 off): per kernel (flex, sdpa) the
    masked loss and gradients of a second step (the first compiles), run with CUDA's sync debug mode set
    to error (a host sync raises), and the largest |packed - alone| logit over the documents."""
    import dataclasses

    from zerodp.config import ModelConfig

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128,
                      vocab_size=256, block_size=block_size)
    x, y, doc_ids = (t.to(device) for t in batch(0, block_size, 256))
    out = {}
    for kind in ("flex", "sdpa"):
        model = build_model(dataclasses.replace(cfg, document_attention=kind), seed=0, device=device)
        model(x, y, doc_ids).backward()
        model.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(x, y, doc_ids)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        with torch.no_grad():
            packed, worst, start = model(x, None, doc_ids), 0.0, 0
            for n in torch.unique_consecutive(doc_ids[0], return_counts=True)[1].tolist():
                alone = model(x[:1, start : start + n])[0]
                worst = max(worst, (packed[0, start : start + n] - alone).abs().max().item())
                start += n
        out[kind] = {"loss": loss.item(), "grads": [p.grad.cpu() for p in model.parameters()], "worst": worst}
    return out
