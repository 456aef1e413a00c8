"""The memory planner: formulas on hand-computed cases, exact parameter counts, the choice at its
boundaries, the JSON interface, error messages, and that planning never imports torch."""

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.config import Config, ModelConfig
from zerodp.errors import UserError
from zerodp.planner import (
    Cluster,
    Layout,
    Workload,
    activation_bytes,
    choose,
    estimate,
    gpt_param_count,
    gpu_preset,
    model_states,
    plan_for_training,
    preset,
    spec_from_hf_config,
    spec_from_params,
)
from zerodp.planner.cli import add_parser, run
from zerodp.planner.memory import layer_activation_factor
from zerodp.planner.models import gpt2_spec
from zerodp.planner.traffic import comm_bytes
from zerodp.planner.units import parse_bytes, parse_count

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9


def parse(*argv):
    parser = argparse.ArgumentParser(prog="zerodp")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


# --- model states: the ZeRO paper's table ---------------------------------------------------------

@pytest.mark.parametrize("strategy,expected", [
    ("ddp", (2, 2, 12)),            # 16P
    ("zero1", (2, 2, 12 / 8)),      # 4P + 12P/N
    ("zero2", (2, 2 / 8, 12 / 8)),  # 2P + 14P/N
    ("zero3", (2 / 8, 2 / 8, 12 / 8)),
    ("fsdp", (2 / 8, 2 / 8, 12 / 8)),
])
def test_model_states_mixed_precision(strategy, expected):
    P = 10**9
    assert model_states(P, 8, strategy, "bf16") == tuple(int(e * P) for e in expected)


@pytest.mark.parametrize("strategy,total", [("ddp", 16), ("zero1", 8 + 1), ("zero2", 4 + 1.5), ("zero3", 2)])
def test_model_states_fp32(strategy, total):
    assert sum(model_states(10**9, 8, strategy, "fp32")) == int(total * 10**9)


def test_model_states_bytes_is_the_zero_figure_and_extras_are_separate():
    e = estimate(preset("llama2-7b"), Layout("zero3", Cluster(gpus_per_node=8), Workload(1, 4096)))
    P = 6_738_415_616
    assert e.model_states_bytes == e.params_bytes + e.grads_bytes + e.optimizer_bytes
    # ZeRO's 16P/N with bf16 gradients; strategy.grad_reduce_dtype's default fp32 keeps the gradient
    # partition in fp32: 2 + 4 + 12 bytes per parameter over N
    assert abs(e.model_states_bytes - 18 * P / 8) < 8
    bf16 = estimate(preset("llama2-7b"), Layout("zero3", Cluster(gpus_per_node=8),
                                                 Workload(1, 4096, grad_reduce_dtype="bf16")))
    assert abs(bf16.model_states_bytes - 16 * P / 8) < 8
    # strategy.grad_reduce_dtype is DeepSpeed's: fsdp's gradient shards are fp32 either way, 4 + 4 + 8 bytes over N
    for dtype in ("fp32", "bf16"):
        fsdp = estimate(preset("llama2-7b"), Layout("fsdp", Cluster(gpus_per_node=8),
                                                    Workload(1, 4096, grad_reduce_dtype=dtype)))
        assert abs(fsdp.model_states_bytes - 16 * P / 8) < 8 and abs(fsdp.grads_bytes - 4 * P / 8) < 8
    assert e.gathered_bytes > 0 and e.bucket_bytes > 0
    # zero3's persistent parameters (the 65 RMSNorm weights of 4,096 elements), whole on every rank, apart
    assert e.persistent_bytes == 2 * 65 * 4096
    assert e.total_bytes == (e.model_states_bytes + e.persistent_bytes + e.gathered_bytes + e.bucket_bytes
                             + e.activations_bytes + e.overhead_bytes)


def test_offload_moves_states_to_cpu():
    c = Cluster(gpus_per_node=8)
    e = estimate(preset("llama2-7b"), Layout("zero3", c, Workload(1, 4096), True, True))
    assert e.model_states_bytes == 0
    # fp32 master, m, v, the gradient partition and the master's own gradient buffer (DeepSpeed's stage3), params
    assert e.offloaded_bytes == pytest.approx(22 * 6_738_415_616 / 8, abs=8)
    assert e.cpu_bytes_per_node == 8 * e.offloaded_bytes


# test_planner_validation's model (P = 1,612,800) at world 2 with 2 micro batches a step: (overrides, bytes a rank
# held in host memory, measured by strategy.state_bytes()["offloaded"] on 2 CPU ranks)
MEASURED_OFFLOAD = [
    (["strategy.name=zero2", "train.precision=fp32"], 20_453_376),
    (["strategy.name=zero2", "train.precision=bf16"], 18_265_088),
    (["strategy.name=zero1", "train.precision=bf16"], 18_265_088),
    (["strategy.name=zero3", "train.precision=bf16"], 16_128_000),
    (["strategy.name=zero3", "train.precision=fp32"], 16_128_000),
    (["strategy.name=zero3", "train.precision=bf16", "strategy.offload_params=true"], 17_740_800),
    (["strategy.name=zero3", "train.precision=fp32", "strategy.offload_params=true"], 19_353_600),
]


