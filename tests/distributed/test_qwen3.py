"""Qwen3 (zerodp/models/qwen3/: llama's layout plus an RMSNorm over each head's q and k, head_dim free of
the width), against transformers' Qwen3ForCausalLM: the same logits from the same weights; under every
strategy it follows the single-process AdamW trajectory; `model.init_from` of a random Qwen3 folder
gives transformers' logits under every strategy; `zerodp convert --to hf` of each strategy's checkpoint
loads back into transformers with zerodp's logits. The planner's count is in tests/unit/test_planner_hf.py.

The multi-rank work is two launches (world 2: ddp, zero1-3, fsdp; world 1: single), run once for the
module; the models are built from a Qwen3Config in code (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tests.conftest import TINY
from tests.distributed.test_hf import hf_logits, zerodp_logits  # the same comparison as the other families'
from tests.support.harness import run_distributed
from tests.support.reference import WEIGHT_TOLERANCE, reference_run
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.errors import UserError
from zerodp.models import arch_of
from zerodp.models.hf import from_hf, hf_config_from_model, model_config_from_hf, to_hf

TOL = 1e-5
SEQ, VOCAB = 32, 256  # TINY's block_size and the byte-level vocabulary
STRATEGIES = {"single": 1, "ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "fsdp": 2}
_QWEN3 = ["model.arch=qwen3", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.intermediate_size=64"]
# zerodp's qwen3 on top of TINY: head_dim 16 (not 32 / 4), grouped-query attention, tied and untied heads
TRAINED = {
    "untied-gqa": _QWEN3 + ["model.n_kv_head=2", "model.head_dim=16", "model.tie_embeddings=false"],
    "tied-mqa": _QWEN3 + ["model.n_kv_head=1", "model.head_dim=12", "model.tie_embeddings=true"],
}
# transformers' Qwen3, random: the same two shapes
_DIMS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None)
HF = {
    "untied-gqa": Qwen3Config(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, **_DIMS),
    "tied-mqa": Qwen3Config(num_key_value_heads=1, head_dim=12, tie_word_embeddings=True, **_DIMS),
}
NOT_MODEL = [o for o in TINY if not o.startswith("model.")]


def _ids(n: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def make_hf(name: str, folder=None) -> Qwen3ForCausalLM:
    """A random Qwen3 (every norm weight moved off 1, so a dropped or misplaced q/k norm shows), saved
    to `folder` if given."""
    torch.manual_seed(len(name))
    model = Qwen3ForCausalLM(HF[name]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if folder is not None:
        model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", list(HF))
def test_same_weights_give_transformers_logits(name):
    """zerodp's Qwen3 holds exactly transformers' parameters (names and shapes, a tied head once) and,
    loaded with their values, computes their logits."""
    hf = make_hf(name)
    model_keys = TINY + TRAINED[name] + ["model.norm_eps=1e-6"]  # Qwen3Config's rms_norm_eps
    a = arch_of(load_config(None, model_keys).model)
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == a.param_shapes()
    idx = _ids()
    diff = (zerodp_logits(model_keys, hf.state_dict(), idx) - hf_logits(hf, idx)).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.parametrize("name", list(HF))
def test_table_and_config_json_both_ways(name):
    """Every parameter maps to transformers' own state-dict name and back (the identity, q_norm and
    k_norm included); config.json -> model.* keys -> config.json gives transformers the same model."""
    cfg = HF[name]
    ours = model_config_from_hf(cfg.to_dict())
    assert ours["arch"] == "qwen3" and ours["head_dim"] == cfg.head_dim and ours["qkv_bias"] is False
    a = arch_of(load_config(None, NOT_MODEL + [f"model.{k}={v}" for k, v in ours.items() if k != "rope_scaling"]).model)
    hf_shapes = {k: tuple(v.shape) for k, v in Qwen3ForCausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        del hf_shapes["lm_head.weight"]  # tied: not stored
    assert {to_hf("qwen3", n)[0]: s for n, s in a.param_shapes().items()} == hf_shapes
    assert all(from_hf("qwen3", n) == (n, None) for n in a.param_shapes())
    back = AutoConfig.for_model(**hf_config_from_model(ours))
    assert type(back).__name__ == "Qwen3Config" and model_config_from_hf(back.to_dict()) == ours


def test_qwen3_refusals():
    """What zerodp's qwen3 does not build, refused in one line naming why."""
    raw = {**HF["untied-gqa"].to_dict(), "attention_bias": True}
    with pytest.raises(UserError, match=r"attention_bias=true is not supported"):
        model_config_from_hf(raw)
    ours = model_config_from_hf(HF["untied-gqa"].to_dict())
    with pytest.raises(UserError, match=r"^a qwen3 model with model.qkv_bias=true has no Hugging Face equivalent"):
        hf_config_from_model({**ours, "qkv_bias": True})
    no_head_dim = {k: v for k, v in HF["untied-gqa"].to_dict().items() if k != "head_dim"}
    assert model_config_from_hf(no_head_dim)["head_dim"] == 128  # Qwen3Config's, not hidden / heads


