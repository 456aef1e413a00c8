"""`zerodp plan --hf-config` counts what transformers builds: every name and shape of the model
`AutoModelForCausalLM.from_config` makes from the same config.json (under torch.device("meta"):
nothing allocated, nothing downloaded), for each model type the planner reads, published and small
configs, tied and untied heads; for mixtures of experts the total (memory) and the active count
(compute). The planner itself never imports torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.planner import Cluster, Layout, Workload, estimate, gpu_preset, preset, spec_from_hf_config
from zerodp.planner.cli import add_parser, run

ROOT = Path(__file__).resolve().parents[2]
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # within the small configs' vocabularies

# The published config.json files' shape keys (and token ids, which transformers checks).
PUBLISHED = {
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
             "n_positions": 1024, "n_ctx": 1024, "bos_token_id": 50256, "eos_token_id": 50256},
    "llama2-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                  "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                  "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    "llama3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                    "num_hidden_layers": 16, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "bos_token_id": 128000, "eos_token_id": 128001},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                   "max_position_embeddings": 32768, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                   "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "bos_token_id": 151643, "eos_token_id": 151643},
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
                   "num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "tie_word_embeddings": True,
                   "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
                 "num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False,
                 "bos_token_id": 151643, "eos_token_id": 151645},
    "gemma-7b": {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16,
                 "num_hidden_layers": 28, "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000,
                 "max_position_embeddings": 8192, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
    "gemma-2b": {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
                 "num_hidden_layers": 18, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000,
                 "max_position_embeddings": 8192, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
    "gemma2-9b": {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
                  "num_hidden_layers": 42, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
                  "max_position_embeddings": 8192, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
    "gemma2-2b": {"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_attention_heads": 8,
                  "num_hidden_layers": 26, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
                  "max_position_embeddings": 8192, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1},
    "phi3-mini": {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
                  "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                  "max_position_embeddings": 4096, "tie_word_embeddings": False,
                  "pad_token_id": 32000, "bos_token_id": 1, "eos_token_id": 32000},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                     "max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": 1,
                     "eos_token_id": 2},
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B's config.json (the keys that change a shape)
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_attention_heads": 32, "num_hidden_layers": 48,
                      "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                      "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-235b-a22b": {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_hidden_layers": 94,
                        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                        "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                          "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
                          "mlp_only_layers": [], "num_attention_heads": 16, "num_hidden_layers": 24,
                          "num_key_value_heads": 16, "vocab_size": 151936, "max_position_embeddings": 8192,
                          "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643},
}

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=3, vocab_size=100, **IDS)
VARIANTS = {  # small configs that exercise every switch, and keys left to transformers' defaults
    "gpt2-untied": {**PUBLISHED["gpt2"], "tie_word_embeddings": False},
    "gpt2-n_inner": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100,
                     "n_positions": 32, "n_inner": 80, **IDS},
    "llama-biases": {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "attention_bias": True,
                     "mlp_bias": True, "tie_word_embeddings": True},
    "mistral-default-kv-head_dim": {"model_type": "mistral", **SMALL, "num_attention_heads": 16, "head_dim": 8},
    "qwen2-tied": {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen3-defaults": {"model_type": "qwen3", **SMALL, "num_attention_heads": 32},  # kv 32, head_dim 128, untied
    "qwen3-gqa-tied": {"model_type": "qwen3", **SMALL, "num_key_value_heads": 2, "head_dim": 24,
                       "tie_word_embeddings": True},
    "qwen3-biases": {"model_type": "qwen3", **SMALL, "num_key_value_heads": 1, "head_dim": 32, "attention_bias": True},
    "gemma-defaults": {"model_type": "gemma", **SMALL, "num_attention_heads": 16},  # kv 16, head_dim 256, tied
    "gemma-untied-bias": {"model_type": "gemma", **SMALL, "num_key_value_heads": 1, "head_dim": 32,
                          "tie_word_embeddings": False, "attention_bias": True},
    "gemma2-untied": {"model_type": "gemma2", **SMALL, "num_key_value_heads": 2, "head_dim": 16,
                      "tie_word_embeddings": False},
    "phi3-gqa-tied": {"model_type": "phi3", **SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "mixtral-alias-head_dim": {"model_type": "mixtral", **SMALL, "num_key_value_heads": 2, "head_dim": 32,
                               "num_experts": 4, "num_experts_per_tok": 1},
    "qwen2_moe-sparse-step": {"model_type": "qwen2_moe", **SMALL, "num_hidden_layers": 5, "num_key_value_heads": 2,
                              "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                              "shared_expert_intermediate_size": 40, "decoder_sparse_step": 2,
                              "mlp_only_layers": [3], "qkv_bias": False},
    "qwen2_moe-defaults": {"model_type": "qwen2_moe", **SMALL},  # 60 experts of 1408, 4 per token, shared 5632
}
CONFIGS = {**PUBLISHED, **VARIANTS}


def hf_model(raw: dict):
    """What transformers builds from config.json `raw`, on the meta device."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def hf_active(model) -> int:
    """Parameters one token computes with in the transformers model: an experts module (one tensor slice
    per expert) counts num_experts_per_tok of its experts, every other parameter fully."""
    cfg = model.config
    experts = {id(p) for name, m in model.named_modules() if type(m).__name__.endswith("Experts")
               for p in m.parameters()}
    per_token = getattr(cfg, "num_experts_per_tok", 0)
    n_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    return sum(p.numel() * per_token // n_experts if id(p) in experts else p.numel() for p in model.parameters())


def spec_of(raw: dict, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return spec_from_hf_config(str(path))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_config_counts_what_transformers_builds(name, tmp_path):
    raw = CONFIGS[name]
    model, spec = hf_model(raw), spec_of(raw, tmp_path)
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied head listed once
    shapes = spec.arch.param_shapes()
    if raw["model_type"] == "gpt2":  # transformers' GPT-2 stores its Linear layers (in, out) as Conv1D
        assert {n: math.prod(s) for n, s in built.items()} == {n: math.prod(s) for n, s in shapes.items()}
    else:
        assert built == shapes
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.active_params == hf_active(model)


@pytest.mark.parametrize("tied,count", [(True, 124_439_808), (False, 163_037_184)])
def test_gpt2_honours_tie_word_embeddings(tmp_path, tied, count):
    # before: an untied gpt2 was counted tied, 124,439,808 (38.6M short: the separate lm_head)
    assert spec_of({**PUBLISHED["gpt2"], "tie_word_embeddings": tied}, tmp_path).params == count


@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
    ("qwen1.5-moe-a2.7b", 14_315_784_192, 2_689_173_504),
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),  # published: 30.5B total, 3.3B activated
    ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520),  # published: 235B total, 22B activated
])
def test_moe_total_and_active_published(name, total, active, tmp_path):
    spec = spec_of(PUBLISHED[name], tmp_path)
    assert (spec.params, spec.active_params) == (total, active)
    assert (preset(name).params, preset(name).active_params) == (total, active)