@pytest.mark.parametrize("extra,measured", MEASURED_OFFLOAD, ids=lambda x: "-".join(x) if isinstance(x, list) else "")
def test_offloaded_bytes_are_what_deepspeed_holds_in_host_memory(extra, measured):
    """DeepSpeed keeps more on the host than the fp32 master, moments and gradients (16 bytes a parameter of the
    partition): zero1/2 a 16-bit copy of the partition, a gradient buffer the size of the largest parameter and,
    accumulating, every partition parameter's gradient; zero3 a second fp32 gradient buffer; offloaded fp32
    parameters beside their master (as predicted before: -21% to -7%). None of them stays on the device."""
    from zerodp.config import load_config
    from zerodp.planner.training import estimate_for_run

    model = ["model.n_layer=2", "model.n_head=4", "model.n_embd=256", "model.block_size=64", "model.vocab_size=64",
             "train.micro_batch_size=2", "train.global_batch_size=8", "strategy.bucket_size_mb=1",
             "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0",
             "strategy.offload_optimizer=true"]
    e = estimate_for_run(load_config(None, model + extra), 2, 64 * 2**30, "cpu")
    assert e.offloaded_bytes == pytest.approx(measured, rel=0.005)
    assert e.grads_bytes == e.optimizer_bytes == e.engine_master_bytes == 0


# --- activations: Korthikanti et al. 2022 ----------------------------------------------------------

def test_activation_factor_matches_the_paper():
    m = dataclasses.replace(gpt2_spec("t", 2, 4, 64, 100, 32, dropout=True), fused_attention=False)
    assert layer_activation_factor(m, 32) == pytest.approx(34 + 5 * 4 * 32 / 64)
    fused = dataclasses.replace(m, fused_attention=True)
    assert layer_activation_factor(fused, 32) == pytest.approx(34)  # SDPA drops the s^2 term
    assert layer_activation_factor(gpt2_spec("t", 2, 4, 64, 100, 32), 32) == pytest.approx(32)  # no masks
    assert layer_activation_factor(preset("llama2-7b"), 4096) == pytest.approx(10 + 2 + 8 * 11008 / 4096 + 4)
    # Gemma's Q and attention output are n_head * head_dim = 4096 wide on a 3072 hidden; Gemma 2 keeps 4 norms
    q, kv = 4096 / 3072, 4096 / 3072
    assert layer_activation_factor(preset("gemma-7b"), 4096) == pytest.approx(
        2 + 2 * q + 4 * kv + 2 * q + (2 + 8 * 24576 / 3072) + 4)
    assert layer_activation_factor(preset("gemma2-9b"), 4096) == pytest.approx(
        2 + 2 * 4096 / 3584 + 4 * 2048 / 3584 + 2 * 4096 / 3584 + (2 + 8 * 14336 / 3584) + 8)


def test_activation_bytes_hand_computed():
    m = gpt2_spec("t", 2, 4, 64, 100, 32, dropout=True)
    assert not m.fused_attention  # dropout: zerodp's explicit attention (KeyedDropout.attend)
    # s*b*h*(34 + 5*a*s/h) and what the explicit attention keeps beyond it: the fp32 softmax (4 bytes, not 2)
    # per element of the (b, a, s, s) probabilities, +2*a*s/h
    one_layer = 32 * 2 * 64 * (44 + 4)
    logits = 2 * 32 * 100 * 12  # b*s*V: at the loss's backward, fp32 log-probs, their gradient, the logits'
    assert activation_bytes(m, Workload(2, 32, "bf16"), False) == 2 * one_layer + logits
    assert activation_bytes(m, Workload(2, 32, "bf16"), True) == 2 * (2 * 32 * 2 * 64) + one_layer + logits
    # fp32: 4 + 1 + 4 bytes per probability, the paper's 5 x 2 counting the mask as 4-byte: -1 in 16-bit units
    assert activation_bytes(m, Workload(2, 32, "fp32"), False) == 2 * 2 * 32 * 2 * 64 * (44 - 1) + logits
    # under autocast (single, ddp) LayerNorm keeps the fp32 residual stream: +2 bytes per norm, and the
    # 16-bit copies of every weight that multiplies
    copies = 2 * m.params
    assert activation_bytes(m, Workload(2, 32, "bf16"), False, autocast=True) == \
        2 * (one_layer + 32 * 2 * 64 * 4) + logits + copies


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_explicit_attention_keeps_what_the_planner_counts(family, precision):
    """A model that trains with dropout computes attention explicitly (KeyedDropout.attend) and keeps the
    (b, a, s, s) probabilities: one block's saved tensors (a 2-block model's less a 1-block one's, weights
    left out) measured under torch's saved-tensor hooks, within 5% of the planner's one layer."""
    import torch

    from zerodp.models import build_model
    from zerodp.planner.models import spec_from_model_config

    dims = {"gpt2": dict(n_head=4, n_embd=64), "llama": dict(arch="llama", n_head=4, n_kv_head=2, n_embd=64,
                                                             intermediate_size=160)}[family]
    x = torch.randint(0, 100, (2, 64))
    measured, planned = [], []
    for n_layer in (1, 2):
        cfg = ModelConfig(**dims, n_layer=n_layer, vocab_size=100, block_size=64, dropout=0.1)
        model = build_model(cfg, seed=0).train().to(torch.float32 if precision == "fp32" else torch.bfloat16)
        measured.append(_saved_bytes(model, x, autocast=False, targets=False))
        planned.append(activation_bytes(spec_from_model_config(cfg), Workload(2, 64, precision), False))
    one_layer = measured[1] - measured[0]
    assert planned[1] - planned[0] == pytest.approx(one_layer, rel=0.05)


