"""The planner optimises the whole step: the choice by predicted step time (and reasons that agree with the
table), the micro batch x checkpointing x strategy search at a fixed global batch, the hybrid and ZeRO++
rows across nodes with their inter-node traffic, train.micro_batch_size=auto, and their errors."""

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.config import Config, ConfigError, ModelConfig, load_config
from zerodp.errors import UserError
from zerodp.planner import Cluster, Workload, choose, gpu_preset, plan_for_training, preset
from zerodp.planner.choose import TIE, pick
from zerodp.planner.cli import add_parser, run
from zerodp.planner.units import seconds

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9


def plan_of(*argv):
    parser = argparse.ArgumentParser(prog="zerodp")
    add_parser(parser.add_subparsers(dest="command"))
    from zerodp.planner.cli import build
    return build(parser.parse_args(["plan", *argv]))


def reasons_by_row(plan) -> dict[str, str]:
    names = {e.name for e in plan.estimates}
    return {r.split(": ", 1)[0]: r.split(": ", 1)[1] for r in plan.reasons if r.split(": ", 1)[0] in names}


def check_reasons_agree_with_the_table(plan):
    """Every fitting row's reason quotes its own predicted step and the choice's, and says slower only when
    it is slower by more than TIE; no reason claims a faster row lost for sending more."""
    chosen, why = plan.chosen, reasons_by_row(plan)
    for e in plan.estimates:
        if e.name == chosen.name or not e.fits:
            continue
        text = why[e.name]
        assert f"predicted {seconds(e.step_s)} per step" in text, text
        assert "hides fully" not in text
        slower = e.tokens_per_s_per_gpu * (1 + TIE) < chosen.tokens_per_s_per_gpu
        assert ("slower" in text) == slower or "offloading" in text, text
        if not slower and not (e.offload_optimizer or e.offload_params):
            assert "simpler" in text, text


def test_llama3_8b_on_8x80GB_chooses_the_fastest_row_and_says_why():
    plan = plan_of("--model", "llama3-8b", "--gpus", "8", "--hbm", "80GB")
    fitting = [e for e in plan.estimates if e.fits and not e.offload_optimizer]
    fastest = max(e.tokens_per_s_per_gpu for e in fitting)
    assert plan.chosen.tokens_per_s_per_gpu * (1 + TIE) >= fastest
    assert plan.choice_name == "fsdp"  # zero3 ties it; fsdp is the simpler
    rows = {e.name: e for e in plan.estimates}
    # zero1 in bf16 with fp32 accumulation is DeepSpeed's BF16_Optimizer: bf16 and fp32 gradients of the
    # whole model, 6P, beside 2P of weights and 12P/8 of master and moments: over the 72 GB usable
    params = preset("llama3-8b").params
    assert rows["zero1"].grads_bytes == pytest.approx(6 * params, rel=1e-3) and not rows["zero1"].fits
    assert rows["zero1"].step_s > 1.05 * rows["fsdp"].step_s  # its exposed all-gather
    assert plan.reasons[0].startswith("Choice: fsdp with activation checkpointing off: 54.0 GB of 80.0 GB")
    assert "the fastest predicted step that fits" in plan.reasons[0]
    check_reasons_agree_with_the_table(plan)


def test_offload_rows_only_when_nothing_else_fits():
    rows = choose(preset("llama2-7b"), Cluster(gpu=gpu_preset("h100"), gpus_per_node=8), Workload(1, 4096)).estimates
    offload = [r for r in rows if r.offload_optimizer]
    assert offload and all(r.fits for r in offload)
    assert not pick(rows).offload_optimizer
    only_offload = [r for r in rows if r.offload_optimizer or not r.fits]
    assert pick(only_offload).offload_optimizer