@pytest.mark.parametrize("name", ["gpt2", "llama2-7b", "llama3.2-1b", "mistral-7b", "qwen2.5-7b", "qwen3-0.6b",
                                  "qwen3-8b", "gemma-7b", "gemma2-9b", "phi3-mini", "mixtral-8x7b",
                                  "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_presets_are_the_published_configs(name, tmp_path):
    assert preset(name).arch.param_shapes() == spec_of(PUBLISHED[name], tmp_path).arch.param_shapes()


def test_moe_memory_counts_every_expert_and_compute_the_routed_ones():
    m, c, w = preset("mixtral-8x7b"), Cluster(gpu=gpu_preset("h100"), gpus_per_node=8), Workload(1, 4096)
    e = estimate(m, Layout("zero3", c, w))
    # every expert's bf16 shard, its gradient shard in fp32 (strategy.grad_reduce_dtype), fp32 master and moments
    assert e.model_states_bytes == (2 + 4 + 12) * math.ceil(m.params / 8)
    assert e.compute_s == pytest.approx(m.arch.flops_per_token(4096) * 4096 / (0.4 * 989e12))
    assert m.arch.flops_per_token(4096) < 6 * m.params / 3  # two of eight experts compute
    assert m.ffn_hidden == 2 * 14336  # each token passes two experts' SwiGLU


def test_zero3_and_fsdp_gather_every_expert():
    """A qwen3_moe of 2 sparse blocks, 8 experts of 256 x 128 (3 matrices each: 1,572,864 expert elements)
    at world 2 in bf16: fsdp all-gathers them forward and again backward, 2 bytes x 1/2 (ring) x 2 passes;
    zero3 forward only (the model is within DeepSpeed's reuse distance: nothing released before backward).
    ddp gathers nothing; a dense model has no experts."""
    from zerodp.config import load_config
    from zerodp.planner.models import spec_from_model_config

    cfg = load_config(None, ["model.arch=qwen3_moe", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2",
                             "model.n_embd=128", "model.vocab_size=64", "model.moe.num_experts=8",
                             "model.moe.num_experts_per_tok=2", "model.moe.moe_intermediate_size=256"])
    m, c, w = spec_from_model_config(cfg.model), Cluster(gpu=gpu_preset("h100"), gpus_per_node=2), Workload(1, 64)
    experts = 2 * 8 * 3 * 256 * 128
    fsdp, zero3, ddp = (estimate(m, Layout(s, c, w)) for s in ("fsdp", "zero3", "ddp"))
    assert fsdp.expert_gather_bytes == 0.5 * 2 * 2 * experts
    assert zero3.expert_gather_bytes == 0.5 * 2 * experts
    assert ddp.expert_gather_bytes == 0 and ddp.expert_gather_share == 0
    assert 0.5 < fsdp.expert_gather_share < 1 and fsdp.expert_gather_s > 0
    assert zero3.expert_gather_share == 1  # all else is under 1e5 elements: persistent, gathered after the step
    assert estimate(preset("llama3.2-1b"), Layout("fsdp", c, w)).expert_gather_bytes == 0


def test_plan_shows_active_parameters(tmp_path, capsys):
    parser = __import__("argparse").ArgumentParser(prog="zerodp")
    add_parser(parser.add_subparsers(dest="command"))
    assert run(parser.parse_args(["plan", "--model", "mixtral-8x7b", "--gpus", "8"])) == 0
    assert ("zerodp plan: mixtral-8x7b, 46.70B parameters (46,702,792,704, 12.88B active per token; 32 layers"
            in capsys.readouterr().out)
    assert run(parser.parse_args(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["active_params"]) == (46_702_792_704, 12_879_925_248)


def test_hf_config_of_a_planner_only_family_imports_no_torch(tmp_path):
    for name in ("gemma2-9b", "mixtral-8x7b", "qwen1.5-moe-a2.7b", "phi3-mini"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(PUBLISHED[name]))
    code = ("import sys\nfrom zerodp.cli.commands import main\n"
            f"for name in ('gemma2-9b', 'mixtral-8x7b', 'qwen1.5-moe-a2.7b', 'phi3-mini'):\n"
            f"    assert main(['plan', '--hf-config', {str(tmp_path)!r} + '/' + name, '--gpus', '8', '--json']) == 0\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


TRAINABLE = [n for n, raw in CONFIGS.items() if raw["model_type"] in ("gpt2", "llama", "mistral", "qwen2", "qwen3")
             and not raw.get("attention_bias") and "default-kv" not in n]


@pytest.mark.parametrize("name", TRAINABLE)
def test_planner_and_training_read_a_config_json_alike(name, tmp_path):
    """zerodp.models.hf (what model.hf_config trains) and the planner's reading agree on every shape."""
    from zerodp.config import ModelConfig
    from zerodp.models.arch import arch_of
    from zerodp.models.hf import model_config_from_hf

    raw = CONFIGS[name]
    trained = arch_of(ModelConfig(**model_config_from_hf(raw)))
    assert trained.param_shapes() == spec_of(raw, tmp_path).arch.param_shapes()