def _saved_bytes(model, x, autocast: bool, targets: bool = True) -> int:
    """Bytes of the tensors a training forward of `model` keeps for backward (weights left out): with
    `targets`, the loss's forward (x its own targets), else the logits'."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            saved[s.data_ptr()] = s.nbytes()
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x) if targets else model(x)
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
def test_qk_norms_keep_what_the_planner_counts(precision):
    """Qwen3's per-head q and k RMSNorms: a qwen3 block keeps, beyond the llama block of the same shape,
    their fp32 inputs and outputs (zerodp.planner.activations.qk_norm_extra), measured under saved-tensor
    hooks within 5% (the planner counted none of it: 0 against 76,800 bytes in bf16)."""
    import torch

    from zerodp.config import load_config
    from zerodp.models import build_model
    from zerodp.planner.models import spec_from_model_config

    x = torch.randint(0, 64, (2, 64))
    measured, planned = {}, {}
    for arch in ("llama", "qwen3"):
        cfg = load_config(None, [f"model.arch={arch}", "model.n_layer=1", "model.n_head=4", "model.n_kv_head=2",
                                 "model.n_embd=64", "model.block_size=64", "model.vocab_size=64",
                                 "model.intermediate_size=64"])
        model = build_model(cfg.model, seed=0).train().to(torch.bfloat16 if precision == "bf16" else torch.float32)
        measured[arch] = _saved_bytes(model, x, precision == "autocast")
        planned[arch] = activation_bytes(spec_from_model_config(cfg.model),
                                         Workload(2, 64, "fp32" if precision == "fp32" else "bf16"), False,
                                         autocast=precision == "autocast")
    norms = measured["qwen3"] - measured["llama"]
    assert planned["qwen3"] - planned["llama"] == pytest.approx(norms, rel=0.05)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
def test_moe_block_keeps_what_the_planner_counts(precision):
    """A qwen3_moe block (8 experts of width 32, 2 per token, norm_topk_prob) keeps, beyond the dense
    qwen3 block with a SwiGLU MLP of width 2 x 32, the routed copies, the router's probabilities and the
    routing indices (zerodp.planner.moe.routed_bytes_per_token): measured under saved-tensor hooks, the
    difference within 5% of the planner's (which counted none of it: 0 against 110,656 bytes in bf16)."""
    import torch

    from zerodp.config import load_config
    from zerodp.models import build_model
    from zerodp.planner.models import spec_from_model_config

    x = torch.randint(0, 64, (2, 64))
    measured, planned = {}, {}
    for arch in ("qwen3", "qwen3_moe"):
        o = [f"model.arch={arch}", "model.n_layer=1", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=64",
             "model.block_size=64", "model.vocab_size=64", "model.intermediate_size=64"]
        if arch == "qwen3_moe":
            o += ["model.moe.num_experts=8", "model.moe.num_experts_per_tok=2", "model.moe.moe_intermediate_size=32",
                  "model.moe.norm_topk_prob=true"]
        cfg = load_config(None, o)
        model = build_model(cfg.model, seed=0).train().to(torch.bfloat16 if precision == "bf16" else torch.float32)
        measured[arch] = _saved_bytes(model, x, precision == "autocast")
        spec = spec_from_model_config(cfg.model)
        planned[arch] = activation_bytes(spec, Workload(2, 64, "fp32" if precision == "fp32" else "bf16"), False,
                                         autocast=precision == "autocast")
    routed = measured["qwen3_moe"] - measured["qwen3"]
    assert planned["qwen3_moe"] - planned["qwen3"] == pytest.approx(routed, rel=0.05)


# --- communication and time ------------------------------------------------------------------------