# ---- the multi-rank runs, once for the module -------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    hf_models = {name: make_hf(name, root / "hf" / name) for name in HF}
    idx = _ids()
    jobs, keys = {1: [], 2: []}, {1: [], 2: []}
    for strategy, world in STRATEGIES.items():
        s = [f"strategy.name={strategy}"]
        for name, arch in TRAINED.items():  # 2 steps, saved: the trajectory, and the checkpoint to export
            jobs[world].append({"kind": "train", "overrides": TINY + arch + s + [
                "train.max_steps=2", f"train.out_dir={root / 'train' / strategy / name}"]})
            keys[world].append(("train", strategy, name))
        for name in HF:  # init_from the HF folder: the logits before the first step
            folder = root / "hf" / name
            jobs[world].append({"kind": "logits", "idx": idx.tolist(), "overrides": NOT_MODEL + s + [
                f"model.hf_config={folder}", f"model.init_from={folder}", f"train.out_dir={root / 'unused'}"]})
            keys[world].append(("import", strategy, name))
    results = {}
    for world in (2, 1):
        got = run_distributed("tests.support.hf_workers:hf_jobs", world, {"jobs": jobs[world]})[0]
        results.update(zip(keys[world], got))
    return {"root": root, "hf": hf_models, "idx": idx, "results": results}


def test_every_strategy_follows_single_process_adamw(runs, capsys):
    """Two steps of each strategy (world 2; single: 1) against plain torch.optim.AdamW on the global batch:
    losses to 1e-5, weights to tests.support.reference.WEIGHT_TOLERANCE."""
    report, failures = [], []
    for name, arch in TRAINED.items():
        ref_losses, ref_weights = reference_run(load_config(None, TINY + arch + ["train.max_steps=2"]))
        for strategy in STRATEGIES:
            got = runs["results"][("train", strategy, name)]
            assert got["weights"].keys() == ref_weights.keys() and len(got["losses"]) == 2, (strategy, name)
            loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
            weight_diff = max((got["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights)
            report.append(f"train  {strategy:6s} {name:10s} max |loss diff| {loss_diff:.1e}, "
                          f"max |weight diff| {weight_diff:.1e}")
            if loss_diff > TOL or weight_diff > WEIGHT_TOLERANCE:
                failures.append(report[-1])
    with capsys.disabled():
        print("\n" + "\n".join(report))
    assert not failures, "\n".join(failures)


def test_init_from_a_qwen3_folder_gives_its_logits_under_every_strategy(runs, capsys):
    """model.hf_config + model.init_from of a transformers-made Qwen3 folder: before the first step,
    each strategy's model computes the HF model's logits."""
    report = []
    for strategy in STRATEGIES:
        for name, hf in runs["hf"].items():
            got = runs["results"][("import", strategy, name)]["logits"]
            diff = (got - hf_logits(hf, runs["idx"])).abs().max().item()
            report.append(f"import {strategy:6s} {name:10s} max |logit diff| {diff:.1e}")
            assert diff <= TOL, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_export_loads_in_transformers_with_the_same_logits(runs, capsys):
    """`zerodp convert CKPT DST --to hf` of each strategy's checkpoint: transformers loads a
    Qwen3ForCausalLM with no missing, unexpected or mismatched key, and its logits are zerodp's."""
    root, idx, report = runs["root"], runs["idx"], []
    for strategy in STRATEGIES:
        for name, arch in TRAINED.items():
            dst = root / "hf-out" / strategy / name
            assert main(["convert", str(root / "train" / strategy / name), str(dst), "--to", "hf",
                         "--no-progress"]) == 0
            model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
            assert {k: v for k, v in info.items() if v} == {}, (strategy, name, info)
            assert type(model).__name__ == "Qwen3ForCausalLM"
            assert model.config.tie_word_embeddings == name.startswith("tied")
            assert model.config.head_dim == arch_of(load_config(None, TINY + arch).model).head_dim
            ours = zerodp_logits(TINY + arch, runs["results"][("train", strategy, name)]["weights"], idx)
            diff = (hf_logits(model.eval(), idx) - ours).abs().max().item()
            report.append(f"export {strategy:6s} {name:10s} max |logit diff| {diff:.1e}")
            assert diff <= TOL, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))
