"""Checkpoints that move: resume under another strategy and world size (saved synchronously or by the
background writer), and start from weights."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import TINY
from tests.support.harness import run_distributed
from tests.support.reference import LLAMA, WEIGHT_TOLERANCE, reference_run
from zerodp.config import load_config
from zerodp.data.batches import TokenBatches, load_tokens
from zerodp.models import build_model

# (model, saved by, on, resumed by, on); the llama rides along (with activation checkpointing:
# recomputation must not change what is saved or resumed)
MOVES = [("gpt2", "zero2", 2, "fsdp", 1), ("gpt2", "fsdp", 2, "zero3", 3), ("gpt2", "ddp", 1, "zero1", 2),
         ("gpt2", "zero3", 2, "ddp", 2), ("llama", "zero3", 2, "fsdp", 3)]
# Saved by the background writer (checkpoint.async_save), the others synchronously: zero3 both ways
BACKGROUND = {("gpt2", "zero2"), ("gpt2", "fsdp"), ("gpt2", "zero3")}
MODELS = {"gpt2": [], "llama": LLAMA + ["model.activation_checkpointing=true"]}


def base(tiny):
    # 12 sequences: divisible by micro 2 x 1, 2 or 3 ranks
    return tiny + ["train.global_batch_size=12", "train.max_steps=6", "optim.lr=1e-3", "optim.min_lr=1e-4"]


def test_resume_across_strategies_and_world_sizes(tiny, tmp_path):
    over = {model: base(tiny) + arch for model, arch in MODELS.items()}
    refs = {model: reference_run(load_config(None, o)) for model, o in over.items()}
    # Four launches, in turn: world 1 saves; world 2 saves its four, then resumes what world 1 and it
    # saved; worlds 1 and 3 resume the rest. Each save runs before the resumes that read it.
    save_turn, resume_turn = {1: 0, 2: 1}, {1: 2, 2: 1, 3: 2}
    launches: dict[tuple[int, int], list[dict]] = {}
    for model, src, w1, _, _ in MOVES:
        launches.setdefault((save_turn[w1], w1), []).append({"overrides": over[model] + [
            f"strategy.name={src}", "train.max_steps=3", f"checkpoint.async_save={(model, src) in BACKGROUND}",
            f"train.out_dir={tmp_path / f'{model}-{src}'}"]})
    for model, src, _, dst, w2 in MOVES:
        launches.setdefault((resume_turn[w2], w2), []).append({"overrides": over[model] + [
            f"strategy.name={dst}", f"train.out_dir={tmp_path / f'{model}-{src}'}"], "fresh": False})
    results = {}
    for turn, world in sorted(launches):
        runs = launches[turn, world]
        for run, got in zip(runs, run_distributed("tests.support.workers:train_runs", world, {"runs": runs})[0]):
            if run.get("fresh") is False:
                results[run["overrides"][-1]] = got
    report = []
    for model, src, w1, dst, w2 in MOVES:
        ref_losses, ref_weights = refs[model]
        got = results[f"train.out_dir={tmp_path / f'{model}-{src}'}"]
        assert got["strategy"] == dst and len(got["losses"]) == 3
        assert got["weights"].keys() == ref_weights.keys()
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses[3:]))
        weight_diff = max((got["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        report.append(f"{model} {src}@{w1} -> {dst}@{w2}: max |loss diff| {loss_diff:.1e}, "
                      f"max |param diff| {weight_diff:.1e}")
        assert loss_diff < 1e-5 and weight_diff < WEIGHT_TOLERANCE, report[-1]
    print("\n".join(report))


HF_MODEL_SEED = 7
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """One launch of one process: 3 steps under single, saved (weights to start from), and 1 step from a
    file in Hugging Face GPT2Model's layout. (folder, the latter's result)."""
    from safetensors.torch import save_file

    tmp = tmp_path_factory.mktemp("portable")
    over = base(TINY)
    model = build_model(load_config(None, over).model, seed=HF_MODEL_SEED)
    hf = {n.removeprefix("transformer."): (p.t() if n.endswith(CONV1D) else p).detach().contiguous()
          for n, p in model.named_parameters()}
    save_file(hf, tmp / "hf.safetensors")
    _, from_hf = run_distributed("tests.support.workers:train_runs", 1, {"runs": [
        {"overrides": over + ["strategy.name=single", "train.max_steps=3", f"train.out_dir={tmp / 'a'}"]},
        {"overrides": over + ["strategy.name=single", "train.max_steps=1", "optim.lr=1e-9", "optim.min_lr=0",
                              f"model.init_from={tmp / 'hf.safetensors'}", f"train.out_dir={tmp / 'r'}"]}]})[0]
    return tmp, from_hf


def test_init_from_pretrained_weights_under_sharding(tiny, tmp_path, single_runs):
    """Weights saved by single, loaded by zero3 on 2 ranks via model.init_from: step 1 sees them."""
    over = base(tiny)
    weights = single_runs[0] / "a" / "checkpoints" / "step_00000003" / "model.safetensors"
    (got,) = run_distributed("tests.support.workers:train_runs", 2, {"runs": [
        {"overrides": over + ["strategy.name=zero3", "train.max_steps=1", f"model.init_from={weights}",
                              f"train.out_dir={tmp_path / 'b'}"]}]})[0]
    from safetensors.torch import load_file

    cfg = load_config(None, over)
    model = build_model(cfg.model)
    model.load_state_dict(load_file(weights), strict=False)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    with torch.no_grad():
        want = model(*data.rows(data.offsets(0, 12))).item()
    assert got["losses"][0] == pytest.approx(want, abs=1e-5)


def refused(overrides: list[str]) -> str:
    """Runs on every rank: train per `overrides`; the message of the UserError the run is refused with
    (returned, not raised: a rank that raises ends its kept world, which later tests would start anew)."""
    from zerodp.errors import UserError
    from zerodp.trainer.loop import train

    try:
        train(load_config(None, overrides), fresh=True)
    except UserError as e:
        return str(e)
    return "no error"


def test_init_from_mismatched_model_is_a_clear_error(tiny, tmp_path, single_runs):
    over = base(tiny)
    weights = single_runs[0] / "a" / "checkpoints" / "step_00000003" / "model.safetensors"
    (message,) = run_distributed("tests.distributed.test_portable:refused", 1, {"overrides": over + [
        "model.n_embd=64", "strategy.name=single", f"model.init_from={weights}", f"train.out_dir={tmp_path / 'b'}"]})
    assert re.search(r"holds a different model than this config \(28 have another shape \(e.g. "
                     r"transformer.wte.weight is \[256, 32\] there, \[256, 64\] here\)\); "
                     r"set the model section to the checkpoint's dimensions", message), message


def test_init_from_hugging_face_gpt2_layout(tiny, single_runs):
    """A file in Hugging Face GPT2Model's layout (no 'transformer.' prefix, Conv1D weights stored
    (in, out)) initialises zerodp's GPT exactly."""
    model = build_model(load_config(None, base(tiny)).model, seed=HF_MODEL_SEED)
    got = single_runs[1]
    for n, p in model.named_parameters():
        assert (got["weights"][n] - p.detach()).abs().max().item() < 1e-6, n