def test_communication_volumes():
    """What the engines send (measured in tests/distributed/test_equivalence.py), against the ZeRO paper's 2P
    (ddp, zero1, zero2) and 3P (zero3) in units of one ring all-reduce's worth of parameter bytes."""
    m, c = spec_from_params(870_842_368, layers=16, hidden=2048, vocab=32000), Cluster(gpus_per_node=8)
    P, B = m.params, 16 * m.largest_block_params  # every parameter, and those in blocks
    assert P == B + 32000 * 2048

    def vol(precision: str, accum: int = 1, defer: bool = False, keep: int = 0, reduce: str = "bf16") -> dict:
        w = Workload(precision=precision, grad_accum_steps=accum, fsdp_defer_grad_reduce=defer,
                     zero3_keep_window=keep, grad_reduce_dtype=reduce)
        return {s: sum(comm_bytes(m, Layout(s, c, w))) for s in ("ddp", "zero1", "zero2", "zero3", "fsdp")}

    ring32, ring16 = 7 / 8 * 4, 7 / 8 * 2  # bytes one rank sends per element of an all-gather, fp32 / bf16
    fp32 = vol("fp32")
    assert fp32["ddp"] == pytest.approx(2 * ring32 * P)  # the paper's 2P
    # DeepSpeed zero1/2 all-reduce the gradients (2P), then all-gather the updated parameters (+P)
    assert fp32["zero1"] == fp32["zero2"] == pytest.approx(3 * ring32 * P)
    # zero3 with every parameter released after forward: all-gather forward and backward, reduce-scatter
    assert fp32["zero3"] == pytest.approx(3 * ring32 * P) == pytest.approx(1.5 * fp32["ddp"])
    # fsdp: the root unit (embeddings, head) stays gathered from forward to backward
    assert fp32["fsdp"] == pytest.approx(ring32 * (2 * P + B))
    # bf16 with strategy.grad_reduce_dtype=bf16: DeepSpeed communicates in bf16; zerodp's DDP (autocast over
    # fp32 params) and FSDP (reduce_dtype fp32) reduce fp32 gradients, so their gradient traffic stays at 4 bytes
    bf16 = vol("bf16")
    assert bf16["ddp"] == fp32["ddp"] and bf16["zero1"] == pytest.approx(3 * ring16 * P)
    assert bf16["zero3"] == pytest.approx(3 * ring16 * P)
    assert bf16["fsdp"] == pytest.approx(ring16 * (P + B) + ring32 * P)
    # accumulating 4 micro batches: zero1 reduces once, zero2 every micro batch; fsdp reduce-scatters
    # each one unless it defers (then once); zero3 gathers and reduces every micro batch
    acc = vol("bf16", 4)
    assert acc["ddp"] == bf16["ddp"] and acc["zero1"] == bf16["zero1"]
    assert acc["zero2"] == pytest.approx(9 * ring16 * P) and acc["zero3"] == pytest.approx(12 * ring16 * P)
    assert acc["fsdp"] == pytest.approx(4 * ring16 * (P + B) + 4 * ring32 * P)
    assert vol("bf16", 4, defer=True)["fsdp"] == pytest.approx(4 * ring16 * (P + B) + ring32 * P)
    # DeepSpeed's defaults keep a block gathered from forward to backward when at most 1e9 elements are
    # fetched in between: the last 10 blocks here (2 x 9 blocks + the embedding < 1e9 elements)
    regathered = 6 * m.largest_block_params + (P - B)
    assert vol("bf16", keep=10**9)["zero3"] == pytest.approx(ring16 * (2 * P + regathered))
    # bf16 with the default fp32 reduction: ZeRO's gradient collectives at 4 bytes, its parameter
    # all-gathers at 2 (zero1 as BF16_Optimizer all-reduces its fp32 gradients at the boundary, once)
    fp32r = vol("bf16", reduce="fp32")
    assert fp32r["ddp"] == bf16["ddp"] and fp32r["fsdp"] == bf16["fsdp"]
    assert fp32r["zero1"] == fp32r["zero2"] == pytest.approx(2 * ring32 * P + ring16 * P)
    assert fp32r["zero3"] == pytest.approx(2 * ring16 * P + ring32 * P)
    acc32 = vol("bf16", 4, reduce="fp32")
    assert acc32["zero1"] == fp32r["zero1"] and acc32["zero2"] == pytest.approx(4 * 2 * ring32 * P + ring16 * P)
    assert acc32["zero3"] == pytest.approx(4 * (2 * ring16 * P + ring32 * P))
    assert vol("bf16", keep=10**9, reduce="fp32")["zero3"] == pytest.approx(ring16 * (P + regathered) + ring32 * P)
    assert sum(comm_bytes(m, Layout("ddp", Cluster(gpus_per_node=1), Workload()))) == 0


def test_zero_pads_and_persists_as_deepspeed_does():
    """Sizes of the tiny test model's collectives at world 3, as measured (tests/distributed/test_equivalence.py)."""
    from tests.conftest import TINY
    from zerodp.config import load_config
    from zerodp.planner import spec_from_model_config

    m, c = spec_from_model_config(load_config(None, TINY).model), Cluster(gpus_per_node=3)
    assert m.params == 34_688
    w = Workload(precision="fp32", grad_accum_steps=2)
    ring = 2 / 3 * 4
    # zero1: one all-reduce of 34,688 gradients; the all-gather of the two flat groups padded to 6: 34,692
    assert sum(comm_bytes(m, Layout("zero1", c, w))) == int(ring * (2 * 34_688)) + int(ring * 34_692)
    # zero3: every parameter is under 1e5 elements, so persistent: reduce-scatter each micro batch and
    # one all-gather after the step, each parameter padded to a multiple of 3: 34,719
    assert sum(comm_bytes(m, Layout("zero3", c, w))) == int(ring * 2 * 34_719) + int(ring * 34_719)
    # fsdp: dim 0 padded to a multiple of 3: 35,184 elements, the blocks' 25,806
    assert sum(comm_bytes(m, Layout("fsdp", c, w))) == int(ring * (2 * (35_184 + 25_806) + 2 * 35_184))


