"""DeepSpeed ZeRO-1/2/3: the generated DeepSpeed config (pure), then on real processes (gloo, the real
engine): the plain AdamW reference, exact resume, activation checkpointing, the bf16 band, the
per-rank state `state_bytes` reports, and fp16's dynamic loss scale (resumed; exhausted at its minimum)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY
from tests.support.harness import run_distributed
from tests.support.reference import WEIGHT_TOLERANCE, reference_run
from zerodp.config import load_config
from zerodp.errors import UserError
from zerodp.models import param_count
from zerodp.strategies.zero import deepspeed_config

BF16_BAND = 0.01
"""Max |loss(bf16 ZeRO) - loss(fp32 reference)| over the 8 steps below; measured 0.0043 (docs/strategies.md)."""


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------------------
# The generated config (no processes)
# ---------------------------------------------------------------------------------------------------


def test_config_follows_zerodp_settings(tiny):
    cfg = load_config(None, tiny + ["train.precision=bf16", "strategy.bucket_size_mb=4", "optim.grad_clip=0.5",
                                    "strategy.overlap_comm=false", "strategy.offload_optimizer=true"])
    ds = deepspeed_config(cfg, stage=2, grad_accum_steps=2, world_size=3)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 12 == cfg.train.global_batch_size
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is True and ds["bf16"]["check_grad_overflow"] is False
    assert ds["fp16"]["enabled"] is False
    z = ds["zero_optimization"]
    assert z["stage"] == 2 and z["overlap_comm"] is False and z["contiguous_gradients"] is True
    assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 4 * 2**20 // 2  # elements of 2 bytes
    assert z["offload_optimizer"]["device"] == "cpu" and "offload_param" not in z
    assert "optimizer" not in ds and "scheduler" not in ds


def test_fp16_gets_dynamic_loss_scaling_and_zero3_offloads_params(tiny):
    cfg = load_config(None, tiny + ["train.precision=fp16", "strategy.offload_params=true"])
    ds = deepspeed_config(cfg, stage=3, grad_accum_steps=1, world_size=6)
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0  # 0 = dynamic
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_user_keys_deep_merge_over_generated(tiny):
    cfg = load_config(None, tiny + [
        "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0",
        "strategy.deepspeed.zero_optimization.overlap_comm=false",
        "strategy.deepspeed.communication_data_type=fp32",
        "strategy.deepspeed.train_micro_batch_size_per_gpu=2",  # equal to zerodp's value: accepted
        "strategy.deepspeed.bf16.enabled=false",
    ])
    ds = deepspeed_config(cfg, stage=3, grad_accum_steps=3, world_size=2)
    z = ds["zero_optimization"]
    assert z["stage3_param_persistence_threshold"] == 0 and z["overlap_comm"] is False
    # generated keys kept: ZeRO-3's reduce bucket hidden^2 = 1024, at least the largest parameter, the embedding
    assert z["stage"] == 3 and z["reduce_bucket_size"] == max(32 * 32, 256 * 32)
    assert ds["communication_data_type"] == "fp32"
    assert cfg.strategy.deepspeed["zero_optimization"] == {"stage3_param_persistence_threshold": 0,
                                                            "overlap_comm": False}  # input not mutated


@pytest.mark.parametrize("override, match", [
    ("train_micro_batch_size_per_gpu=4",
     r"strategy\.deepspeed\.train_micro_batch_size_per_gpu=4 contradicts zerodp's "
     r"train_micro_batch_size_per_gpu=2; remove the key and set train\.micro_batch_size"),
    ("gradient_accumulation_steps=1",
     r"gradient_accumulation_steps=1 contradicts zerodp's gradient_accumulation_steps=2; .*global_batch_size"),
    ("train_batch_size=64", r"train_batch_size=64 contradicts zerodp's train_batch_size=12; .*global_batch_size"),
    ("zero_optimization.stage=3",
     r"zero_optimization\.stage=3 contradicts zerodp's zero_optimization\.stage=2; .*strategy\.name"),
    ("bf16.enabled=true", r"bf16\.enabled=True contradicts zerodp's bf16\.enabled=False; .*train\.precision"),
    ("bfloat16.enabled=true", r"bfloat16\.enabled=True contradicts zerodp's bfloat16\.enabled=False"),
    ("fp16.enabled=true", r"fp16\.enabled=True contradicts zerodp's fp16\.enabled=False; .*train\.precision"),
    ("gradient_clipping=0.5",
     r"gradient_clipping=0\.5 contradicts zerodp's gradient_clipping=1\.0; .*optim\.grad_clip"),
    ("optimizer.type=Adam", r"strategy\.deepspeed\.optimizer is not supported: zerodp owns the optimizer; "
                            r"remove the key and set optim\.\*"),
    ("scheduler.type=WarmupLR", r"strategy\.deepspeed\.scheduler is not supported: .*optim\.lr"),
])
def test_contradicting_key_is_refused(tiny, override, match):
    cfg = load_config(None, tiny + [f"strategy.deepspeed.{override}"])
    with pytest.raises(UserError, match=match):
        deepspeed_config(cfg, stage=2, grad_accum_steps=2, world_size=3)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_params_needs_zero3(tiny, stage):
    cfg = load_config(None, tiny + ["strategy.offload_params=true"])
    with pytest.raises(UserError, match=rf"strategy\.offload_params=true needs parameter sharding, which zero{stage} "
                                        r"does not do; use strategy\.name=zero3"):
        deepspeed_config(cfg, stage=stage, grad_accum_steps=1, world_size=6)
    cfg = load_config(None, tiny + ["strategy.deepspeed.zero_optimization.offload_param.device=cpu"])
    with pytest.raises(UserError, match=rf"offload_param needs zero3, not zero{stage}"):
        deepspeed_config(cfg, stage=stage, grad_accum_steps=1, world_size=6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed's CPU accelerator is the one without fp16")
def test_fp16_on_cpu_is_refused(tiny):
    from deepspeed.accelerator import get_accelerator

    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy

    if get_accelerator().is_fp16_supported():  # DeepSpeed asks the CPU: AVX512-FP16 (Sapphire Rapids on) has it
        pytest.skip("this CPU has fp16 (DeepSpeed's cpu accelerator supports it here): there is nothing to refuse")

    cfg = load_config(None, tiny + ["train.precision=fp16"])
    with pytest.raises(UserError, match=r"train\.precision=fp16: DeepSpeed's cpu accelerator has no fp16 support; "
                                        r"use train\.precision=bf16"):
        make_strategy("zero2").setup(build_model(cfg.model, device="meta"),
                                     RunContext(cfg, 0, 1, 0, torch.device("cpu"), 6))


# ---------------------------------------------------------------------------------------------------
# Real processes
# ---------------------------------------------------------------------------------------------------

RESUME_BASE = TINY + ["train.global_batch_size=8", "optim.decay_steps=10", "checkpoint.every=3"]
BF16_RUN = TINY + ["train.global_batch_size=8", "train.max_steps=8"]
BF16_STATE = TINY + ["train.precision=bf16", "strategy.grad_reduce_dtype=bf16",  # DeepSpeedZeroOptimizer's states
                     "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every real-process run of this module, in two launches of 2 ranks rather than one per test (each
    launch costs every rank DeepSpeed's start-up). The first: per stage 6 uninterrupted steps and 3 with a
    checkpoint, the bf16 runs and `state_worker`. The second, a fresh process group: the resumes from step
    3, then the loss-scaler workers. {name: per-rank results}."""
    tmp = tmp_path_factory.mktemp("zero")
    runs = []
    for stage in ("zero1", "zero2", "zero3"):
        over = RESUME_BASE + [f"strategy.name={stage}", f"model.activation_checkpointing={stage == 'zero3'}"]
        runs += [
            {"overrides": over + ["train.max_steps=6", f"train.out_dir={tmp / stage / 'full'}"]},
            {"overrides": over + ["train.max_steps=3", f"train.out_dir={tmp / stage / 'part'}"]},
        ]
    resume = [{"overrides": r["overrides"][:-2] + ["train.max_steps=6", r["overrides"][-1]], "fresh": False}
              for r in runs[1::2]]
    bf16 = [{"overrides": BF16_RUN + [f"strategy.name={s}", "train.precision=bf16",
                                      f"train.out_dir={tmp / 'bf16' / s}"]}
            for s in ("zero1", "zero2", "zero3")]
    first = {"first": ("tests.support.workers:train_runs", {"runs": runs}),
             "bf16": ("tests.support.workers:train_runs", {"runs": bf16}),
             "states": ("tests.distributed.test_zero:state_worker", {"overrides": BF16_STATE})}
    second = {"resumed": ("tests.support.workers:train_runs", {"runs": resume}),
              "loss_scale": ("tests.distributed.test_zero:loss_scaler_worker",
                             {"overrides": TINY, "out_dir": str(tmp / "scaler")}),
              "min_scale": ("tests.distributed.test_zero:min_scale_worker", {"overrides": TINY})}
    out = {"tmp": tmp}
    for calls in (first, second):
        per_rank = run_distributed("tests.support.workers:several", 2, {"calls": [
            {"target": target, "kwargs": kwargs} for target, kwargs in calls.values()]})
        out.update({name: [rank[i] for rank in per_rank] for i, name in enumerate(calls)})
    return out


