"""The planner's LoRA rows (zerodp/planner/lora.py, docs/memory_model.md "LoRA: frozen base, trained adapters"):
the frozen base and the adapters priced apart in every strategy's states, gradients, optimizer, gathers and
communication, counts equal to the model zerodp builds, the config path (`strategy: auto`, the trainer's
estimate) LoRA-aware, and `zerodp plan --lora-rank` with full fine-tuning beside it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from zerodp.config import load_config
from zerodp.errors import ConfigError, UserError
from zerodp.models.lora_spec import adapter_count, lora_spec
from zerodp.planner import Cluster, Layout, Workload, choose, estimate, gpu_preset, plan_for_training, preset
from zerodp.planner.cli import add_parser, run
from zerodp.planner.lora import with_lora, without_lora
from zerodp.planner.models import spec_from_model_config
from zerodp.planner.traffic import collectives

GB = 10**9
RANK16 = lora_spec({"rank": 16})  # all-linear
TINY = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.block_size=32", "model.vocab_size=128"]


def parse(*argv):
    parser = argparse.ArgumentParser(prog="zerodp")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def layout(strategy: str, gpus: int = 8, precision: str = "bf16", **kw) -> Layout:
    cluster = Cluster(gpu=gpu_preset("h100"), gpus_per_node=gpus)
    return Layout(strategy, cluster, Workload(1, 4096, precision, **kw))


def test_counts_are_the_built_models():
    """params = base + adapters and trainable = the adapters, as the module zerodp builds has them."""
    import torch  # noqa: F401  (the model is built on the meta device)

    from zerodp.models import build_model

    for family in ("gpt2", "llama"):
        cfg = load_config(None, TINY + [f"model.arch={family}", "model.lora.rank=4",
                                        "model.lora.targets=[all-linear]"])
        model = build_model(cfg.model, device="meta")
        m = spec_from_model_config(cfg.model)
        assert m.params == sum(p.numel() for p in model.parameters())
        assert m.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0
        assert m.frozen_params == sum(p.numel() for p in model.parameters() if not p.requires_grad)
        assert without_lora(m) == spec_from_model_config(load_config(None, TINY + [f"model.arch={family}"]).model)


def test_70b_rank16_states_per_strategy():
    """Each row's states from the formulas: the base frozen at 2 bytes (bf16), whole under ddp/zero1/zero2
    and sharded under zero3/fsdp, no gradient or moment; the adapters as each engine holds trained weights."""
    base = preset("llama3-70b")
    m = with_lora(base, RANK16)
    T, F, n = m.trainable_params, base.params, 8
    per_layer = 16 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 28672))  # q, o; k, v; gate, up, down
    assert T == adapter_count(base.arch, RANK16) == 80 * per_layer
    assert m.params == F + T and m.frozen_params == F
    t, f = math.ceil(T / n), math.ceil(F / n)
    want = {  # strategy: (frozen, adapter params, grads, optimizer) bytes per GPU
        "ddp": (2 * F, 4 * T, 4 * T, 8 * T),
        "zero1": (2 * F, 2 * T, 2 * T + 4 * T, 12 * t),  # BF16_Optimizer: bf16 grads + the fp32 buffer
        "zero2": (2 * F, 2 * T, 4 * t, 12 * t),  # fp32 gradient partition
        "zero3": (2 * f, 2 * t, 4 * t, 12 * t),
        "fsdp": (2 * f, 4 * t, 4 * t, 8 * t),
    }
    for strategy, (frozen, params, grads, optim) in want.items():
        e = estimate(m, layout(strategy))
        assert (e.frozen_bytes, e.params_bytes - e.frozen_bytes, e.grads_bytes, e.optimizer_bytes) == \
            (frozen, params, grads, optim), strategy
    # fp32: the base at 4 bytes, DeepSpeed's extra master copy for the adapters only
    e = estimate(m, layout("zero3", precision="fp32"))
    assert e.frozen_bytes == 4 * f and e.engine_master_bytes == 4 * t


def test_full_fine_tuning_is_unchanged():
    base = preset("llama3-70b")
    assert without_lora(with_lora(base, RANK16)) == base
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        e = estimate(base, layout(strategy))
        assert e.frozen_bytes == 0 and e.grads_bytes > 0


def test_only_adapter_gradients_are_reduced_and_the_base_is_still_gathered():
    base = preset("llama3-70b")
    m, ring = with_lora(base, RANK16), 7 / 8
    T = m.trainable_params
    sent = lambda model, strategy: {x.what: x.sent for x in collectives(model, layout(strategy))}  # noqa: E731
    assert sent(m, "ddp") == {"all-reduce fp32 gradients": 2 * ring * 4 * T}
    z2 = sent(m, "zero2")
    assert z2["all-reduce gradients"] == 2 * ring * 4 * T  # fp32 reduction of the adapters
    assert z2["all-gather updated parameters"] == pytest.approx(ring * 2 * T, rel=1e-6)  # only what the step changed
    fsdp_full, fsdp = sent(base, "fsdp"), sent(m, "fsdp")
    assert fsdp["reduce-scatter fp32 gradients"] == pytest.approx(ring * 4 * T, rel=1e-6)
    # the frozen base is all-gathered as in full fine-tuning, forward and backward (+ the adapters)
    gather = "all-gather parameters (forward, backward)"
    assert fsdp_full[gather] < fsdp[gather] < fsdp_full[gather] * 1.01
    z3 = sent(m, "zero3")
    assert z3["reduce-scatter gradients"] == pytest.approx(ring * 4 * T, rel=1e-3)
    assert z3["all-gather parameters (forward)"] > ring * 2 * base.params * 0.99


# The suite's tiny gpt2 (tests/conftest.py TINY) with rank-4 adapters on every linear layer at world 2: each
# (overrides, bytes sent per rank per step) measured by zerodp.telemetry.comm in a 3-step run (its end-of-run
# "comm/step sent per rank" line), less the 8 bytes of the scalar all-reduces the planner leaves out (fsdp: 64)
MEASURED_LORA_TRAFFIC = [
    (["strategy.name=zero3"], 102_152 - 8),  # every parameter persistent: all gathered again after the step
    (["strategy.name=zero3", "train.precision=bf16"], 63_368 - 8),
    (["strategy.name=zero3", "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0"],
     257_288 - 8),  # nothing persistent: the base gathered in forward and again in backward
    (["strategy.name=fsdp"], 434_368 - 64),
    (["strategy.name=fsdp", "train.precision=bf16"], 229_504 - 64),
]


@pytest.mark.parametrize("extra,measured", MEASURED_LORA_TRAFFIC,
                         ids=lambda x: "-".join(x) if isinstance(x, list) else "")
def test_lora_traffic_is_what_the_engines_sent(extra, measured):
    """zero3 gathers every persistent parameter after the optimizer step, the frozen base's too (it was
    predicted for the adapters alone: 32,768 bytes where 102,152 were sent, +212%)."""
    from zerodp.planner.training import estimate_for_run

    tiny = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.vocab_size=256",
            "train.global_batch_size=12", "train.micro_batch_size=2", "model.lora.rank=4"]
    assert estimate_for_run(load_config(None, tiny + extra), 2, 64 * 2**30, "cpu").comm_bytes == measured


def test_activations_and_compute():
    """Adapters keep x A (tokens x rank, compute dtype) per adapted module of every block (one block under full
    checkpointing); the frozen base computes no weight gradient: 4 FLOPs per parameter, the adapters 6."""
    base = preset("llama3-70b")
    m = with_lora(base, RANK16)
    tokens, modules = 4096, 7  # q, k, v, o, gate, up, down
    for mode, blocks in (("off", 80), ("selective", 80), ("full", 1)):
        lora = estimate(m, dataclasses.replace(layout("fsdp"), activation_checkpointing=mode))
        full = estimate(base, dataclasses.replace(layout("fsdp"), activation_checkpointing=mode))
        assert lora.activations_bytes - full.activations_bytes == blocks * modules * tokens * 16 * 2, mode
    full, lora = estimate(base, layout("fsdp")), estimate(m, layout("fsdp"))
    F = base.arch.flops_per_token(4096)
    attention = 12 * 80 * 4096 * 8192
    multiplying = (F - attention) / 6
    assert lora.compute_s / full.compute_s == pytest.approx((4 * multiplying + attention + 6 * m.trainable_params) / F)
    assert 0.66 < lora.compute_s / full.compute_s < 0.7


def test_70b_rank16_on_8x80gb_fits_only_where_the_base_is_sharded():
    plan = choose(with_lora(preset("llama3-70b"), RANK16),
                  Cluster(gpu=gpu_preset("h100"), gpus_per_node=8), Workload(1, 4096))
    fits = {e.name for e in plan.estimates if e.fits}
    assert {"fsdp", "zero3"} <= fits and not fits & {"ddp", "zero1", "zero2", "zero2+offload_optimizer"}
    full = choose(preset("llama3-70b"), plan.cluster, plan.workload)
    assert not {e.name for e in full.estimates if e.fits} & {"ddp", "zero1", "zero2", "fsdp", "zero3"}
    assert plan.choice == "fsdp" and full.choice is not None and full.offload_optimizer


def test_config_path_is_lora_aware():
    """strategy: auto (`plan_for_training`) and the trainer's estimate (`estimate_for_run`) read model.lora."""
    from zerodp.planner.training import estimate_for_run

    cfg = load_config(None, TINY + ["model.lora.rank=4", "strategy.name=fsdp", "train.precision=bf16"])
    m = spec_from_model_config(cfg.model)
    plan = plan_for_training(cfg, 2, 64 * 2**30, "cpu")
    assert plan.model.trainable_params == m.trainable_params < m.params
    e = estimate_for_run(cfg, 2, 64 * 2**30, "cpu")
    assert e.frozen_bytes == 2 * math.ceil(m.frozen_params / 2)
    assert e.grads_bytes == 4 * math.ceil(m.trainable_params / 2)