def test_70b_on_4_ethernet_nodes_shows_hybrid_and_zeropp_and_picks_by_time(capsys):
    argv = ("--model", "llama3-70b", "--gpus", "8", "--nodes", "4", "--interconnect", "ethernet",
            "--global-batch", "512", "--seq-len", "4096")
    plan = plan_of(*argv)
    rows = {e.name: e for e in plan.estimates}
    assert {"fsdp+hybrid", "zero3+zero++"} <= set(rows)
    for name in ("fsdp", "zero3", "fsdp+hybrid", "zero3+zero++"):
        assert rows[name].inter_node_bytes > 0
    fitting = [e for e in plan.estimates if e.fits and not e.offload_optimizer]
    assert plan.chosen.tokens_per_s_per_gpu * (1 + TIE) >= max(e.tokens_per_s_per_gpu for e in fitting)
    # fp32 gradient reduction (the default) doubles ZeRO-3's gradient shard, 4P/32, and its reduce bucket:
    # ZeRO++'s extra secondary copy then leaves it over the 72 GB usable, and fsdp is the fastest that fits
    fastest = min((r for r in rows.values() if r.fits), key=lambda r: r.step_s)
    assert not rows["zero3+zero++"].fits and plan.choice_name == fastest.name
    # the slow link still makes it the fastest predicted step of the fully sharded rows
    assert rows["zero3+zero++"].step_s < min(rows[n].step_s for n in ("fsdp", "zero3", "fsdp+hybrid"))
    # the slow link decides: ZeRO++ sends 4x less across nodes than ZeRO-3 (DeepSpeed's figure) at one micro batch
    # with zero3's gradients reduced in 16 bits, as DeepSpeed's figure is (fp32 reduction, the default,
    # sends more across nodes, so the ratio grows)
    def zeropp_ratio(p):
        r = {e.name: e for e in p.estimates}
        same = [e for e in p.search["zero3"] if e.micro_batch == r["zero3+zero++"].micro_batch
                and e.activation_checkpointing == r["zero3+zero++"].activation_checkpointing]
        return same[0].inter_node_bytes / r["zero3+zero++"].inter_node_bytes

    bf16 = choose(preset("llama3-70b"), plan.cluster, dataclasses.replace(plan.workload, grad_reduce_dtype="bf16"),
                  global_batch=512)
    # (4.3 here: the int4 all-to-all across nodes is over 4 nodes, (4-1)/4, the flat ring's over 32 GPUs)
    assert 3.5 < zeropp_ratio(bf16) < 4.5, zeropp_ratio(bf16)
    assert zeropp_ratio(plan) > zeropp_ratio(bf16)
    # hpZ's secondary partition: 2P/8 bytes more than zero3's states
    assert rows["zero3+zero++"].secondary_bytes == 2 * -(-preset("llama3-70b").params // 8)
    # hybrid fsdp shards over the node's 8 GPUs only: 16P/8
    assert rows["fsdp+hybrid"].model_states_bytes == pytest.approx(16 * preset("llama3-70b").params / 8, rel=1e-6)
    check_reasons_agree_with_the_table(plan)
    assert run(_ns(*argv, "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["global_batch"] == 512 and out["choice"] == plan.choice_name
    assert {t["micro_batch"] for t in out["search"]["zero3"]} == {1, 2, 4, 8, 16}
    assert all(t["grad_accum_steps"] * t["micro_batch"] == 16 for t in out["search"]["fsdp"])
    # strategy: auto never runs the approximate row
    auto = choose(preset("llama3-70b"), plan.cluster, plan.workload, global_batch=512, exact_only=True)
    assert auto.choice_name != "zero3+zero++"


def test_no_hybrid_rows_on_one_node():
    plan = plan_of("--model", "llama3-8b", "--gpus", "8")
    assert not {"fsdp+hybrid", "zero3+zero++"} & {e.name for e in plan.estimates}
    assert all(e.inter_node_bytes == 0 for e in plan.estimates)


def test_search_picks_the_micro_batch_with_the_most_tokens_per_s_that_fits():
    # over PCIe zero3's per-micro-batch traffic is not hidden: the micro batch changes the step time
    m, c = preset("llama2-7b"), Cluster(gpu=gpu_preset("h100"), gpus_per_node=8, interconnect="pcie")
    plan = choose(m, c, Workload(1, 4096), global_batch=256)
    for e in plan.estimates:
        tried = plan.search[e.name]
        assert {t.micro_batch for t in tried} == {1, 2, 4, 8, 16, 32}
        assert all(t.micro_batch * t.grad_accum_steps == 32 for t in tried)
        fit = [t for t in tried if t.fits]
        if fit:
            assert e.fits and e.tokens_per_s_per_gpu >= max(t.tokens_per_s_per_gpu for t in fit) * 0.995
    # zero3 gathers per micro batch: fewer, larger micro batches send less and the search takes the largest
    z3 = next(e for e in plan.estimates if e.name == "zero3")
    # (here with checkpointing: without it only micro batch 1 fits, and its 32 gathers cost more than recomputing)
    ac = z3.activation_checkpointing
    same_ac = [t for t in plan.search["zero3"] if t.fits and t.activation_checkpointing == ac]
    assert z3.micro_batch == max(t.micro_batch for t in same_ac)
    one = [t for t in plan.search["zero3"] if t.micro_batch == 1 and t.activation_checkpointing == ac][0]
    assert one.comm_bytes > 10 * z3.comm_bytes and one.step_s > 2 * z3.step_s  # 16 gathers per step, not 2
    # checkpointing on only where it buys a larger micro batch that is faster, or is needed
    assert plan.reasons[1].startswith("Micro batch ")
    check_reasons_agree_with_the_table(plan)


def test_search_turns_checkpointing_on_when_no_micro_batch_fits_without_it():
    plan = choose(preset("llama2-7b"), Cluster(gpu=gpu_preset("h100"), gpus_per_node=2), Workload(1, 4096),
                  global_batch=16)
    assert plan.choice is not None and plan.activation_checkpointing
    assert not any(t.fits for t in plan.search[plan.choice_name] if not t.activation_checkpointing)
    # selective at micro batch 1 (~3% more compute) beats full's micro batch 4 (+33%)
    assert plan.activation_checkpointing == "selective"
    assert ("checkpointing selective; off: no micro batch fits; full: micro batch 4 at most, 6,438 tokens/s per GPU"
            in plan.reasons[1])


@pytest.mark.parametrize("argv,message", [
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "100"],
     r"^--global-batch 100 does not split over 8 GPUs: no micro batch divides 12.5 sequences per GPU; use a "
     r"multiple of 8 such as 104, or a GPU count that divides it \(2, 4, 5, 10\)$"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "64", "--grad-accum", "2"],
     r"^--grad-accum follows from --global-batch"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "64", "--micro-batch", "3"],
     r"^--micro-batch 3 does not divide 8 sequences per GPU \(--global-batch 64 over 8 GPUs\)"),
    (["--model", "gpt2", "--global-batch", "0"], r"^--global-batch 0: sequences per optimizer step must be"),
])
def test_search_errors(argv, message):
    with pytest.raises(UserError, match=message):
        plan_of(*argv)