def test_zero_matches_reference_and_resumes_exactly(launches):
    """Per stage: 6 uninterrupted steps; 3 steps with a checkpoint; a fresh process group... resuming
    from step 3 to 6 must reproduce steps 4..6 bit for bit. zero3 runs with activation checkpointing."""
    first, resumed, tmp = launches["first"], launches["resumed"], launches["tmp"]
    ref_losses, ref_weights = reference_run(load_config(None, RESUME_BASE + ["train.max_steps=6"]))
    for i, stage in enumerate(("zero1", "zero2", "zero3")):
        full, part, again = first[0][2 * i], first[0][2 * i + 1], resumed[0][i]
        assert full["strategy"] == stage
        assert full["losses"] == pytest.approx(ref_losses, abs=1e-5), stage
        assert max_diff(full["weights"], ref_weights) < WEIGHT_TOLERANCE, stage
        assert max_diff(first[1][2 * i]["weights"], full["weights"]) == 0, "ranks disagree on the weights"
        assert part["losses"] == full["losses"][:3]
        assert again["losses"] == full["losses"][3:], stage  # exact: same bits as the uninterrupted run
        assert max_diff(again["weights"], full["weights"]) == 0, stage
    ckpt = tmp / "zero3" / "part" / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in (ckpt / "deepspeed").iterdir()) == [
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
    assert not (ckpt / "latest").exists()  # only zerodp's own `latest` points at checkpoints


def state_worker(overrides: list[str]) -> dict:
    """Per stage, the state_bytes of a ZeRO strategy after setup, between two accumulated micro-batches
    and after step()."""
    from zerodp.distributed.process_group import init_distributed
    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy

    env = init_distributed("cpu")
    out = {}
    for stage in ("zero1", "zero2", "zero3"):
        cfg = load_config(None, overrides + [f"strategy.name={stage}"])
        torch.manual_seed(0)
        model, strategy = build_model(cfg.model, device="meta"), make_strategy(stage)
        strategy.setup(model, RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 2))
        held = {"setup": strategy.state_bytes()}
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
        for i in range(2):
            with strategy.micro_step(is_last=i == 1):
                strategy.backward(strategy.model(x, x))
            if i == 0:
                held["accumulating"] = strategy.state_bytes()
        strategy.step(1e-3)
        held["step"] = strategy.state_bytes()
        out[stage] = held
    return out


