"""The chunked loss (zerodp.models.loss, model.loss_chunks): the LM head and cross-entropy over chunks of the
tokens give the whole logits' loss and gradients within fp32 rounding (1e-6 relative), with a loss mask
(IGNORE_INDEX) and document masking, for a tied (gpt2) and an untied (llama) head; evaluation computes no
gradient; no (N, V) tensor is kept for the backward; model.loss_chunks=auto chunks only where it pays."""

from __future__ import annotations

import pytest
import torch

from zerodp.config import ModelConfig
from zerodp.models import build_model
from zerodp.models.chunking import AUTO_CHUNK_LOGITS, loss_chunks
from zerodp.models.loss import IGNORE_INDEX

B, T, V = 3, 16, 300
SHAPES = {"gpt2": dict(arch="gpt2", n_layer=2, n_head=2, n_embd=32, vocab_size=V, block_size=T),
          "llama": dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64,
                        vocab_size=V, block_size=T, tie_embeddings=False)}


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, :5] = IGNORE_INDEX  # a loss mask: no target there
    y[2, 3:11] = IGNORE_INDEX
    doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 16, [0] * 3 + [1] * 4 + [2] * 9])
    return x, y, doc_ids


def loss_and_grads(family: str, chunks, *inputs, **extra):
    model = build_model(ModelConfig(**SHAPES[family], loss_chunks=chunks, **extra), seed=0).train()
    loss = model(*inputs)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("chunks", [1, 5, 48])
def test_chunked_loss_and_gradients_equal_the_whole_logits(family, chunks):
    x, y, doc_ids = batch()
    for inputs in ((x, y), (x, y, doc_ids)):
        whole, wg = loss_and_grads(family, 0, *inputs)
        loss, g = loss_and_grads(family, chunks, *inputs)
        assert loss == pytest.approx(whole, rel=1e-6)
        for n in wg:
            assert g[n].abs().max() > 0, n
            torch.testing.assert_close(g[n], wg[n], rtol=1e-6, atol=1e-6 * wg[n].abs().max().item(), msg=n)


def test_chunked_loss_under_bf16_autocast_matches_the_whole_logits():
    x, y, _ = batch(1)
    got = []
    for chunks in (0, 4):
        model = build_model(ModelConfig(**SHAPES["llama"], loss_chunks=chunks), seed=0).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        got.append((loss.item(), model.lm_head.weight.grad.clone(), model.model.embed_tokens.weight.grad.clone()))
    assert got[1][0] == pytest.approx(got[0][0], rel=1e-3)
    for a, b in zip(got[0][1:], got[1][1:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * a.abs().max().item())


def test_a_micro_batch_without_targets_adds_zero_and_no_gradient():
    x, y, _ = batch()
    y[:] = IGNORE_INDEX
    loss, g = loss_and_grads("llama", 4, x, y)
    assert loss == 0.0 and all(t.abs().max() == 0 for t in g.values())


def test_evaluation_and_generation_with_the_chunked_head():
    x, y, _ = batch()
    whole = build_model(ModelConfig(**SHAPES["gpt2"], loss_chunks=0), seed=0).eval()
    chunked = build_model(ModelConfig(**SHAPES["gpt2"], loss_chunks=4), seed=0).eval()
    with torch.no_grad():
        assert chunked(x, y).item() == pytest.approx(whole(x, y).item(), rel=1e-6)
        assert torch.equal(chunked(x), whole(x))  # the logits (B, T, V) without targets
    assert chunked.lm_head.weight.grad is None
    torch.manual_seed(0)
    a = whole.generate(x[:, :4], 5)
    torch.manual_seed(0)
    assert torch.equal(chunked.generate(x[:, :4], 5), a)


def test_no_tensor_of_the_whole_logits_is_kept_for_the_backward():
    x, y, _ = batch()
    for chunks, kept in ((0, True), (4, False)):
        model = build_model(ModelConfig(**SHAPES["llama"], loss_chunks=chunks), seed=0).train()
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            model(x, y)
        assert (max(sizes) >= B * T * V) == kept, (chunks, max(sizes))


def test_auto_chunks_only_where_the_logits_outweigh_the_weight_gradient():
    assert loss_chunks("auto", 4 * 2048, 128256, 2048) == 16  # Llama 3.2 1B at micro 4: 1.05e9 logits
    assert loss_chunks("auto", 8 * 128, 256, 128) == 0  # a tiny model: the whole logits
    assert loss_chunks("auto", 512, 128256, 2048) == 0  # fewer tokens than 2 x hidden
    assert loss_chunks("auto", 8192, AUTO_CHUNK_LOGITS // 8192, 64) == 0
    assert loss_chunks(3, 100, 10, 10) == 3 and loss_chunks(500, 100, 10, 10) == 100 and loss_chunks(0, 9, 9, 9) == 0
