"""The GPT model: GPT-2's exact parameter count, meta-device build, activation checkpointing."""

from __future__ import annotations

import torch

from zerodp.config import ModelConfig
from zerodp.models import GPT, flops_per_token, param_count

GPT2 = ModelConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024, bias=True)


def test_gpt2_parameter_count_from_config_and_module():
    assert param_count(GPT2) == 124_439_808  # Hugging Face `gpt2`
    with torch.device("meta"):
        model = GPT(GPT2)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    assert model.lm_head.weight is model.transformer.wte.weight


def test_gpt2_medium_and_no_bias_counts():
    medium = ModelConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=50257, block_size=1024)
    assert param_count(medium) == 354_823_168
    nobias = ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=32, bias=False)
    assert param_count(nobias) == sum(p.numel() for p in GPT(nobias).parameters())


def test_flops_per_token_six_per_parameter_plus_attention():
    # 6 x (all parameters but the position table) + 12 x layers x context x width (PaLM, appendix B)
    assert flops_per_token(GPT2) == 6 * (124_439_808 - 1024 * 768) + 12 * 12 * 1024 * 768 == 855_166_464


def test_activation_checkpointing_gives_the_same_gradients():
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)
    x = torch.randint(0, 256, (3, 16))
    grads = []
    for ac in (False, True):
        cfg.activation_checkpointing = ac
        torch.manual_seed(0)
        model = GPT(cfg)
        model(x, x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=1e-6)


def test_init_is_deterministic_and_gpt2_style():
    cfg = ModelConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=256, block_size=16)
    torch.manual_seed(3)
    a = GPT(cfg)
    torch.manual_seed(3)
    b = GPT(cfg)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    proj = a.transformer.h[0].attn.c_proj.weight
    assert abs(proj.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.003
