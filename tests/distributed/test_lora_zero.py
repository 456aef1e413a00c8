"""LoRA under DeepSpeed ZeRO-1/2/3 (issue 41): the real engine on 2 and 3 CPU processes trains the adapters
the single-process AdamW reference trains, and keeps the base as it found it.

On a prepared folder with a loss mask (documents whose share of targets runs from none to all) and a
global batch of 12 (world 2: 3 accumulated micro batches of 2; world 3: 2), each run follows the
reference (tests.support.reference: plain torch AdamW over the adapters, the whole global batch at once),
the adapters' dropout on:
per-step losses and final adapters within test_equivalence's 1e-5, the frozen base weights bit-identical to
the seeded start. World 2 runs zero1 (gpt2, tied head), zero2 and zero3 (llama); world 3 zero2 (gpt2) and
zero3 (llama), and resumes the world-2 zero3 checkpoint of step 2 under zero1 (another strategy, another
world size, through zerodp.convert's DeepSpeed reader) to continue the uninterrupted trajectory.

The checkpoints hold the adapters and their AdamW state only (exclude_frozen_parameters, and gpt2's tied
frozen head left out too; the world-3 zero3 run saves in the background): zerodp.convert's DeepSpeed
reader lists the adapters' names alone and the folder is smaller than the base's fp32 bytes.
model.init_from loads a base model's weights into zero3's partitions (the adapters keep their initial
values). In bf16 (`states_worker`) the frozen base is held in 16 bits, outside the optimizer (DeepSpeed's
ZeRO optimizer and, for zero1 with fp32 gradients, its BF16_Optimizer), with no gradient, sharded by
zero3, and state_bytes counts just that.

The resume needs the trainer's LoRA start check (a checkpoint without the base is accepted), which comes
with the single/ddp/fsdp work (zerodp/trainer/start.py); `resume_worker` reports a refusal as its message.
"""

from __future__ import annotations

import functools
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import TINY
from tests.distributed.test_zero_counters import saved_counters
from tests.support.harness import run_distributed
from tests.support.reference import LLAMA, reference_run
from tests.support.sampler_workers import write_prepared
from zerodp.config import load_config
from zerodp.convert.deepspeed_ckpt import DeepSpeedSource
from zerodp.data.batches import TokenBatches, load_tokens
from zerodp.models import arch_of, build_model, param_count
from zerodp.models.lora_spec import adapter_count, adapter_shapes, is_adapter, lora_spec

TOLERANCE = 1e-5  # tests/distributed/test_equivalence.py's, for every ZeRO stage
STEPS, MICRO, GLOBAL = 4, 2, 12
# the adapters' dropout on: keyed by the global row, the same masks under every stage (zerodp.models.dropout)
GPT2 = ["model.lora.rank=4", "model.lora.dropout=0.1"]  # every linear layer of the blocks (all-linear)
LLAMA_LORA = LLAMA + ["model.lora.rank=4", "model.lora.alpha=16", "model.lora.targets=[q_proj, v_proj, down_proj]",
                      "model.lora.dropout=0.1"]
MODELS = {"gpt2": GPT2, "llama": LLAMA_LORA}
RUNS = {2: [("gpt2", "zero1"), ("llama", "zero2"), ("llama", "zero3")], 3: [("gpt2", "zero2"), ("llama", "zero3")]}
RESUMED = ("llama", "zero3", 2, "zero1", 3)  # (model, strategy, world) of steps 1-2 -> (strategy, world) of 3-4


def overrides(data, model: str, out_dir) -> list[str]:
    return TINY + MODELS[model] + [
        f"data.source={data}", f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}",
        f"train.max_steps={STEPS}", "optim.lr=1e-3", "optim.min_lr=1e-4", f"train.out_dir={out_dir}"]


