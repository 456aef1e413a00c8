"""Keyed dropout (zerodp.models.dropout): a row's masks are a function of its key, the position, the
feature and the site alone, so a global batch run whole or as micro batches (any rank, any split) drops
the same units, with or without activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY
from tests.support.reference import LLAMA
from zerodp.config import load_config
from zerodp.data.batches import TokenBatches, load_tokens
from zerodp.models import build_model, dropout
from zerodp.models.dropout import keep_mask, keyed_dropout, mix32, row_keys, site_id


def test_a_rows_mask_does_not_depend_on_the_rows_beside_it():
    keys = row_keys(0, 3, range(4))
    alone = keep_mask(keys[2:3], torch.Size([1, 16, 24]), 0.3, 7)
    batch = keep_mask(keys, torch.Size([4, 16, 24]), 0.3, 7)
    assert torch.equal(alone[0], batch[2])
    reordered = keep_mask(keys.flip(0), torch.Size([4, 16, 24]), 0.3, 7)
    assert torch.equal(reordered[1], batch[2])
    # another row, site, step or seed: another mask
    assert not torch.equal(batch[1], batch[2])
    assert not torch.equal(keep_mask(keys, torch.Size([4, 16, 24]), 0.3, 8), batch)
    assert not torch.equal(row_keys(0, 4, range(4)), keys) and not torch.equal(row_keys(1, 3, range(4)), keys)
    assert site_id("model.layers.0.mlp.drop") != site_id("model.layers.1.mlp.drop")


def test_a_mask_hashed_in_slices_equals_the_whole(monkeypatch):
    keys = row_keys(3, 1, range(2))
    whole = keep_mask(keys, torch.Size([2, 5, 8, 8]), 0.2, 11)
    monkeypatch.setattr(dropout, "CHUNK", 2 * 2 * 8 * 8)  # two of the five slices at a time
    assert torch.equal(keep_mask(keys, torch.Size([2, 5, 8, 8]), 0.2, 11), whole)


def test_the_drop_rate_is_p_and_kept_values_are_scaled():
    x = torch.ones(8, 64, 64)
    for p in (0.05, 0.1, 0.5):
        y = keyed_dropout(x, p, row_keys(5, 0, range(8)), site_id("a"))
        dropped = (y == 0).float().mean().item()
        assert abs(dropped - p) < 0.01, (p, dropped)
        assert torch.allclose(y[y != 0], torch.full((), 1 / (1 - p)))
    assert keyed_dropout(x, 0.0, row_keys(5, 0, range(8)), 1) is x


def test_the_hash_is_exact_32_bit_arithmetic():
    # lowbias32 of known inputs (computed with unsigned 32-bit integers)
    def reference(v: int) -> int:
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    values = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF]
    assert mix32(torch.tensor(values)).tolist() == [reference(v) for v in values]


def _config(extra: list[str]):
    over = [o for o in TINY if not o.startswith(("train.global_batch_size", "train.micro_batch_size"))]
    return load_config(None, over + ["train.global_batch_size=4", "train.micro_batch_size=2"] + extra)


CASES = {
    "gpt2": ["model.dropout=0.2"],
    "llama": LLAMA + ["model.dropout=0.2"],
    "gpt2 full recompute": ["model.dropout=0.2", "model.activation_checkpointing=full"],
    "llama selective recompute": LLAMA + ["model.dropout=0.2", "model.activation_checkpointing=selective"],
    "llama lora": LLAMA + ["model.lora.rank=4", "model.lora.dropout=0.3"],
}


@pytest.mark.parametrize("case", CASES)
def test_a_global_batch_whole_equals_its_micro_batches(case):
    """The loss and gradients of 4 rows in one forward equal the mean of two micro batches of 2 (the
    rows a world of 2 or 2 accumulation steps run), dropout on; and differ from no dropout."""
    cfg = _config(CASES[case])
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    model = build_model(cfg.model, cfg.train.seed)
    with torch.no_grad():  # adapters that change the output (B starts at 0), so that their dropout shows
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    model.train()
    whole = model(*data.rows(data.offsets(1, 4)), dropout_keys=data.dropout_keys(1, range(4)))
    whole.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    parts = []
    for rank in (0, 1):
        micro = data.rank_micro_batches(1, 4, 2, rank, 2)
        loss = model(*micro[0], dropout_keys=micro.dropout_keys[0]) / 2
        loss.backward()
        parts.append(loss.item())
    assert abs(sum(parts) - whole.item()) < 1e-6, (parts, whole.item())
    for n, g in want.items():
        assert torch.allclose(model.get_parameter(n).grad, g, atol=1e-6), n
    model.eval()
    with torch.no_grad():
        plain = model(*data.rows(data.offsets(1, 4)))
    assert abs(plain.item() - whole.item()) > 1e-4  # dropout did act


def test_recomputation_drops_what_the_forward_dropped():
    """Activation checkpointing reruns each block in the backward: the same masks, the same gradients."""
    grads = {}
    for mode in ("off", "full"):
        cfg = _config(["model.dropout=0.2", f"model.activation_checkpointing={mode}"])
        data = TokenBatches(load_tokens(cfg), cfg, "train")
        model = build_model(cfg.model, cfg.train.seed)
        model(*data.rows(data.offsets(0, 4)), dropout_keys=data.dropout_keys(0, range(4))).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for n, g in grads["off"].items():
        assert torch.allclose(grads["full"][n], g, atol=1e-6), n


def test_batches_carry_keys_only_when_the_model_drops():
    assert TokenBatches(load_tokens(_config([])), _config([]), "train").rank_micro_batches(0, 4, 2, 0, 1) \
        .dropout_keys is None
    cfg = _config(["model.dropout=0.1"])
    assert TokenBatches(load_tokens(cfg), cfg, "val").dropout_seed is None  # evaluation drops nothing
    micro = TokenBatches(load_tokens(cfg), cfg, "train").rank_micro_batches(2, 4, 1, 1, 2)
    assert [k.tolist() for k in micro.dropout_keys] == [row_keys(cfg.train.seed, 2, [r]).tolist() for r in (2, 3)]