def test_step_time_is_training_flops_at_mfu_plus_a_third_with_checkpointing():
    m, c, w = preset("gpt2"), Cluster(gpu=gpu_preset("a100")), Workload(8, 1024)
    # 6 per multiplying parameter (the position table is a lookup; the tied embedding is the head) + attention
    flops = 6 * (m.params - 1024 * 768) + 12 * 12 * 1024 * 768
    assert m.arch.flops_per_token(1024) == flops
    off = estimate(m, Layout("single", c, w))
    assert off.step_s == pytest.approx(flops * 8 * 1024 / (0.4 * 312e12))
    on = estimate(m, Layout("single", c, w, activation_checkpointing=True))
    assert on.step_s == pytest.approx(off.step_s * 4 / 3)
    assert on.scaling_efficiency == 1.0


# --- parameter counts --------------------------------------------------------------------------------

@pytest.mark.parametrize("name,count", [
    ("gpt2", 124_439_808), ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200), ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320),
    ("llama2-70b", 68_976_648_192), ("llama3-8b", 8_030_261_248), ("mistral-7b", 7_241_732_096),
    ("qwen2.5-7b", 7_615_616_512), ("gemma-7b", 8_537_680_896), ("gemma2-9b", 9_241_705_984),
    ("phi3-mini", 3_821_079_552), ("mixtral-8x7b", 46_702_792_704), ("qwen1.5-moe-a2.7b", 14_315_784_192),
])
def test_preset_counts_match_published(name, count):
    assert preset(name).params == count


def test_gpt_param_count_of_zerodp_model():
    h, L, V, T = 128, 4, 256, 128  # ModelConfig defaults
    assert gpt_param_count(ModelConfig()) == V * h + T * h + L * (12 * h * h + 13 * h) + 2 * h == 842_496
    assert gpt_param_count(ModelConfig(bias=False)) == V * h + T * h + L * (12 * h * h + 2 * h) + h
    gpt2 = ModelConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)
    assert gpt_param_count(gpt2) == 124_439_808


LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
             "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000,
              "max_position_embeddings": 32768, "sliding_window": 4096}


@pytest.mark.parametrize("cfg,count", [(LLAMA2_7B, 6_738_415_616), (MISTRAL_7B, 7_241_732_096),
                                       ({**LLAMA2_7B, "tie_word_embeddings": True}, 6_738_415_616 - 32000 * 4096),
                                       ({"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25,
                                         "vocab_size": 50257, "n_positions": 1024, "n_inner": None}, 1_557_611_200)])
def test_hf_config_counted_exactly(tmp_path, cfg, count):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert spec_from_hf_config(str(path)).params == count


def test_hf_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 4096,,}')
    with pytest.raises(UserError, match=r"not valid JSON at line 1, column \d+"):
        spec_from_hf_config(str(bad))
    bad.write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    with pytest.raises(UserError, match="model_type 'bert' is not supported; the planner reads gpt2, llama"):
        spec_from_hf_config(str(bad))
    bad.write_text(json.dumps({k: v for k, v in LLAMA2_7B.items() if k != "intermediate_size"}))
    with pytest.raises(UserError, match="llama config lacks 'intermediate_size'"):
        spec_from_hf_config(str(bad))
    with pytest.raises(UserError, match="file not found"):
        spec_from_hf_config(str(tmp_path / "missing.json"))