def states_worker(overrides: list[str]) -> dict:
    """Per stage, in bf16: set up the strategy, one accumulated step, and report what it holds: state_bytes,
    the frozen base's dtypes, gradients and ZeRO-3 partitions, and the parameters in DeepSpeed's optimizer."""
    from zerodp.distributed.process_group import init_distributed
    from zerodp.strategies import RunContext, make_strategy

    env = init_distributed("cpu")
    out = {}
    # zero1 twice: bf16 gradients (DeepSpeedZeroOptimizer) and fp32 accumulation (DeepSpeed's BF16_Optimizer)
    for key, stage, extra in (("zero1", "zero1", []), ("zero2", "zero2", []), ("zero3", "zero3", []),
                              ("zero1-fp32-grads", "zero1", ["strategy.grad_reduce_dtype=fp32"])):
        cfg = load_config(None, overrides + [f"strategy.name={stage}"] + extra)
        torch.manual_seed(0)
        strategy = make_strategy(stage)
        strategy.setup(build_model(cfg.model, device="meta"),
                       RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 2))
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size),
                          generator=torch.Generator().manual_seed(1))
        for i in range(2):
            with strategy.micro_step(is_last=i == 1):
                strategy.backward(strategy.model(x, x))
        strategy.step(1e-3)
        frozen = {n: p for n, p in strategy.module.named_parameters() if not p.requires_grad}
        zero_opt = strategy.model.optimizer
        groups = next(getattr(zero_opt, a) for a in ("bit16_groups", "fp16_groups", "bf16_groups")
                      if hasattr(zero_opt, a))
        in_optimizer = {id(p) for g in groups for p in g}
        out[key] = {
            "optimizer": type(zero_opt).__name__,
            "held": strategy.state_bytes(),
            "frozen": len(frozen),
            "frozen_dtypes": sorted({str(getattr(p, "ds_tensor", p).dtype) for p in frozen.values()}),
            "frozen_in_optimizer": sum(id(p) in in_optimizer for p in frozen.values()),
            "frozen_grads": sum(p.grad is not None for p in frozen.values()),
            "frozen_partition": sum(p.ds_tensor.numel() for p in frozen.values()) if stage == "zero3" else None,
            "trained_in_optimizer": sum(id(p) in in_optimizer for p in strategy.module.parameters() if p.requires_grad),
        }
    return out


def resume_worker(runs: list[dict]) -> list:
    """train_runs, but a UserError (a resume the start-up refuses) comes back as its message."""
    from tests.support.workers import train_runs
    from zerodp.errors import UserError

    try:
        return train_runs(runs)
    except UserError as e:
        return [{"error": str(e)}]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """Every run of this module: one launch of 2 ranks (the trained runs, `states_worker`, the init_from
    run), one of 3 (its runs and the resume). {"w2", "w3", "states", "init", "resumed"}: rank 0's results;
    "tmp", "data", "base" (the init_from weights)."""
    tmp = tmp_path_factory.mktemp("lora_zero")
    documents = np.random.default_rng(41).integers(3, 46, size=400).tolist()
    data = write_prepared(tmp / "documents", documents, documents[:40], targets=[0.0, 1.0, 0.05, 0.6, 0.0])
    # a base model other than the seeded one, for model.init_from: llama's base weights at another seed
    base = {n: p.detach().clone() for n, p in build_model(load_config(None, TINY + LLAMA).model, 7).named_parameters()}
    save_file(base, tmp / "base.safetensors")
    runs = {w: [{"overrides": overrides(data, m, tmp / f"{m}-{s}-w{w}")
                 + (["checkpoint.every=2", "checkpoint.keep_last=2"] if s == "zero3" or m == "gpt2" else [])}
                for m, s in RUNS[w]] for w in RUNS}
    init = [{"overrides": overrides(data, "llama", tmp / "init") + [
        "strategy.name=zero3", "train.max_steps=2", f"model.init_from={tmp / 'base.safetensors'}"]}]
    for w in RUNS:
        for run, (_, s) in zip(runs[w], RUNS[w]):
            run["overrides"].append(f"strategy.name={s}")
    runs[3][1]["overrides"].append("checkpoint.async_save=true")  # zerodp/strategies/zero_snapshot.py's save
    states = TINY + LLAMA_LORA + ["train.precision=bf16", "strategy.grad_reduce_dtype=bf16",
                                  "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0"]
    out = {"tmp": tmp, "data": data, "base": base}
    w2 = run_distributed("tests.support.workers:several", 2, {"calls": [
        {"target": "tests.support.workers:train_runs", "kwargs": {"runs": runs[2]}},
        {"target": "tests.distributed.test_lora_zero:states_worker", "kwargs": {"overrides": states}},
        {"target": "tests.support.workers:train_runs", "kwargs": {"runs": init}}]})
    out["w2"], out["states"], out["init"] = w2[0][0], w2[0][1], w2[0][2][0]
    # the world-2 zero3 run's step-2 checkpoint, copied to a run folder of its own, resumed at world 3 under zero1
    model, strategy, world, later, later_world = RESUMED
    resumed = tmp / "resumed"
    source = tmp / f"{model}-{strategy}-w{world}" / "checkpoints"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    resume = [{"overrides": overrides(data, model, resumed) + [f"strategy.name={later}", "checkpoint.every=2"],
               "fresh": False}]
    w3 = run_distributed("tests.support.workers:several", later_world, {"calls": [
        {"target": "tests.support.workers:train_runs", "kwargs": {"runs": runs[3]}},
        {"target": "tests.distributed.test_lora_zero:resume_worker", "kwargs": {"runs": resume}}]})
    out["w3"], out["resumed"] = w3[0][0], w3[0][1][0]
    return out


