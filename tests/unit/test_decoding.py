"""Generation with a key/value cache and grouped-query attention through SDPA's enable_gqa, on the CPU:
the cached decode gives the tokens the full re-forward gives (greedy), its logits agree, and each token
after the prompt runs one position through the blocks; Llama/Qwen3 attention with fewer kv heads gives
the logits that repeating the kv heads gives, without repeating them. Through every strategy on 2
ranks, against DecoderLM.generate: tests/distributed/test_sample.py."""

from __future__ import annotations

import pytest
import torch

import zerodp.models.llama.model as llama_model
from zerodp.config import load_config
from zerodp.distributed.process_group import DistEnv
from zerodp.models import build_model
from zerodp.models.common import KVCache
from zerodp.strategies import RunContext, make_strategy
from zerodp.trainer.sample import generate_tokens

FAMILIES = {
    "gpt2": [],
    "llama": ["model.arch=llama", "model.n_head=4", "model.n_kv_head=2"],
    "qwen3": ["model.arch=qwen3", "model.n_head=4", "model.n_kv_head=1"],
}


def _single(tiny, extra):
    cfg = load_config(None, tiny + ["model.n_embd=64", "model.block_size=32", "train.seed=3", *extra])
    device = torch.device("cpu")
    strategy = make_strategy("single")
    strategy.setup(build_model(cfg.model, device="meta"), RunContext(cfg, 0, 1, 0, device, 1, 1))
    env = DistEnv(0, 1, 0, device, "localhost", ["localhost"])
    return cfg, env, strategy


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_greedy_decode_gives_the_full_re_forward_tokens(tiny, family):
    """40 new tokens with block_size 32: the cache carries the first 28, then the sequence outgrows the
    context and each token re-runs the last 32 without a cache, as the reference does throughout. Each
    cached token is one position through the model: counted at the embedding."""
    cfg, env, strategy = _single(tiny, FAMILIES[family])
    positions = []
    embed = strategy.model.embed
    strategy.model.embed = lambda idx, start=0: positions.append(idx.shape[1]) or embed(idx, start)
    cached = generate_tokens(strategy, cfg, env, 40, temperature=0)
    counted, positions[:] = list(positions), []
    plain = generate_tokens(strategy, cfg, env, 40, temperature=0, cache=False)
    assert cached == plain and len(cached) == 4 + 40
    # the 4-token prompt once, then one position per token until the sequence is 32 long, then 32 each
    assert counted == [4] + [1] * 28 + [32] * 11
    assert positions == [min(n, 32) for n in range(4, 44)]
    assert strategy.model.training  # the train/eval mode is restored


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_logits_agree_with_the_full_forward(tiny, family):
    cfg, _, strategy = _single(tiny, FAMILIES[family])
    model = strategy.model.eval()
    idx = torch.randint(0, cfg.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        kv = KVCache(cfg.model.n_layer)
        steps = [model(idx[:, :12], cache=kv)] + [model(idx[:, t:t + 1], cache=kv) for t in range(12, 20)]
    got = torch.cat(steps, dim=1)
    assert kv.pos == 20 and got.shape == full.shape
    assert (got - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_query_attention_without_repeating_kv_heads(tiny, family, monkeypatch):
    """SDPA's enable_gqa on the CPU: no repeat_interleave, the same logits (1e-6) as repeating the kv
    heads (what native_gqa chooses for fp32 CUDA tensors)."""
    cfg, _, strategy = _single(tiny, FAMILIES[family])
    model = strategy.model.eval()
    idx = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    repeats = []
    real = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: repeats.append(1) or real(*a, **k))
    with torch.no_grad():
        native = model(idx)
        assert repeats == []
        monkeypatch.setattr(llama_model, "native_gqa", lambda q: False)
        repeated = model(idx)
    assert len(repeats) == 2 * cfg.model.n_layer  # k and v of every block
    assert (native - repeated).abs().max().item() < 1e-6


def test_native_gqa_on_the_cpu_in_every_dtype():
    cpu = torch.empty(1, 4, 2, 8)
    assert llama_model.native_gqa(cpu) and llama_model.native_gqa(cpu.bfloat16())
