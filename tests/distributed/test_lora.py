"""LoRA (model.lora) under ddp and fsdp at world sizes 2 and 3 follows the single-process run on the same
global batches, for both families: the tiny GPT-2 from a base model's weights (model.init_from, a
safetensors file of other values than the seed's), packed samples with a loss mask; the small llama from
the seeded base, one conversation per sample (data.packing=false) with a loss mask. Global batch 12 of
micro batches of 2: 6, 3 and 2 accumulation steps at world 1, 2 and 3, with the adapters' dropout on
(model.lora.dropout, keyed by the global row: zerodp.models.dropout). Per-step losses and the final
adapters agree within test_equivalence.py's 1e-5; the frozen base ends bit-identical to the weights it
started from. A LoRA checkpoint holds the adapters and their AdamW state only (by name, a small share of
the model's bytes) and meta.json names the base (zerodp.convert.lora_base); ddp at world 2 resumed by
fsdp at world 3 continues the uninterrupted trajectory, its base reloaded from model.init_from, and so
does fsdp resuming its own checkpoint (DCP) at world 2 onto the seeded base; a resume
onto another base is refused in one line (exit 2); `zerodp verify` passes on a LoRA config; under bf16
and fp16 the frozen base is held in 2 bytes per parameter by ddp and (bf16), sharded, by fsdp.
One launch per world size runs every training of the file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY
from tests.support.cli_checks import one_line_error
from tests.support.harness import run_distributed
from tests.support.reference import LLAMA
from tests.support.sampler_workers import write_prepared
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.convert import lora_base, open_checkpoint
from zerodp.models import arch_of, build_model, param_shapes
from zerodp.models.lora_spec import adapter_shapes, is_adapter, lora_spec

STEPS, MICRO, GLOBAL = 3, 2, 12
TOLERANCE = 1e-5  # tests/distributed/test_equivalence.py's
RUNS = {2: ["ddp", "fsdp"], 3: ["ddp", "fsdp"]}
BASE = [o for o in TINY if not o.startswith(("train.global_batch_size", "train.micro_batch_size"))] + [
    f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}", f"train.max_steps={STEPS}",
    "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.decay_steps=4", "model.lora.rank=4", "model.lora.alpha=8",
    "model.lora.dropout=0.1"]  # keyed by the global row: the same masks at every world size and strategy
FAMILIES = {"gpt2": ["model.lora.targets=[c_attn]"],
            "llama": LLAMA + ["model.lora.targets=[q_proj, v_proj, down_proj]", "data.packing=false"]}


def overrides(root, family: str) -> list[str]:
    over = BASE + FAMILIES[family] + [f"data.source={root / 'chats'}"]
    return over + ([f"model.init_from={root / 'base-gpt2.safetensors'}"] if family == "gpt2" else [])


def base_weights(family: str, seed: int) -> dict[str, torch.Tensor]:
    """The family's model without adapters, initialised with `seed`: the weights a base starts from."""
    cfg = load_config(None, [o for o in BASE + FAMILIES[family] if not o.startswith(("model.lora", "data.packing"))])
    return {n: p.detach().contiguous() for n, p in build_model(cfg.model, seed=seed).named_parameters()}


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    documents = np.random.default_rng(0).integers(3, 46, size=500).tolist()
    write_prepared(root / "chats", documents, documents[:60], targets=[0.0, 1.0, 0.05, 0.6, 0.0])
    save_file(base_weights("gpt2", 7), root / "base-gpt2.safetensors")  # not the seed's values
    save_file(base_weights("gpt2", 8), root / "other-base.safetensors")
    plans = {1: [("single", family, []) for family in FAMILIES]}
    for world, names in RUNS.items():
        plans[world] = [(name, family, []) for family in FAMILIES for name in names]
    split = ["strategy.name=ddp", f"train.out_dir={root / 'split'}", "train.max_steps=2"]
    plans[2] += [("split", "gpt2", split),
                 ("ddp-bf16", "gpt2", ["strategy.name=ddp", "train.precision=bf16", f"train.out_dir={root / 'b1'}"]),
                 ("fsdp-bf16", "gpt2", ["strategy.name=fsdp", "train.precision=bf16", f"train.out_dir={root / 'b2'}"]),
                 ("ddp-fp16", "gpt2", ["strategy.name=ddp", "train.precision=fp16", f"train.out_dir={root / 'h1'}"])]
    plans[2] += [("fsdp-split", "llama", ["strategy.name=fsdp", f"train.out_dir={root / 'fsdp-split'}",
                                          "train.max_steps=2"]),
                 ("fsdp-resumed", "llama", ["strategy.name=fsdp", f"train.out_dir={root / 'fsdp-split'}"])]
    plans[3] += [("resumed", "gpt2", ["strategy.name=fsdp", f"train.out_dir={root / 'split'}"])]
    verify = ["configs/llama-tiny.yaml", *overrides(root, "llama"), "strategy.name=ddp",
              f"train.out_dir={root / 'verify' / 'run'}", "--against", "strategy.name=fsdp", "--steps", "2"]
    results = {}
    for world, plan in plans.items():
        runs = []
        for label, family, extra in plan:
            own = [f"strategy.name={label}", f"train.out_dir={root / f'{family}-{label}-{world}'}"]
            runs.append({"overrides": overrides(root, family) + (extra or own),
                         "fresh": not label.endswith("resumed")})
        calls = [{"target": "tests.support.workers:train_runs", "kwargs": {"runs": runs}}]
        if world == 2:
            calls.append({"target": "tests.support.verify_workers:verify", "kwargs": {"calls": [verify]}})
        got = run_distributed("tests.support.workers:several", world, {"calls": calls})[0]
        for (label, family, _), result in zip(plan, got[0]):
            results[(family, label, world)] = result
        if world == 2:
            results["verify"] = got[1][0]
    return root, results