def test_bf16_band_and_state_bytes(launches):
    results = launches["bf16"][0]
    ref_losses, _ = reference_run(load_config(None, BF16_RUN))
    assert [res["strategy"] for res in results] == ["zero1", "zero2", "zero3"]
    for res in results:
        gap = max(abs(a - b) for a, b in zip(res["losses"], ref_losses))
        assert 0 < gap < BF16_BAND, (res["strategy"], gap)  # 16-bit, so not identical; but close

    states = launches["states"][0]
    P, N = param_count(load_config(None, TINY).model), 2

    def near(value, expected):  # flat partitions are padded to alignment
        return expected <= value <= expected * 1.01 + 1024

    for stage, held in states.items():
        # mixed-precision Adam, K=12: fp32 master + exp_avg + exp_avg_sq, sharded by every stage
        assert held["setup"]["optim"] > 0 and near(held["step"]["optim"], 12 * P // N), (stage, held)
        assert held["step"]["buffers"] < 1024, (stage, held)
    for stage in ("zero1", "zero2"):  # 16-bit params replicated
        assert near(states[stage]["step"]["params"], 2 * P), states[stage]
    # ZeRO-1 keeps full 16-bit gradients until the boundary; ZeRO-2/3 reduce-scatter them as they come
    assert near(states["zero1"]["accumulating"]["grads"], 2 * P), states["zero1"]
    assert states["zero2"]["accumulating"]["grads"] < 2 * P, states["zero2"]
    assert near(states["zero3"]["step"]["params"], 2 * P // N), states["zero3"]  # 16-bit params sharded


def loss_scaler_worker(overrides: list[str], out_dir: str) -> dict:
    """Per stage: train 5 steps under DeepSpeed's real DynamicLossScaler (started at 2**10, doubling
    every 2 clean steps; powers of two keep fp32 exact), save, then load into a fresh engine whose
    scaler starts over. DeepSpeed's CPU accelerator has no fp16, so the scaler is swapped in directly."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from zerodp.distributed.process_group import init_distributed
    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy

    env = init_distributed("cpu")
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    out = {}
    for stage in ("zero2", "zero3"):  # zero1 shares zero2's optimizer class
        cfg = load_config(None, overrides + [f"strategy.name={stage}"])
        engines = []
        for _ in range(2):
            torch.manual_seed(0)
            strategy = make_strategy(stage)
            strategy.setup(build_model(cfg.model, device="meta"),
                           RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 1))
            strategy.model.optimizer.loss_scaler = DynamicLossScaler(
                init_scale=2**10, scale_window=2, min_scale=1, delayed_shift=2, consecutive_hysteresis=False,
                dtype=torch.float32)
            strategy.model.optimizer.dynamic_loss_scale = True
            engines.append(strategy)
        first, second = engines
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size),
                          generator=torch.Generator().manual_seed(1))
        for _ in range(5):
            with first.micro_step(is_last=True):
                first.backward(first.model(x, x))
            first.step(1e-3)
        trained = {k: getattr(first.model.optimizer.loss_scaler, k) for k in keys}
        ckpt = Path(out_dir) / stage
        first.save(ckpt)
        second.load(ckpt)
        out[stage] = {"trained": trained, "resumed": {k: getattr(second.model.optimizer.loss_scaler, k) for k in keys}}
    return out


def test_dynamic_loss_scale_survives_resume(launches):
    results = launches["loss_scale"]
    for stage, got in results[0].items():
        assert got["trained"]["cur_scale"] == 2**12 and got["trained"]["cur_iter"] == 5, (stage, got)
        assert got["resumed"] == got["trained"], stage
    assert results[1] == results[0]


def min_scale_worker(overrides: list[str]) -> dict:
    """Per stage: DeepSpeed's real DynamicLossScaler, built by DeepSpeed's own code from the fp16 section
    zerodp generates (start 2**16, halve per overflow, minimum 1), swapped into the engine as in
    `loss_scaler_worker` (the CPU accelerator has no fp16); every step's loss is multiplied by inf, so the
    gradients overflow at any scale, until the scaler gives up at its minimum."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    from zerodp.distributed.process_group import init_distributed
    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy

    env = init_distributed("cpu")
    fp16 = deepspeed_config(load_config(None, overrides + ["train.precision=fp16"]), 2, 1, env.world_size)["fp16"]
    out = {}
    for stage in ("zero2", "zero3"):  # zero1 shares zero2's optimizer class
        cfg = load_config(None, overrides + [f"strategy.name={stage}"])
        strategy = make_strategy(stage)
        strategy.setup(build_model(cfg.model, device="meta"),
                       RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 1))
        scaler = CreateLossScaler(torch.half, 0, True, DeepSpeedFP16Config(**fp16).dynamic_loss_scale_args())
        strategy.model.optimizer.loss_scaler = scaler
        strategy.model.optimizer.dynamic_loss_scale = True
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size),
                          generator=torch.Generator().manual_seed(1))
        scales = []
        for _ in range(30):
            scales.append(scaler.cur_scale)
            with strategy.micro_step(is_last=True):
                strategy.backward(strategy.model(x, x) * float("inf"))
            try:
                strategy.step(1e-3)
            except UserError as e:
                out[stage] = {"error": str(e), "type": type(e).__name__, "scales": scales}
                break
    return out