@functools.cache
def reference(data: str, model: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference_run(load_config(None, overrides(data, model, "/nonexistent") + [f"train.max_steps={steps}"]))


def initial(model: str) -> dict[str, torch.Tensor]:
    """The seeded initial weights every run starts from."""
    cfg = load_config(None, TINY + MODELS[model])
    return {n: p.detach().clone() for n, p in build_model(cfg.model, cfg.train.seed).named_parameters()}


def test_every_stage_follows_the_reference_and_keeps_the_base(lora):
    failures, report = [], []
    for world in RUNS:
        for got, (model, strategy) in zip(lora[f"w{world}"], RUNS[world]):
            ref_losses, ref_weights = reference(str(lora["data"]), model)
            start = initial(model)
            label = f"{model} {strategy} world {world}"
            assert got["strategy"] == strategy and got["weights"].keys() == ref_weights.keys(), label
            adapters = [n for n in ref_weights if is_adapter(n)]
            assert adapters and len(adapters) < len(ref_weights), label
            assert all(torch.equal(ref_weights[n], start[n]) for n in ref_weights if n not in adapters), label
            loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
            weight_diff = max((got["weights"][n] - ref_weights[n]).abs().max().item() for n in adapters)
            moved = min((got["weights"][n] - start[n]).abs().max().item() for n in adapters if "lora_B" in n)
            base_changed = [n for n in ref_weights
                            if not is_adapter(n) and not torch.equal(got["weights"][n], start[n])]
            # only the adapters' gradients are reduced: a reduction that carried the base once would send at
            # least (N-1)/N of its fp32 bytes
            sent = got["comm"]["comm_bytes"]
            reduced = sent.get("all_reduce", 0) + sent.get("reduce_scatter", 0)
            base_bytes = 4 * sum(ref_weights[n].numel() for n in ref_weights if n not in adapters)
            report.append(f"{label}: max |loss diff| {loss_diff:.2e}, max |adapter diff| {weight_diff:.2e}, "
                          f"every lora_B moved by >= {moved:.1e}, base changed: {base_changed}, gradient "
                          f"reduction {reduced:,} B sent per rank and step (the base: {base_bytes:,} B)")
            if (len(got["losses"]) != STEPS or loss_diff >= TOLERANCE or weight_diff >= TOLERANCE or base_changed
                    or reduced >= base_bytes * (world - 1) / world):
                failures.append(report[-1])
            if moved < 1e-4:  # trained, not just kept
                failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "\n".join(failures)


def test_checkpoint_holds_the_adapters_only(lora):
    tmp = lora["tmp"]
    for model, strategy, world in (("gpt2", "zero1", 2), ("llama", "zero3", 2), ("gpt2", "zero2", 3),
                                   ("llama", "zero3", 3)):
        cfg = load_config(None, TINY + MODELS[model])
        spec, arch = lora_spec(cfg.model.lora), arch_of(cfg.model)
        ckpt = tmp / f"{model}-{strategy}-w{world}" / "checkpoints" / "step_00000004" / "deepspeed"
        src = DeepSpeedSource(ckpt)
        try:
            assert src.stage == int(strategy[-1]) and src.world == world
            assert sorted(src.param_names()) == sorted(adapter_shapes(arch, spec)), (model, strategy)
            assert all(src.has(n, "exp_avg") for n in src.param_names())
        finally:
            src.close()
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        base_bytes = 4 * param_count(cfg.model)
        adapter_bytes = 4 * adapter_count(arch, spec)
        # fp32 adapters + two moments (+ the module's own copy under zero1/2) and DeepSpeed's pickles: far
        # below the base's fp32 bytes, which a checkpoint holding the base would exceed
        assert size < base_bytes, (model, strategy, size, base_bytes, adapter_bytes)
        assert size > 3 * adapter_bytes, (model, strategy, size, adapter_bytes)


def test_resume_at_another_strategy_and_world_continues(lora):
    got = lora["resumed"]
    assert "error" not in got, got.get("error")
    ref_losses, ref_weights = reference(str(lora["data"]), "llama")
    assert got["strategy"] == "zero1" and len(got["losses"]) == STEPS - 2
    assert got["losses"] == pytest.approx(ref_losses[2:], abs=TOLERANCE)
    start = initial("llama")
    for n, ref in ref_weights.items():
        if is_adapter(n):
            assert (got["weights"][n] - ref).abs().max().item() < TOLERANCE, n
        else:
            assert torch.equal(got["weights"][n], start[n]), n
    # DeepSpeed's counters and AdamW's step continue from the checkpoint's (tests/distributed/test_zero_counters.py)
    saved = saved_counters(lora["tmp"] / "resumed" / "checkpoints" / "step_00000004" / "deepspeed")
    assert saved["global_steps"] == STEPS and saved["global_samples"] == STEPS * GLOBAL, saved
    assert saved["adam_steps"] and set(saved["adam_steps"]) == {float(STEPS)}, saved


def test_init_from_loads_the_base_into_zero3_partitions(lora):
    got, base = lora["init"], lora["base"]
    assert len(got["losses"]) == 2
    for n, w in got["weights"].items():
        if not is_adapter(n):
            assert torch.equal(w, base[n]), n  # the file's weights, frozen
    # step 1's loss is the base model's (lora_B starts at 0), with the adapters at their initial values
    cfg = load_config(None, overrides(lora["data"], "llama", "/nonexistent"))
    model = build_model(cfg.model, cfg.train.seed)
    model.load_state_dict(base, strict=False)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    with torch.no_grad():
        loss = model(*data.rows(data.offsets(0, GLOBAL))).item()
    assert got["losses"][0] == pytest.approx(loss, abs=TOLERANCE)


def test_bf16_base_is_16_bit_frozen_and_sharded(lora):
    states = lora["states"]
    cfg = load_config(None, TINY + LLAMA_LORA)
    arch, spec = arch_of(cfg.model), lora_spec(cfg.model.lora)
    A, B, N = adapter_count(arch, spec), param_count(cfg.model), 2  # adapters, base, ranks

    def near(value, expected):  # flat partitions are padded to alignment
        return expected <= value <= expected * 1.01 + 1024

    for stage, s in states.items():
        assert s["frozen"] == len(dict(build_model(cfg.model, device="meta").named_parameters())) - len(
            adapter_shapes(arch, spec)), (stage, s)
        assert s["frozen_dtypes"] == ["torch.bfloat16"], (stage, s)
        assert s["frozen_in_optimizer"] == 0 and s["frozen_grads"] == 0, (stage, s)
        assert s["trained_in_optimizer"] == len(adapter_shapes(arch, spec)), (stage, s)
        # mixed-precision Adam over the adapters alone: fp32 master + exp_avg + exp_avg_sq, sharded
        assert near(s["held"]["optim"], 12 * A // N), (stage, s)
    for stage in ("zero1", "zero2"):  # 16-bit base and adapters replicated
        assert near(states[stage]["held"]["params"], 2 * (A + B)), states[stage]
    assert near(states["zero3"]["frozen_partition"] * N, B), states["zero3"]  # the base sharded
    assert near(states["zero3"]["held"]["params"], 2 * (A + B) // N), states["zero3"]


def test_each_runs_traffic_is_what_it_planned(lora):
    """Each run's end-of-run "comm/step sent per rank" line within 5% of its plan: zero3 gathers its persistent
    parameters after every step, the frozen base's too (planned for the adapters alone it was +142% to +212%)."""
    failures = []
    for world in RUNS:
        for got, (model, strategy) in zip(lora[f"w{world}"], RUNS[world]):
            comm = got["planned"]["comm_bus_bytes"]
            error = (comm["measured"] - comm["predicted"]) / comm["predicted"]
            if abs(error) > 0.05:
                failures.append(f"{model} {strategy} world {world}: predicted {comm['predicted']:,} B, "
                                f"measured {comm['measured']:,} B ({error:+.1%})")
    assert not failures, "\n".join(failures)


OFFLOAD_AND_FP16 = [("llama", ["strategy.name=zero2", "strategy.offload_optimizer=true"]),
                    ("gpt2", ["strategy.name=zero3", "strategy.offload_optimizer=true"]),
                    ("llama", ["strategy.name=zero2", "train.precision=fp16"]),
                    ("llama", ["strategy.name=zero3", "train.precision=fp16"])]
OFFLOAD_AND_FP16_STEPS = 2
"""Enough to compare: two updates, the second from the moments of the first (DeepSpeedCPUAdam's, or the fp16
path's), to the reference's of the same two steps."""
FP16_LOSS, FP16_ADAPTERS = 1e-4, 1e-2
"""fp16 (autocast compute, fp32 master adapters, dynamic loss scale) against the fp32 reference: measured over 4
steps 1.1e-05 (losses) and 2.4e-03 (adapters, Adam's steps of lr 1e-3 on gradients rounded to fp16)."""


@pytest.fixture(scope="module")
def offload_and_fp16(lora):
    """OFFLOAD_AND_FP16's runs on the module's data, in one call of the pooled world of 2."""
    runs = [{"overrides": overrides(lora["data"], model, lora["tmp"] / f"extra-{i}") + extra
             + [f"train.max_steps={OFFLOAD_AND_FP16_STEPS}"]} for i, (model, extra) in enumerate(OFFLOAD_AND_FP16)]
    return run_distributed("tests.support.workers:train_runs", 2, {"runs": runs})[0]


def test_lora_under_offload_optimizer_and_fp16_follows_the_reference(lora, offload_and_fp16):
    """LoRA under zero2/zero3 with the optimizer offloaded (DeepSpeedCPUAdam over the adapters alone) within
    1e-5 of the single-process reference, and in fp16 within its band, the frozen base left as it was (held
    in fp16 under fp16)."""
    failures = []
    for got, (model, extra) in zip(offload_and_fp16, OFFLOAD_AND_FP16):
        ref_losses, ref_weights = reference(str(lora["data"]), model, OFFLOAD_AND_FP16_STEPS)
        start = initial(model)
        fp16 = "train.precision=fp16" in extra
        adapters = [n for n in ref_weights if is_adapter(n)]
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
        adapter_diff = max((got["weights"][n] - ref_weights[n]).abs().max().item() for n in adapters)
        moved = min((got["weights"][n] - start[n]).abs().max().item() for n in adapters if "lora_B" in n)
        base = [n for n in ref_weights if n not in adapters
                and not torch.equal(got["weights"][n], start[n].half().float() if fp16 else start[n])]
        line = (f"{model} {' '.join(extra)}: max |loss diff| {loss_diff:.2e}, max |adapter diff| {adapter_diff:.2e}, "
                f"every lora_B moved by >= {moved:.1e}, base changed: {base}")
        print(line)
        losses_ok, adapters_ok = (FP16_LOSS, FP16_ADAPTERS) if fp16 else (TOLERANCE, TOLERANCE)
        if (len(got["losses"]) != OFFLOAD_AND_FP16_STEPS or loss_diff >= losses_ok or adapter_diff >= adapters_ok
                or moved < 1e-4 or base):
            failures.append(line)
    assert not failures, "\n".join(failures)