def adapters_of(weights: dict) -> dict:
    return {n: t for n, t in weights.items() if is_adapter(n)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ddp_and_fsdp_follow_single_and_keep_the_base(lora, family):
    root, results = lora
    reference = results[(family, "single", 1)]
    start = load_file(root / "base-gpt2.safetensors") if family == "gpt2" else base_weights(family, 1337)
    assert len(reference["losses"]) == STEPS
    assert max(t.abs().max().item() for n, t in adapters_of(reference["weights"]).items()
               if n.endswith("lora_B.weight")) > 1e-4  # the adapters trained (B starts at 0)
    report = []
    for world, names in RUNS.items():
        for name in names:
            got = results[(family, name, world)]
            assert got["strategy"] == name and len(got["losses"]) == STEPS
            loss_diff = max(abs(a - b) for a, b in zip(got["losses"], reference["losses"]))
            ours, theirs = adapters_of(got["weights"]), adapters_of(reference["weights"])
            assert ours.keys() == theirs.keys() and ours
            weight_diff = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
            report.append(f"{family} {name} world {world}: |loss diff| {loss_diff:.1e}, "
                          f"|adapter diff| {weight_diff:.1e}")
            assert loss_diff < TOLERANCE and weight_diff < TOLERANCE, report[-1]
            base = {n: t for n, t in got["weights"].items() if not is_adapter(n)}
            assert base.keys() == start.keys()
            changed = [n for n in base if not torch.equal(base[n], start[n])]
            assert not changed, f"{family} {name} world {world}: the frozen base moved: {changed[:3]}"
    print("\n".join(report))


def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(lora):
    root, _ = lora
    cfg = load_config(None, overrides(root, "gpt2"))
    adapters = adapter_shapes(arch_of(cfg.model), lora_spec(cfg.model.lora))
    model_bytes = 4 * sum(math.prod(s) for s in param_shapes(cfg.model).values())
    for name in ("ddp", "fsdp"):
        ckpt = root / f"gpt2-{name}-2" / "checkpoints" / f"step_{STEPS:08d}"
        meta = json.loads((ckpt / "meta.json").read_text())
        assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["c_attn"], "init_from": None,
                                "base": {"init_from": str(root / "base-gpt2.safetensors"), "seed": 1337,
                                         "sha256": lora_base.base_identity(cfg)["sha256"]}}
        assert sorted(meta["params"]) == sorted(adapters)
        with open_checkpoint(ckpt) as source:
            assert sorted(source.param_names()) == sorted(adapters), name
            assert set(source.kinds()) == {"param", "exp_avg", "exp_avg_sq"}
            held = sum(source.info(n).nbytes for n in source.param_names())
        assert held == 4 * sum(math.prod(s) for s in adapters.values()) < model_bytes / 20
        if name == "ddp":  # the canonical files: adapters and their moments, a small share of the model's bytes
            files = sum((ckpt / f).stat().st_size for f in ("model.safetensors", "optim.safetensors"))
            assert files < model_bytes / 5, (files, model_bytes)