def test_nothing_fits_at_micro_batch_1_says_what_would():
    plan = plan_of("--model", "llama3-70b", "--gpus", "8", "--global-batch", "64", "--cpu-ram", "256GB")
    assert plan.choice is None
    assert plan.suggestion.startswith("Smallest that fits: ")
    assert "does not fit even at micro batch 1" in reasons_by_row(plan)["zero3"]
    off = plan_of("--model", "llama3-70b", "--gpus", "8", "--nodes", "64", "--global-batch", "512",
                  "--seq-len", "8192", "--activation-checkpointing", "off")
    assert off.choice is None and "activation checkpointing full" in off.suggestion


def test_a_given_micro_batch_with_a_global_batch_only_sets_the_accumulation():
    plan = plan_of("--model", "gpt2", "--gpus", "8", "--global-batch", "64", "--micro-batch", "2")
    assert plan.global_batch is None and plan.workload.grad_accum_steps == 4
    assert all(e.micro_batch == 2 for e in plan.estimates)


# --- train.micro_batch_size: auto --------------------------------------------------------------------

def test_config_accepts_auto_and_refuses_other_words(tmp_path):
    assert load_config(None, ["train.micro_batch_size=auto"]).train.micro_batch_size == "auto"
    assert load_config(None, ["train.micro_batch_size=4"]).train.micro_batch_size == 4
    with pytest.raises(ConfigError, match=r"train.micro_batch_size in .* must be an integer or auto, got 'big'"):
        load_config(None, ["train.micro_batch_size=big"])


def test_plan_for_training_with_auto_searches_and_keeps_a_given_strategy():
    cfg = Config()
    cfg.model = ModelConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024)
    cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.train.precision = 480, "auto", "bf16"
    plan = plan_for_training(cfg, 8, 80 * GB, "NVIDIA H100 80GB HBM3")
    assert plan.micro_batch and 60 % plan.micro_batch == 0 and plan.chosen.grad_accum_steps * plan.micro_batch == 60
    only = plan_for_training(cfg, 8, 80 * GB, "NVIDIA H100 80GB HBM3", strategy="zero2")
    assert [e.name for e in only.estimates] == ["zero2"] and only.choice == "zero2"
    cfg.train.global_batch_size = 100
    with pytest.raises(UserError, match=r"^train.global_batch_size=100 does not split over 8 GPUs"):
        plan_for_training(cfg, 8, 80 * GB, "NVIDIA H100 80GB HBM3")


def test_plan_config_with_auto(capsys):
    assert run(_ns("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "--gpu", "h100",
                   "train.micro_batch_size=auto")) == 0
    out = capsys.readouterr().out
    assert "step: global batch 480 sequences x 1024 tokens, micro batch searched among the divisors of 60" in out
    assert re.search(r"^Micro batch \d+ of the divisors of 60 sequences per GPU", out, re.M)