def test_fp16_loss_scale_at_minimum_is_one_line_error(launches):
    """DeepSpeed's scaler raises a bare Exception when it overflows at min_loss_scale; zerodp turns it
    into a UserError (one line from the CLI, exit 2) saying what happened and what to change."""
    results = launches["min_scale"]
    for stage, got in results[0].items():
        assert got["scales"] == [2.0**k for k in range(16, -1, -1)], stage  # halved on each of 16 overflows
        assert got["type"] == "LossScaleExhausted" and "\n" not in got["error"], got
        assert got["error"] == (
            "train.precision=fp16: step 17 overflowed again with the loss scale already at its minimum 1 "
            "(16 steps skipped for overflow so far): the fp16 gradients overflow at any scale, so DeepSpeed "
            "stops the run; use train.precision=bf16 (or fp32), or lower optim.lr"), stage
    assert set(results[0]) == {"zero2", "zero3"}
    assert results[1] == results[0]  # every rank stops at the same step with the same message


def test_a_build_lock_left_by_a_stopped_launch_is_one_line_not_a_hang(tmp_path):
    """The zero2 + offload_optimizer hang on CPU ranks: a launch stopped while DeepSpeed compiled an op (the
    first offload launch builds cpu_adam for a minute or more; a time limit kills it) leaves torch's lock file
    in the op's build folder, and every later launch that loads the op polls for that file without end and
    without a word. Start-up now refuses in one line, naming the file, and leaves it where it is."""
    from tests.distributed.test_cli import one_line_error
    from tests.support.harness import ROOT, base_env

    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")
    lock = tmp_path / "extensions" / "cpu_adam" / "lock"  # made 20 minutes ago: past deepspeed_ops.STALE_LOCK_S
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    os.utime(lock, (time.time() - 1200, time.time() - 1200))
    r = subprocess.run([sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", *TINY, "strategy.name=zero2",
                        "strategy.offload_optimizer=true", "train.max_steps=1", f"train.out_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=90)  # before: no end
    one_line_error(r, r"^zerodp: error: strategy.name=zero2 with strategy.offload_optimizer=true: DeepSpeed's "
                      r"build of its C\+\+ op cpu_adam is locked by .*/lock \(made 20 min ago\), "
                      r"and every rank would wait for it without end: .* delete the file \(rm .*/lock\) and launch "
                      r"again$")
    assert lock.exists() and not (tmp_path / "run").exists()


def test_a_younger_build_lock_is_waited_for_and_said(tmp_path, capsys, monkeypatch):
    """A lock younger than STALE_LOCK_S is another launch's build or load in progress (a load of a built op
    holds it for a second or so): waited for, saying so once, not refused."""
    import threading

    from zerodp.strategies.deepspeed_ops import wait_for_locks

    monkeypatch.delenv("RANK", raising=False)
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    os.utime(lock, (time.time() - 10, time.time() - 10))
    threading.Timer(1.0, lock.unlink).start()  # the other launch's build ends
    wait_for_locks("strategy.name=zero2", ["cpu_adam"], tmp_path)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"zerodp: waiting for another launch's build of DeepSpeed's op cpu_adam (its lock {lock}, made 10 s ago; "
        f"one older than 10 min is taken for a stopped launch's)"), err