def test_ddp_at_world_2_resumed_by_fsdp_at_world_3_continues_the_run(lora):
    root, results = lora
    straight = results[("gpt2", "single", 1)]
    first, resumed = results[("gpt2", "split", 2)], results[("gpt2", "resumed", 3)]
    assert len(first["losses"]) == 2 and len(resumed["losses"]) == STEPS - 2
    both = first["losses"] + resumed["losses"]
    assert max(abs(a - b) for a, b in zip(both, straight["losses"])) < TOLERANCE, (both, straight["losses"])
    ours, theirs = adapters_of(resumed["weights"]), adapters_of(straight["weights"])
    assert max((ours[n] - theirs[n]).abs().max().item() for n in ours) < TOLERANCE
    start = load_file(root / "base-gpt2.safetensors")  # the base came back from model.init_from
    assert all(torch.equal(resumed["weights"][n], t) for n, t in start.items())


def test_fsdp_resumes_its_own_lora_checkpoint_at_the_same_world_size(lora):
    """fsdp's own loader (DCP, the adapters alone) onto the seeded base."""
    _, results = lora
    straight = results[("llama", "single", 1)]
    first, resumed = results[("llama", "fsdp-split", 2)], results[("llama", "fsdp-resumed", 2)]
    both = first["losses"] + resumed["losses"]
    assert len(both) == STEPS and max(abs(a - b) for a, b in zip(both, straight["losses"])) < TOLERANCE
    ours, theirs = adapters_of(resumed["weights"]), adapters_of(straight["weights"])
    assert max((ours[n] - theirs[n]).abs().max().item() for n in ours) < TOLERANCE
    start = base_weights("llama", 1337)
    assert all(torch.equal(resumed["weights"][n], t) for n, t in start.items())


def test_a_resume_onto_another_base_is_refused(lora, capsys):
    root, _ = lora
    other = root / "other-base.safetensors"
    code = main(["train", "configs/tiny.yaml", "--dry-run", *overrides(root, "gpt2"), "strategy.name=single",
                 f"model.init_from={other}", f"train.out_dir={root / 'split'}", "train.max_steps=5"])
    one_line_error(capsys, code, rf"holds LoRA adapters trained on another base model \(model.init_from "
                                 rf"{root / 'base-gpt2.safetensors'} .* there, model.init_from {other} .* here\)")


def test_verify_passes_on_a_lora_config(lora):
    root, results = lora
    got = results["verify"]
    assert got["code"] == 0, got["stdout"] + got["stderr"]
    cfg = load_config(None, overrides(root, "llama"))
    n = len(adapter_shapes(arch_of(cfg.model), lora_spec(cfg.model.lora)))
    assert f"PASS: 2 steps and {n} tensors within the tolerance" in got["stdout"], got["stdout"]


def test_bf16_holds_the_frozen_base_in_16_bits(lora):
    root, results = lora
    cfg = load_config(None, overrides(root, "gpt2"))
    base = sum(math.prod(s) for s in param_shapes(cfg.model).values())
    adapters = adapter_shapes(arch_of(cfg.model), lora_spec(cfg.model.lora))
    trained = sum(math.prod(s) for s in adapters.values())
    ddp, fsdp, fp16 = (results[("gpt2", f"{name}", 2)] for name in ("ddp-bf16", "fsdp-bf16", "ddp-fp16"))
    fp32 = results[("gpt2", "fsdp", 2)]
    for run in (ddp, fp16):
        assert run["state_bytes"]["params"] == 2 * base + 4 * trained
        assert run["state_bytes"]["optim"] == 8 * trained + 4 * len(adapters)  # exp_avg, exp_avg_sq, step
    # fsdp: a shard of each (rows padded to the world size), the base's in 2 bytes
    assert (2 * base + 4 * trained) / 2 <= fsdp["state_bytes"]["params"] < 1.05 * (2 * base + 4 * trained) / 2
    assert fp32["state_bytes"]["params"] >= (4 * base + 4 * trained) / 2
    start = load_file(root / "base-gpt2.safetensors")
    for run, dtype in ((ddp, torch.bfloat16), (fsdp, torch.bfloat16), (fp16, torch.float16)):
        # the same trajectory within the 16-bit band of zerodp verify (docs/strategies.md)
        ref = results[("gpt2", "single", 1)]["losses"]
        assert max(abs(a - b) / b for a, b in zip(run["losses"], ref)) < 1e-2, (run["losses"], ref)
        # the base as loaded, rounded once to 16 bits, and never updated
        assert all(torch.equal(run["weights"][n], t.to(dtype).float()) for n, t in start.items())