def _ns(*argv):
    parser = argparse.ArgumentParser(prog="zerodp")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def test_train_dry_run_with_auto_prints_the_micro_batch(tmp_path):
    """The issue's command, as a newcomer runs it (its data file does not exist here: the choice is printed
    before the data check stops it), then with the built-in corpus to the end."""
    r = subprocess.run([sys.executable, "-m", "zerodp", "train", "configs/gpt2-124m.yaml",
                        "train.micro_batch_size=auto", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    line = r.stdout.splitlines()[0]
    assert re.match(r"zerodp: train.micro_batch_size=auto: micro batch \d+ x \d+ accumulation on 1 rank\(s\) "
                    r"\(global batch 480\) under single, activation checkpointing (on|off), predicted [\d,]+ "
                    r"tokens/s per device: Micro batch", line), line
    micro, accum = map(int, re.search(r"micro batch (\d+) x (\d+) accumulation", line).groups())
    assert micro * accum == 480


def test_training_with_auto_runs_the_micro_batch_it_prints(tmp_path):
    from tests.distributed.test_first_day import train

    r = train(tmp_path / "run", "train.max_steps=1", "train.micro_batch_size=auto")
    out = r.stdout + r.stderr
    line = next(x for x in out.splitlines() if "train.micro_batch_size=auto: micro batch" in x)
    micro, accum = map(int, re.search(r"micro batch (\d+) x (\d+) accumulation", line).groups())
    assert micro * accum == 4  # the global batch of tests.distributed.test_first_day.SMALL, on one process
    assert f"global batch 4 = micro {micro} x world 1 x accum {accum}" in out
    resolved = load_config(tmp_path / "run" / "config.yaml")
    assert resolved.train.micro_batch_size == micro


def test_auto_where_even_micro_batch_1_does_not_fit_says_what_would():
    import torch

    from zerodp.trainer.loop import resolve_strategy

    cfg = load_config(ROOT / "configs/tiny.yaml", ["model.n_layer=48", "model.n_embd=4096", "model.n_head=32",
                                                  "train.micro_batch_size=auto", "strategy.name=ddp"])
    with pytest.raises(UserError, match=r"^train.micro_batch_size=auto: nothing fits in [\d.]+ GB per rank on 2 "
                                        r"rank\(s\)\. (Smallest that fits|It would fit|No number of CPU ranks)"):
        resolve_strategy(cfg, 2, torch.device("cpu"), 2)
    small = load_config(ROOT / "configs/tiny.yaml", ["train.micro_batch_size=auto", "strategy.name=ddp"])
    resolved, plan = resolve_strategy(small, 2, torch.device("cpu"), 2)
    assert resolved.strategy.name == "ddp" and isinstance(resolved.train.micro_batch_size, int)
    assert resolved.train.global_batch_size % (2 * resolved.train.micro_batch_size) == 0


def test_zeropp_settings_on_one_node_are_refused_by_the_planner():
    with pytest.raises(UserError, match=r"^strategy.hpz_partition_size=8, strategy.quantized_weights=true: ZeRO\+\+ "
                                        r"cuts the traffic between nodes, and this plan has one node; plan it with "
                                        r"--nodes N \(N > 1\), or remove them$"):
        plan_of("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "strategy.name=zero3",
                "strategy.hpz_partition_size=8", "strategy.quantized_weights=true")
    two = plan_of("--config", "configs/gpt2-124m.yaml", "--gpus", "8", "--nodes", "2", "strategy.name=zero3",
                  "strategy.hpz_partition_size=8", "train.micro_batch_size=auto")
    assert "zero3+zero++" in {e.name for e in two.estimates}


def test_a_config_with_some_of_zeropp_is_estimated_as_it_runs():
    from zerodp.planner.training import estimate_for_run

    cfg = load_config(ROOT / "configs/gpt2-124m.yaml", ["strategy.name=zero3", "strategy.hpz_partition_size=8",
                                                      "train.global_batch_size=384"])
    hpz = estimate_for_run(cfg, 16, 80 * GB, "NVIDIA H100 80GB HBM3", gpus_per_node=8)
    plain = load_config(ROOT / "configs/gpt2-124m.yaml", ["strategy.name=zero3", "train.global_batch_size=384"])
    flat = estimate_for_run(plain, 16, 80 * GB, "NVIDIA H100 80GB HBM3", gpus_per_node=8)
    assert hpz.name == "zero3+hpz" and hpz.exact and hpz.secondary_bytes > 0
    assert hpz.inter_node_bytes <= flat.inter_node_bytes and hpz.comm_bytes <= flat.comm_bytes