def test_cli_lora_rank_prints_full_fine_tuning_beside(capsys):
    argv = ("--model", "llama3-70b", "--gpus", "8", "--hbm", "80GB", "--lora-rank", "16")
    assert run(parse(*argv)) == 0
    out = capsys.readouterr().out
    assert "adapters: LoRA rank 16, alpha 32, targets all-linear: 207.1M trainable" in out
    assert "Full fine-tuning vs LoRA" in out and "Only with the adapters: fsdp, zero3." in out
    assert run(parse(*argv, "--lora-targets", "q_proj,v_proj", "--lora-alpha", "16", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lora"]["targets"] == ["q_proj", "v_proj"] and out["lora"]["alpha"] == 16
    assert out["trainable_params"] == 80 * 16 * ((8192 + 8192) + (8192 + 1024))
    assert [e["name"] for e in out["full_fine_tuning"]] == [e["name"] for e in out["strategies"]]
    assert all(e["frozen_bytes"] == 0 for e in out["full_fine_tuning"])


def test_cli_lora_with_a_config_is_the_override(capsys, tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model:\n  n_layer: 2\n  n_head: 4\n  n_embd: 64\n  block_size: 32\n  vocab_size: 128\n")
    assert run(parse("--config", str(cfg), "--gpus", "2", "--lora-rank", "4", "--lora-targets", "c_attn",
                     "--json")) == 0
    flags = json.loads(capsys.readouterr().out)
    assert run(parse("--config", str(cfg), "--gpus", "2", "model.lora.rank=4", "model.lora.targets=[c_attn]",
                     "--json")) == 0
    assert json.loads(capsys.readouterr().out) == flags
    assert flags["trainable_params"] == 2 * 4 * (64 + 3 * 64)


@pytest.mark.parametrize("argv,error,match", [
    (("--model", "llama3-70b", "--lora-targets", "q_proj"), UserError, "add --lora-rank R"),
    (("--model", "llama3-70b", "--lora-rank", "0"), UserError, "--lora-rank 0"),
    (("--model", "llama3-70b", "--lora-rank", "8", "--lora-targets", "q_prj"), ConfigError,
     "--lora-targets: 'q_prj' names no linear layer of llama's blocks; did you mean 'q_proj'"),
    (("--params", "7e9", "--lora-rank", "8"), UserError, "describe the model with --model, --hf-config or --config"),
])
def test_cli_lora_errors(argv, error, match):
    with pytest.raises(error, match=match):
        run(parse(*argv))
