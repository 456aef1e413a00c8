"""DPO's reference in the planner (zerodp.planner.preference): what a live reference holds per rank under each
strategy, the extra forward of live and adapters-off, nothing for precomputed; the auto choices of a DPO config;
`zerodp plan --objective dpo`'s rows beside SFT. The held bytes are measured against the engines in
tests/distributed/test_planner_validation.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.conftest import TINY
from tests.unit.test_preference_train import preference_folder
from zerodp.config import load_config
from zerodp.planner import Cluster, Layout, Workload, estimate, gpu_preset, plan_for_training, preset
from zerodp.planner.buckets import bucket_bytes
from zerodp.planner.persistence import persistent_param_bytes
from zerodp.planner.preference import avoidable_bytes, precompute_flops, reference_bytes, reference_states

MODEL = preset("llama2-7b")
P = MODEL.params


def layout(strategy, precision="bf16", world=8, reference="live", **workload):
    cluster = Cluster(gpu=gpu_preset("h100"), gpus_per_node=world)
    w = Workload(2, 1024, precision, 1, objective="dpo", dpo_reference=reference, **workload)
    return Layout(strategy, cluster, w)


@pytest.mark.parametrize("strategy,precision,expected", [
    # the engine's parameters; DeepSpeed's fp32 master partition and start-up gradient buffers; ddp's buckets
    ("ddp", "bf16", {"params": 4 * P, "master": 0, "grads": 0, "buckets": 4 * P}),
    ("fsdp", "bf16", {"params": 4 * math.ceil(P / 8), "master": 0, "grads": 0, "buckets": 0}),
    ("zero1", "bf16", {"params": 2 * P, "master": 4 * math.ceil(P / 8), "grads": 4 * P, "buckets": 0}),
    ("zero2", "bf16", {"params": 2 * P, "master": 4 * math.ceil(P / 8), "grads": 0, "buckets": 0}),
    ("zero2", "fp32", {"params": 4 * P, "master": 4 * math.ceil(P / 8), "grads": 0, "buckets": 0}),
])
def test_a_live_reference_holds_what_the_engine_holds_of_a_model_it_sets_up(strategy, precision, expected):
    got = reference_states(MODEL, layout(strategy, precision), "live")
    assert got == {**expected, "offloaded": 0}
    assert avoidable_bytes(MODEL, layout(strategy, precision), "live") == sum(expected.values()) - expected["params"]


def test_zero3_shards_the_reference_and_keeps_its_gradient_partition_and_a_bucket():
    got = reference_states(MODEL, layout("zero3"), "live")
    # its partition, and the persistent parameters (norms) gathered whole after its first forward
    persistent = persistent_param_bytes(MODEL, layout("zero3"))
    assert persistent > 0 and got["params"] == 2 * math.ceil(P / 8) + persistent
    assert got["master"] == got["grads"] == 4 * math.ceil(P / 8)
    assert got["buckets"] == bucket_bytes(3, MODEL.hidden, P, "bf16", "fp32", False, None, MODEL.largest_param) > 0


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_the_reference_adds_its_bytes_and_a_forward_and_precomputed_adds_nothing(strategy):
    sft = estimate(MODEL, dataclasses.replace(layout(strategy, reference=None), workload=Workload(2, 1024)))
    live, off, pre = (estimate(MODEL, layout(strategy, reference=r)) for r in ("live", "adapters-off", "precomputed"))
    held = reference_bytes(MODEL, layout(strategy), "live")
    assert live.total_bytes - sft.total_bytes == live.reference_bytes == held
    assert live.reference_bytes > 0 and off.reference_bytes == pre.reference_bytes == 0
    assert off.total_bytes == pre.total_bytes == sft.total_bytes
    # a forward is a third of a full fine-tuning step's FLOPs
    assert live.compute_s == pytest.approx(sft.compute_s * 4 / 3) and off.compute_s == live.compute_s
    assert pre.compute_s == sft.compute_s and pre.reference_s == 0
    gathers = strategy in ("zero3", "fsdp")  # the reference's own all-gather per micro batch, forward only
    assert (live.comm_bytes - sft.comm_bytes == pytest.approx(7 / 8 * 2 * P, rel=1e-9)) if gathers else \
        live.comm_bytes == sft.comm_bytes


def test_offload_moves_the_references_master_and_partitions_to_the_host():
    both = dataclasses.replace(layout("zero3"), offload_optimizer=True, offload_params=True)
    got = reference_states(MODEL, both, "live")
    assert got["offloaded"] == 2 * math.ceil(P / 8) + 4 * math.ceil(P / 8) and got["master"] == 0
    assert got["params"] == persistent_param_bytes(MODEL, both)  # persistent parameters stay on the device
    e, alone = estimate(MODEL, both), estimate(MODEL, dataclasses.replace(both, workload=Workload(2, 1024)))
    assert e.offloaded_bytes - alone.offloaded_bytes == got["offloaded"]


def test_precomputing_costs_one_forward_over_the_data():
    assert precompute_flops(6e9, 1000) == 2e12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return preference_folder(tmp_path_factory.mktemp("pref") / "data")


def test_a_live_reference_is_planned_by_strategy_auto_and_an_auto_micro_batch(folder):
    cfg = load_config(None, TINY + [f"data.source={folder}", "data.packing=false", "train.objective=dpo",
                                    "strategy.name=auto", "train.micro_batch_size=auto"])
    plan = plan_for_training(cfg, 2, 64 * 2**30, "cpu")
    assert plan.choice is not None and plan.micro_batch % 2 == 0
    assert all(e.micro_batch % 2 == 0 for tried in plan.search.values() for e in tried)
    ddp = next(e for e in plan.estimates if e.strategy == "ddp")
    assert ddp.reference_bytes == 8 * cfg_params(cfg)


def cfg_params(cfg) -> int:
    from zerodp.models import param_count
    return param_count(cfg.model)


def parse(*argv):
    import argparse

    from zerodp.planner.cli import add_parser
    parser = argparse.ArgumentParser(prog="zerodp")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def test_cli_objective_dpo_prints_its_rows_beside_sft(capsys):
    import json

    from zerodp.planner.cli import run
    argv = ("--model", "llama2-7b", "--gpus", "8", "--hbm", "80GB")
    assert run(parse(*argv, "--objective", "dpo")) == 0
    out = capsys.readouterr().out
    assert ("objective: dpo (preference pairs, micro batches of whole pairs), dpo.reference=live: a frozen copy of "
            "the starting weights under the row's strategy (its bytes in 'refer'), a forward per micro batch") in out
    assert "step: micro batch 2 x 4096 tokens" in out and " refer " in out.splitlines()[6]
    assert "SFT vs DPO with dpo.reference=live (total GB per GPU" in out
    assert "strategy                                  SFT  fits    DPO  fits  refer  avoidable" in out
    # ddp's reference: fp32 weights and the reducer's fp32 buckets, 8 bytes a parameter
    assert any(line.startswith("ddp ") and line.split()[5] == f"{8 * P / 1e9:.1f}" for line in out.splitlines())
    assert run(parse(*argv, "--objective", "dpo", "--dpo-reference", "precomputed", "--json")) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["objective"] == "dpo" and got["dpo_reference"] == "precomputed"
    assert [e["name"] for e in got["sft"]] == [e["name"] for e in got["strategies"]]
    assert all(e["reference_bytes"] == 0 for e in got["strategies"])
    assert run(parse(*argv)) == 0
    out = capsys.readouterr().out
    assert " refer " not in out and "SFT vs DPO" not in out


@pytest.mark.parametrize("argv,message", [
    (("--dpo-reference", "live"), "--dpo-reference live is DPO's reference model, and this plan is sft; add "
                                  "--objective dpo"),
    (("--objective", "dpo", "--dpo-reference", "adapters-off"), "--dpo-reference adapters-off switches LoRA's "
                                                                "adapters off, and this plan has none"),
    (("--objective", "dpo", "--lora-rank", "8", "--dpo-reference", "live"), "with adapters the base with them off "
                                                                            "is the reference at no cost"),
    (("--objective", "dpo", "--micro-batch", "3"), "--objective dpo: micro batch 3 would split a preference pair"),
])
def test_cli_dpo_flags_that_cannot_apply_are_one_line(argv, message):
    from zerodp.errors import UserError
    from zerodp.planner.cli import run
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        run(parse("--model", "llama2-7b", *argv))


def test_the_end_of_run_lines_hold_the_live_reference_against_its_prediction(folder):
    import torch

    from zerodp.telemetry.comm import PlanCheck
    cfg = load_config(None, TINY + [f"data.source={folder}", "data.packing=false", "train.objective=dpo",
                                    "strategy.name=single"])
    check = PlanCheck(cfg, 1, 64 * 2**30, "cpu")
    params = cfg_params(cfg)
    assert check.estimate.reference_bytes == 4 * params  # single: the fp32 weights, no reducer
    compared = check.compare(None, {}, torch.device("cpu"), reference={"params": 4 * params + 40, "grads": 0})
    assert compared["reference"] == {"predicted": 4 * params, "measured": 4 * params + 40}
    assert "  DPO reference per rank: predicted 0.132 MiB, measured 0.132 MiB (+0.0%)" in check.report(compared)