def test_hf_config_accepts_a_model_folder(tmp_path, capsys):
    folder = tmp_path / "Llama-2-7b-hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA2_7B))
    m = spec_from_hf_config(str(folder))
    assert m.params == 6_738_415_616 and m.name == "Llama-2-7b-hf"
    assert m == spec_from_hf_config(str(folder / "config.json"))
    assert run(parse("--hf-config", str(folder), "--gpus", "8", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["params"] == 6_738_415_616
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"^--hf-config \S+empty: the folder has no config.json; pass a Hugging Face "
                                        r"model folder or its config.json$"):
        spec_from_hf_config(str(empty))


def test_params_only_guesses_a_shape():
    m = spec_from_params(7_000_000_000)
    assert m.params == 7_000_000_000 and m.shape_assumed
    assert 3500 < m.hidden < 5000 and 25 < m.n_layer < 40
    exact = spec_from_params(7_000_000_000, layers=32, hidden=4096)
    assert (exact.n_layer, exact.hidden, exact.shape_assumed) == (32, 4096, False)


# --- the choice at its boundaries ------------------------------------------------------------------

def h100(n=1, nodes=1, **kw):
    return Cluster(gpu=gpu_preset("h100"), gpus_per_node=n, nodes=nodes, **kw)


def test_ddp_boundary_is_5B_on_80GB():
    five = estimate(spec_from_params(5 * 10**9), Layout("ddp", h100(2), Workload(1, 512)))
    assert five.model_states_bytes == 80 * GB and not five.fits  # 16 bytes/param fill the GPU alone
    # below it, autocast's 16-bit weight copies (2P) and the activations must fit beside the 16P
    four = choose(spec_from_params(3.5 * 10**9), h100(2), Workload(1, 512))
    assert four.estimates[0].name == "ddp" and four.estimates[0].fits
    assert not four.estimates[0].activation_checkpointing
    five_plan = choose(spec_from_params(5 * 10**9), h100(2), Workload(1, 512))
    assert not five_plan.estimates[0].fits and five_plan.choice != "ddp"


def test_7b_does_not_fit_ddp_on_one_80GB_gpu_and_offloads():
    plan = choose(preset("llama2-7b"), h100(1), Workload(1, 4096))
    single = plan.estimates[0]
    assert single.name == "single" and not single.fits
    assert plan.choice == "zero2" and plan.offload_optimizer and plan.choice_name == "zero2+offload_optimizer"
    assert any(r.startswith("single: does not fit") for r in plan.reasons)


def test_7b_on_8x80GB_picks_the_fastest_row_that_fits():
    plan = choose(preset("llama2-7b"), h100(8), Workload(1, 4096))
    rows = {e.name: e for e in plan.estimates}
    # zero1/2 wait for their all-gather after the step; fsdp and zero3 prefetch behind compute: fsdp, the
    # simpler of the two, within 3% of zero3
    assert plan.choice == "fsdp" and not plan.offload_optimizer and not plan.activation_checkpointing
    assert rows["zero1"].fits and rows["zero1"].step_s > rows["fsdp"].step_s * 1.03
    assert rows["zero3"].step_s == pytest.approx(rows["fsdp"].step_s, rel=0.03)
    assert not plan.estimates[0].fits
    reasons = {r.split(":")[0]: r for r in plan.reasons}
    # zero1 in bf16 with fp32 accumulation (DeepSpeed's BF16_Optimizer): bf16 params and gradients, a full fp32
    # gradient buffer, 12P/N of master and moments, its all-reduce's fp32 flat copy of 5e8 elements: 66.0 GB
    # before activations, so only with checkpointing (two 4096 x 4096 inputs per layer in bf16 and one layer's
    # activations, `activation_bytes`) under the 72 GB usable
    P, z1 = 6_738_415_616, rows["zero1"]
    assert z1.model_states_bytes == 2 * P + (2 * P + 4 * P) + 12 * P // 8 and z1.bucket_bytes == 4 * 500_000_000
    acts = activation_bytes(preset("llama2-7b"), Workload(1, 4096), True)
    assert z1.activation_checkpointing and z1.total_bytes == z1.model_states_bytes + z1.bucket_bytes + acts + 2**30
    assert reasons["zero1"].startswith("zero1: fits (70.5 GB), but slower: predicted ")
    assert "within 3%, and fsdp is simpler" in reasons["zero3"]
    assert len([r for r in plan.reasons if r.split(":")[0] in {e.name for e in plan.estimates}]) == 8


def test_checkpointing_turned_on_when_it_makes_it_fit():
    """The least recomputing mode that fits: off, then selective, then full."""
    assert choose(preset("gpt2"), h100(1), Workload(128, 1024)).activation_checkpointing == "off"
    plan = choose(preset("gpt2"), h100(1), Workload(256, 1024))
    assert plan.choice == "single" and plan.activation_checkpointing == "selective"
    assert ("Activation checkpointing selective: the least recomputation that fits (off, it needs 96.2 GB per GPU, "
            "over the 72.0 GB usable); recomputing the element-wise work adds ~3% compute") in plan.reasons[1]
    plan = choose(preset("gpt2"), h100(1), Workload(384, 1024))
    assert plan.choice == "single" and plan.activation_checkpointing == "full"
    assert "(off, it needs 142.5 GB per GPU; selective, it needs 103.2 GB per GPU" in plan.reasons[1]
    forced_off = choose(preset("gpt2"), h100(1), Workload(256, 1024), activation_checkpointing=False)
    assert forced_off.choice is None and forced_off.suggestion.startswith(
        "It would fit with activation checkpointing selective (single, 70.0 GB per GPU): pass "
        "--activation-checkpointing selective")


def test_nothing_fits_says_how_many_gpus_would():
    plan = choose(preset("llama2-70b"), h100(8, cpu_ram_bytes=512 * GB), Workload(1, 4096))
    assert plan.choice is None and plan.chosen is None
    assert plan.suggestion == "Smallest that fits: 24 GPUs (3 nodes of 8) with fsdp and activation checkpointing full."
    assert any("more than --cpu-ram allows" in r for r in plan.reasons)
    big = estimate(preset("llama2-70b"), Layout("fsdp", h100(8, nodes=3), Workload(1, 4096),
                                                activation_checkpointing=True))
    assert big.fits


def test_70b_on_one_node_needs_offload():
    plan = choose(preset("llama2-70b"), h100(8), Workload(1, 4096))
    assert plan.choice == "zero3" and plan.offload_optimizer and plan.activation_checkpointing
    assert any("without offloading, fsdp fits on 24 GPUs" in r for r in plan.reasons)


def test_plan_for_training():
    cfg = Config()
    cfg.train.global_batch_size = 64  # splits over 1, 4 and 8 ranks of micro batch 8
    assert plan_for_training(cfg, 1, 80 * GB).choice == "single"
    plan = plan_for_training(cfg, 4, 16 * GB, "cpu")
    assert plan.choice == "ddp" and plan.offload_optimizer is False and plan.activation_checkpointing == "off"
    assert "ddp" in plan.table() and plan.reasons[0].startswith("Choice: ddp")
    cfg.model = ModelConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=50257, block_size=1024)
    gpu = plan_for_training(cfg, 8, 24 * GB, "NVIDIA L4")
    assert gpu.choice in ("zero1", "zero2") and gpu.cluster.gpu.name == "l4"
    cfg.model.activation_checkpointing = True
    assert plan_for_training(cfg, 8, 24 * GB, "NVIDIA L4").estimates[0].activation_checkpointing
    with pytest.raises(UserError, match="world_size=0 must be at least 1"):
        plan_for_training(cfg, 0, 80 * GB)


