"""The models: each builds exactly the parameters its Arch describes; GPT-2's exact parameter count,
meta-device build, activation checkpointing; families zerodp only plans are refused."""

from __future__ import annotations

import pytest
import torch

from zerodp.config import ModelConfig
from zerodp.errors import ConfigError
from zerodp.models import GPT, arch_of, build_model, flops_per_token, param_count
from zerodp.models.arch import PLANNER_FAMILIES

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
    """off, full (true) and selective (the matmul and attention outputs kept, the rest recomputed)."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)
    x = torch.randint(0, 256, (3, 16))
    grads = []
    for ac in (False, True, "selective"):
        cfg.activation_checkpointing = ac
        model = build_model(cfg, seed=0)
        model(x, x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        for other in grads[1:]:
            torch.testing.assert_close(grads[0][n], other[n], rtol=0, atol=1e-6)


def test_init_is_deterministic_and_gpt2_style():
    cfg = ModelConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=256, block_size=16)
    a = build_model(cfg, seed=3)
    b = build_model(cfg, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    proj = a.transformer.h[0].attn.c_proj.weight
    assert abs(proj.std().item() - 0.02 / (2 * 4) ** 0.5) < 0.003


SHAPE_CONFIGS = {
    "gpt2": GPT2,
    "gpt2-nobias-untied": ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=32, bias=False,
                                      tie_embeddings=False),
    "gpt2-ffn": ModelConfig(n_layer=3, n_head=4, n_embd=64, vocab_size=100, block_size=16, intermediate_size=80),
    "llama-default": ModelConfig(arch="llama"),
    "llama-gqa-tied": ModelConfig(arch="llama", n_layer=2, n_head=8, n_kv_head=2, head_dim=16, n_embd=64,
                                  intermediate_size=96, vocab_size=100, tie_embeddings=True),
    "qwen2-like": ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, vocab_size=100,
                              qkv_bias=True),
    "qwen3-tied-head_dim": ModelConfig(arch="qwen3", n_layer=2, n_head=4, n_kv_head=2, head_dim=24, n_embd=64,
                                       vocab_size=100, tie_embeddings=True),
    "qwen3-default": ModelConfig(arch="qwen3"),
    "qwen3_moe-mixed": ModelConfig(arch="qwen3_moe", n_layer=3, n_head=4, n_kv_head=2, n_embd=64, vocab_size=100,
                                   moe={"num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]}),
    "llama3-8b": ModelConfig(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                             vocab_size=128256, block_size=8192),
}


@pytest.mark.parametrize("name", list(SHAPE_CONFIGS))
def test_models_build_exactly_the_shapes_their_arch_describes(name):
    cfg = SHAPE_CONFIGS[name]
    with torch.device("meta"):
        model = build_model(cfg)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == arch_of(cfg).param_shapes()


@pytest.mark.parametrize("family", PLANNER_FAMILIES)
def test_families_only_the_planner_reads_are_not_built(family):
    with pytest.raises(ConfigError, match=rf"^model.arch='{family}': zerodp builds and trains gpt2, llama, qwen3, "
                                          rf"qwen3_moe; {family} is known to the planner only "
                                          rf"\(zerodp plan --hf-config\)$"):
        build_model(ModelConfig(arch=family))


SPEC_NAMES = ("MODEL", "MODEL_TYPES", "DEFAULT_BIAS", "DEFAULT_TIED", "LEARNED_POSITIONS", "EMBEDDING", "BLOCK_PREFIX",
              "default_ffn", "block_shapes", "param_shapes", "TABLE", "IMPORT_PREFIX", "BUFFERS", "NORM_EPS_KEY",
              "model_config_from_hf", "hf_config", "PLANNER_DEFAULTS", "planner_arch", "PRESETS")


def test_every_registered_family_has_a_whole_torch_free_spec():
    """Each family in zerodp.models.FAMILY_PACKAGES: its spec.py names everything zerodp reads about it
    (zerodp/models/__init__.py's list) and imports no torch; its model.py's class is the spec's MODEL."""
    import subprocess
    import sys

    from zerodp.models import FAMILY_PACKAGES

    code = ("import importlib, sys\nfrom zerodp.models import FAMILY_PACKAGES\n"
            "specs = [importlib.import_module(p + '.spec') for p in FAMILY_PACKAGES.values()]\n"
            f"missing = [(s.__name__, n) for s in specs for n in {SPEC_NAMES!r} if not hasattr(s, n)]\n"
            "print(missing, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"
    assert set(FAMILY_PACKAGES) == {"gpt2", "llama", "qwen3", "qwen3_moe"}
    for family in FAMILY_PACKAGES:
        assert type(build_model(ModelConfig(arch=family), device="meta")).__name__ == arch_of(
            ModelConfig(arch=family)).spec.MODEL


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_loss_is_the_mean_over_targets_and_zero_without_any(arch):
    """y = IGNORE_INDEX (-100) where a loss mask says no target: the loss is the mean over the other
    positions, and a micro batch without targets gives 0 and zero gradients, not F.cross_entropy's NaN."""
    from zerodp.models.common import IGNORE_INDEX

    over = {"llama": dict(arch="llama", n_head=4, n_kv_head=2, intermediate_size=64)}.get(arch, {})
    cfg = ModelConfig(n_layer=2, n_head=over.pop("n_head", 2), n_embd=32, block_size=16, vocab_size=64, **over)
    model = build_model(cfg, seed=3)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    keep = torch.rand(2, 16, generator=torch.Generator().manual_seed(2)) < 0.4
    logits = model(x).float()
    want = torch.nn.functional.cross_entropy(logits[keep], y[keep])
    assert torch.allclose(model(x, torch.where(keep, y, IGNORE_INDEX)), want, atol=1e-6)
    none = model(x, torch.full_like(y, IGNORE_INDEX))
    none.backward()
    assert none.item() == 0.0
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and not p.grad.any()) for p in model.parameters())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_selective_checkpointing_recomputes_no_matmul_and_keeps_less_than_off(arch):
    """selective runs no matmul or attention again in the backward (full runs the forward's again), and after
    the forward it holds fewer bytes for the backward than off, more than full."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Watch(TorchDispatchMode):
        """Counts matmul and attention calls; keeps a weak reference to every storage an op makes."""

        def __init__(self):
            super().__init__()
            self.heavy, self.made = 0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            self.heavy += name.startswith(("mm", "addmm", "bmm", "_scaled_dot_product")) and "backward" not in name
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    self.made[st.data_ptr()] = (weakref.ref(st), st.nbytes())
            return out

        def alive(self) -> int:
            return sum(n for ref, n in self.made.values() if ref() is not None)

    x = torch.randint(0, 256, (2, 16))
    heavy, kept = {}, {}
    for ac in ("off", "selective", "full"):
        cfg = ModelConfig(arch=arch, n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16,
                          activation_checkpointing=ac, loss_chunks=0)
        model = build_model(cfg, seed=0).train()
        with Watch() as forward:
            loss = model(x, x)
        kept[ac] = forward.alive()
        with Watch() as backward:
            loss.backward()
        heavy[ac] = backward.heavy
    assert heavy["selective"] == heavy["off"] < heavy["full"], heavy
    assert kept["full"] < kept["selective"] < kept["off"], kept