# --- CLI, JSON, errors -----------------------------------------------------------------------------

def test_json_fields(capsys):
    assert run(parse("--model", "llama2-7b", "--gpus", "8", "--hbm", "80GB", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 6_738_415_616 and out["choice"] == "fsdp"
    assert [s["name"] for s in out["strategies"]] == [
        "ddp", "zero1", "zero2", "fsdp", "zero3", "zero2+offload_optimizer", "zero3+offload_optimizer",
        "fsdp+offload", "zero3+offload_optimizer+offload_params"]
    for s in out["strategies"]:
        for key in ("name", "model_states_bytes", "activations_bytes", "total_bytes", "fits", "comm_bytes",
                    "step_s", "scaling_efficiency", "headroom_bytes", "params_bytes", "grads_bytes",
                    "optimizer_bytes", "gathered_bytes", "bucket_bytes", "overhead_bytes"):
            assert key in s
        assert isinstance(s["model_states_bytes"], int) and isinstance(s["fits"], bool)
    assert out["cluster"]["hbm_bytes"] == 80 * GB


def test_table_and_config(capsys, tmp_path):
    cfg = tmp_path / "gpt2.yaml"
    cfg.write_text("model:\n  n_layer: 12\n  n_head: 12\n  n_embd: 768\n  vocab_size: 50257\n  block_size: 1024\n"
                   "train:\n  micro_batch_size: 8\n  global_batch_size: 64\n  precision: bf16\n")
    assert run(parse("--config", str(cfg), "--gpus", "8", "--gpu", "a100")) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "micro batch 8 x 1024 tokens x 1 accumulation, bf16" in out
    assert "Choice: ddp" in out
    run(parse("--config", str(cfg), "train.micro_batch_size=4", "--json"))
    assert json.loads(capsys.readouterr().out)["workload"]["grad_accum_steps"] == 16


def test_plan_for_training_splits_the_batch_as_train_does():
    cfg = Config()
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 480, 12
    for world in range(1, 65):
        try:
            accum = cfg.check_batch_split(world)
        except UserError as e:
            with pytest.raises(UserError, match=f"^{re.escape(str(e))}$"):
                plan_for_training(cfg, world, 80 * GB)
        else:
            assert plan_for_training(cfg, world, 80 * GB).workload.grad_accum_steps == accum


TRAIN_SPLIT_ERROR = {  # what `zerodp train` says on these world sizes (Config.check_batch_split)
    "gpt2-124m": "train.global_batch_size=480 is not divisible by train.micro_batch_size=12 x world_size=16 = 192; "
                 "change micro_batch_size or global_batch_size, or run on one of [1, 2, 4, 5, 8, 10, 20, 40] processes",
    "tiny": "train.global_batch_size=16 is not divisible by train.micro_batch_size=8 x world_size=64 = 512; "
            "change micro_batch_size or global_batch_size, or run on one of [1, 2] processes",
}


@pytest.mark.parametrize("config,argv", [("gpt2-124m", ["--gpus", "8", "--nodes", "2"]), ("tiny", ["--gpus", "64"])])
def test_plan_config_refuses_a_batch_split_train_refuses(config, argv, capsys, monkeypatch):
    from zerodp.cli.commands import main
    from zerodp.config import load_config

    monkeypatch.chdir(ROOT)
    world = int(argv[1]) * (int(argv[3]) if len(argv) > 2 else 1)
    with pytest.raises(UserError) as train_error:
        load_config(f"configs/{config}.yaml").check_batch_split(world)
    assert str(train_error.value) == TRAIN_SPLIT_ERROR[config]
    assert main(["plan", "--config", f"configs/{config}.yaml", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"zerodp: error: {TRAIN_SPLIT_ERROR[config]}\n"


def test_plan_config_micro_batch_flag_is_an_override(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    # 480 = 6 micro x 16 GPUs x 5: what `zerodp train ... train.micro_batch_size=6` runs on 16 ranks
    for extra in (["--micro-batch", "6"], ["train.micro_batch_size=6"]):
        assert run(parse("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "--nodes", "2", *extra)) == 0
        assert "step: micro batch 6 x 1024 tokens x 5 accumulation, bf16" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"^train.global_batch_size=480 is not divisible by train.micro_batch_size=4 "
                                        r"x world_size=16 = 64; change micro_batch_size or global_batch_size, or run "
                                        r"on one of \[1, 2, 3, 4, 5, 6, 8, 10\] processes$"):
        run(parse("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "--nodes", "2", "--micro-batch", "4"))


def test_plan_config_grad_accum_flag_must_agree_with_the_global_batch(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert run(parse("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "--grad-accum", "5")) == 0
    assert "micro batch 12 x 1024 tokens x 5 accumulation" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"^--grad-accum 3 contradicts configs/gpt2-124m.yaml: 12 micro x 8 GPUs x 3 = "
                                        r"288 sequences per step, but train.global_batch_size=480; leave --grad-accum "
                                        r"out \(the global batch sets it, as in zerodp train\) or add "
                                        r"train.global_batch_size=288$"):
        run(parse("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "--grad-accum", "3"))
    assert run(parse("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "--grad-accum", "3",
                     "train.global_batch_size=288")) == 0
    assert "micro batch 12 x 1024 tokens x 3 accumulation" in capsys.readouterr().out


def test_help_examples_run(capsys, monkeypatch):
    from zerodp.planner.cli import EXAMPLES

    monkeypatch.chdir(ROOT)
    lines = [line.split()[2:] for line in EXAMPLES.splitlines() if line.strip().startswith("zerodp plan")]
    assert len(lines) == 5
    for argv in lines:
        if any("path/to" in a for a in argv):
            continue
        assert run(parse(*argv)) == 0, argv
    capsys.readouterr()


def test_sizes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30 == parse_bytes("80 gib")
    assert parse_count("7.5e9") == 7_500_000_000 == parse_count("7.5B")


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama7b"], r"unknown model 'llama7b'; did you mean 'llama2-7b'\? known models: gpt2, "),
    (["--model", "gpt2", "--gpus", "0"], r"--gpus 0: GPUs per node must be at least 1 \(e.g. --gpus 8\)"),
    (["--model", "gpt2", "--hbm", "eighty"], r"--hbm 'eighty' is not a size; write a number and a unit, e.g. 80GB"),
    (["--model", "gpt2", "--hbm", "80"], r"--hbm '80' is not a size"),
    (["--model", "gpt2", "--params", "1e9"], r"give exactly one model source, got several: --model, --params"),
    ([], r"give exactly one model source, got none"),
    (["--model", "gpt2", "--gpu", "h1000"], r"unknown GPU 'h1000'; did you mean 'h100'\?"),
    (["--params", "lots"], r"--params 'lots' is not a number"),
    # zero, negative, infinite and sub-unit sizes and counts: say what is wrong, not "is not a size"
    (["--model", "gpt2", "--hbm", "0"], r"^--hbm '0' must be positive; write a size such as 80GB$"),
    (["--model", "gpt2", "--hbm", "0GiB"], r"^--hbm '0GiB' must be positive; write a size such as 80GB$"),
    (["--model", "gpt2", "--hbm=-80GB"], r"^--hbm '-80GB' must be positive; write a size such as 80GB$"),
    (["--model", "gpt2", "--hbm", "0.5B"], r"^--hbm '0.5B' is less than one byte; write a size such as 80GB$"),
    (["--model", "gpt2", "--hbm", "1e999GB"], r"^--hbm '1e999GB' is too large to be a size; write one such as 80GB$"),
    (["--model", "gpt2", "--hbm", ""], r"^--hbm '' is not a size"),
    (["--model", "gpt2", "--cpu-ram", "0"], r"^--cpu-ram '0' must be positive; write a size such as 512GB$"),
    (["--model", "gpt2", "--cpu-ram", "lots"],
     r"^--cpu-ram 'lots' is not a size; write a number and a unit, e.g. 512GB"),
    (["--params", "0"], r"^--params '0' must be positive \(at least 1\), e.g. 7B$"),
    (["--params=-7B"], r"^--params '-7B' must be positive \(at least 1\), e.g. 7B$"),
    (["--params", "0.4"], r"^--params '0.4' must be positive \(at least 1\), e.g. 7B$"),
    (["--params", "1e999"], r"^--params '1e999' is too large; write a count such as 7B$"),
    (["--params", "7B", "--layers", "0"], r"^--layers 0 must be a positive integer$"),
    (["--model", "gpt2", "--nodes", "0"], r"^--nodes 0: the number of nodes must be at least 1"),
    (["--model", "gpt2", "--micro-batch", "-1"], r"^--micro-batch -1: sequences per micro batch must be at least 1"),
    (["--model", "gpt2", "--mfu", "0"], r"^--mfu 0.0 must be in \(0, 1\]"),
    (["--model", "gpt2", "--interconnect", "carrier-pigeon"], r"--interconnect 'carrier-pigeon' is not one of"),
])
def test_bad_input_messages(argv, message):
    with pytest.raises(UserError, match=message):
        run(parse(*argv))


def test_planning_imports_neither_torch_nor_deepspeed():
    code = ("import sys\nfrom zerodp.cli.commands import main\n"
            "assert main(['plan', '--model', 'llama2-7b', '--gpus', '8', '--hbm', '80GB', '--json']) == 0\n"
            "from zerodp.planner import plan_for_training\nfrom zerodp.config import Config\n"
            "plan_for_training(Config(), 2, 10**10)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_zerodp_plan_entry_point_imports_no_torch():
    code = ("import sys\nfrom zerodp.cli.commands import main\n"
            "assert main(['plan', '--model', 'gpt2', '--gpus', '8', '--json']) == 0\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["choice"] in ("ddp", "zero1", "zero2", "fsdp", "zero3")


def test_module_cli_errors_are_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "zerodp", "plan", "--model", "gpt3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("zerodp: error: unknown model 'gpt3'") and r.stderr.count("\n") == 1
