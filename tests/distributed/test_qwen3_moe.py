"""Qwen3-MoE (zerodp/models/qwen3_moe/: qwen3's attention, sparse blocks of stacked SwiGLU experts), against
transformers' Qwen3MoeForCausalLM: the same parameters and logits from the same weights, the balance loss
equal to transformers' aux_loss (micro_batch) and to its per-sequence mean (sequence); a transformers-made
folder starts a run whose first loss is transformers' LM loss + router_aux_loss_coef x aux_loss; `--to hf`
writes the hub's per-expert layout, which transformers loads with no missing or unexpected key and
zerodp's logits; ZeRO-3 at world 2 on data that sends each rank's tokens to different experts finishes.

The multi-rank work is two calls of the pooled worlds (world 1: single; world 2: ddp, zero3, fsdp), run once
for the module; the models are built from a Qwen3MoeConfig in code (nothing downloaded)."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.conftest import TINY
from tests.distributed.test_hf import hf_logits, zerodp_logits
from tests.support.harness import run_distributed
from tests.support.moe_workers import moe_reference
from tests.support.sampler_workers import write_prepared
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.models import arch_of, build_model
from zerodp.models.arch import arch_from_section
from zerodp.models.hf import hf_config_from_model, model_config_from_hf

TOL = 1e-5
SEQ, VOCAB = 32, 256  # TINY's block_size and the byte-level vocabulary
_DIMS = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None, router_aux_loss_coef=0.02)
HF = {
    "sparse": Qwen3MoeConfig(norm_topk_prob=True, tie_word_embeddings=False, **_DIMS),
    # block 0 dense (decoder_sparse_step 2: only block 1 has experts), the head tied, top-k not renormalised
    "mixed": Qwen3MoeConfig(norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, **_DIMS),
}
NOT_MODEL = [o for o in TINY if not o.startswith("model.")]
EXPORTED = ("ddp", "zero3", "fsdp")
"""The world-2 runs whose checkpoints (torch, DeepSpeed, DCP) are exported."""
MOE = ["model.arch=qwen3_moe", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.head_dim=16",
       "model.n_embd=32", "model.intermediate_size=64", "model.tie_embeddings=false", "model.moe.num_experts=8",
       "model.moe.num_experts_per_tok=2", "model.moe.moe_intermediate_size=16"]


RECIPE_ON_CPU = ["model.hf_config=", "model.init_from=", "model.arch=qwen3_moe", "data.source=builtin",
                 "train.precision=fp32"]
"""configs/sft-qwen3-moe-lora.yaml's overrides for a CPU without a Hugging Face folder (with MOE's shapes)."""
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
VARIANTS = {
    "sequence": ["model.moe.balance=sequence"],
    "micro_batch+lora": ["model.moe.balance=micro_batch", "model.lora.rank=4", "model.lora.alpha=8",
                         "model.lora.targets=[q_proj, k_proj, v_proj, o_proj]"],
}
"""The equivalence runs' two settings: every parameter trained, the per-sequence balance loss; LoRA on the
attention projections (the experts and router frozen), transformers' per-micro-batch balance loss."""
STEPS = 2
"""The equivalence runs' steps: the second's loss and weights follow an update that the balance loss is part of."""
RESUMED = ("zero2", 2, "fsdp", 3)
"""Resumed: a world-2 zero2 run's step-2 checkpoint, continued to step 4 by fsdp at world 3."""


def _equal(data, world: int, variant: str, out, accum: int = 2, steps: int = STEPS) -> list[str]:
    """An equivalence run: the tiny MoE with a large balance loss weight (0.1), documents of 3 to 45 tokens
    with a loss mask and document masking, micro batch 2, `accum` micro batches per rank."""
    return TINY + MOE + VARIANTS[variant] + [
        "model.moe.router_aux_loss_coef=0.1", f"data.source={data}", "data.document_masking=true",
        f"train.global_batch_size={2 * world * accum}", "train.micro_batch_size=2", f"train.max_steps={steps}",
        "optim.lr=1e-3", "optim.min_lr=1e-4", f"train.out_dir={out}"]


def _ids(n: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def make_hf(name: str, folder=None) -> Qwen3MoeForCausalLM:
    """A random Qwen3-MoE (every weight moved off its init, the router's off 0), saved to `folder` if given."""
    torch.manual_seed(len(name))
    model = Qwen3MoeForCausalLM(HF[name]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p) if p.dim() == 2 and p.shape[0] == 8 else 0.05 * torch.randn_like(p))
    if folder is not None:
        model.save_pretrained(folder)
    return model


def _keys(name: str, *extra: str) -> list[str]:
    """zerodp's overrides for HF[name], read from its config.json."""
    ours = model_config_from_hf(HF[name].to_dict())
    flat = [f"model.{k}={json.dumps(v)}" for k, v in ours.items() if k not in ("moe", "rope_scaling")]
    return NOT_MODEL + flat + [f"model.moe.{k}={json.dumps(v)}" for k, v in ours["moe"].items()] + list(extra)


def _zerodp(name: str, hf, balance: str):
    model = build_model(load_config(None, _keys(name, f"model.moe.balance={balance}")).model)
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and set(missing) <= set(model.tied_weights())
    return model.train()


@pytest.mark.parametrize("name", list(HF))
def test_same_weights_give_transformers_logits_and_balance_loss(name):
    """zerodp's Qwen3-MoE holds transformers' parameters (names and shapes: router, stacked experts, dense
    blocks) and, with their values, computes their logits; its balance loss in micro_batch mode is
    transformers' aux_loss on the batch, in sequence mode the mean of transformers' aux_loss of each sequence."""
    hf = make_hf(name)
    a = arch_of(load_config(None, _keys(name)).model)
    assert {n: tuple(p.shape) for n, p in hf.named_parameters()} == a.param_shapes()
    idx = _ids(3)
    diff = (zerodp_logits(_keys(name), hf.state_dict(), idx) - hf_logits(hf, idx)).abs().max().item()
    assert diff <= TOL, diff
    y = _ids(3, seed=4)
    with torch.no_grad():
        aux = hf(idx, output_router_logits=True).aux_loss.item()
        per_sequence = [hf(idx[i:i + 1], output_router_logits=True).aux_loss.item() for i in range(3)]
        for balance, want in (("micro_batch", aux), ("sequence", sum(per_sequence) / 3)):
            model = _zerodp(name, hf, balance)
            model(idx, y)
            assert abs(model.balance_loss.item() - want) <= TOL, (balance, model.balance_loss.item(), want)
            assert model.aux_loss.item() == pytest.approx(0.02 * model.balance_loss.item())
    assert abs(aux - sum(per_sequence) / 3) > 1e-3  # the two modes differ on this batch


def test_table_and_config_json_both_ways():
    """config.json -> model.* keys -> config.json gives transformers the same model (decoder_sparse_step
    written as the mlp_only_layers it means); the counts: 2 of 8 experts active."""
    for name, cfg in HF.items():
        ours = model_config_from_hf(cfg.to_dict())
        assert ours["arch"] == "qwen3_moe" and ours["moe"]["num_experts"] == 8
        back = AutoConfig.for_model(**hf_config_from_model(ours))
        again = model_config_from_hf(back.to_dict())
        assert type(back).__name__ == "Qwen3MoeConfig" and arch_from_section(again) == arch_from_section(ours)
        assert {k: v for k, v in again.items() if k != "moe"} == {k: v for k, v in ours.items() if k != "moe"}
        assert back.router_aux_loss_coef == 0.02
    a = arch_of(load_config(None, _keys("mixed")).model)
    assert a.dense_layers == (0,) and a.n_experts == 8 and not a.norm_topk_prob
    # the count the planner reads: 2 of 8 experts active
    expert = 3 * 16 * 32
    assert a.param_count() - a.active_param_count() == 6 * expert


def test_checkpointing_and_loss_masks_leave_the_balance_loss_alone():
    """Every token counts in the balance loss, a loss mask's non-targets too (documented); recomputing the
    blocks in the backward pass (activation checkpointing) gives the same gradients, the router's from the
    balance loss included."""
    cfg = load_config(None, TINY + MOE + ["model.moe.router_aux_loss_coef=0.5"])
    idx, y = _ids(2), _ids(2, seed=5)
    grads = {}
    for mode in ("off", "full"):
        cfg.model.activation_checkpointing = mode
        model = build_model(cfg.model, seed=1).train()
        loss = model(idx, y)
        (loss + model.aux_loss).backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        masked = y.clone()
        masked[:, : SEQ // 2] = -100
        unmasked = model.balance_loss.item()
        model(idx, masked)
        assert model.balance_loss.item() == unmasked
    router = "model.layers.0.mlp.gate.weight"
    assert grads["off"][router].abs().sum() > 0
    assert all((grads["off"][n] - grads["full"][n]).abs().max() <= 1e-6 for n in grads["off"])


# ---- the multi-rank runs, once for the module -------------------------------------------------------


def _disjoint_tokens(overrides: list[str]) -> tuple[int, int]:
    """Two tokens whose constant sequences the initial model routes to disjoint experts in every block."""
    cfg = load_config(None, overrides)
    model = build_model(cfg.model, seed=cfg.train.seed).eval()
    routes = []
    hooks = [m.gate.register_forward_hook(lambda mod, args, result: routes.append(result[2].reshape(VOCAB, -1)))
             for n, m in model.named_modules() if n.endswith(".mlp") and hasattr(m, "gate")]
    with torch.no_grad():
        model(torch.arange(VOCAB)[:, None].expand(VOCAB, SEQ))
    for h in hooks:
        h.remove()
    sets = [[set(r[t].tolist()) for r in routes] for t in range(VOCAB)]
    for t in range(1, VOCAB):
        if all(not (a & b) for a, b in zip(sets[0], sets[t])):
            return 0, t
    raise AssertionError("no two tokens route apart")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    hf = make_hf("sparse", root / "hf")
    folder = root / "hf"
    start = NOT_MODEL + [f"model.hf_config={folder}", f"model.init_from={folder}"]
    x, y = _ids(2, seed=6), _ids(2, seed=7)
    routed = TINY + MOE + ["strategy.name=zero3", "train.global_batch_size=4", f"train.out_dir={root / 'unused'}"]
    tokens = _disjoint_tokens(routed)
    documents = np.random.default_rng(46).integers(3, 46, size=400).tolist()
    data = write_prepared(root / "documents", documents, documents[:40], targets=[0.0, 1.0, 0.05, 0.6, 0.0])
    # the equivalence runs: single (world 1) at the world-2 batches, then every strategy at world 2 and 3
    equal_runs = {w: [(v, s) for v in VARIANTS for s in (("single",) if w == 1 else STRATEGIES)] for w in (1, 2, 3)}
    jobs = {w: [{"kind": "train", "overrides": _equal(data, max(w, 2), v, root / "equal" / f"{v}-{s}-w{w}")
                 + [f"strategy.name={s}"]} for v, s in equal_runs[w]] for w in equal_runs}
    first, later, later_world = RESUMED[0], RESUMED[2], RESUMED[3]
    resume_source = root / "equal" / "resume-source"
    jobs[2].append({"kind": "train", "overrides": _equal(data, 2, "sequence", resume_source, accum=3, steps=4) + [
        f"strategy.name={first}", "checkpoint.every=2"]})
    single = run_distributed("tests.support.moe_workers:moe_jobs", 1, {"jobs": [
        {"kind": "first_step", "x": x.tolist(), "y": y.tolist(), "overrides": start + [
            "strategy.name=single", "model.moe.balance=micro_batch", "train.global_batch_size=2",
            f"train.out_dir={root / 'unused'}"]},
        {"kind": "train", "overrides": start + ["strategy.name=single", "train.max_steps=2",
                                                f"train.out_dir={root / 'train' / 'single'}"]},
        {"kind": "train", "overrides": start + ["strategy.name=single", "train.max_steps=2",
                                                "train.micro_batch_size=4", f"train.out_dir={root / 'train' / 'mb4'}"]},
        *jobs[1],
    ]}, timeout=300)[0]
    pair = run_distributed("tests.support.moe_workers:moe_jobs", 2, {"jobs": [
        *({"kind": "train", "overrides": start + [f"strategy.name={strategy}", "train.max_steps=2",
                                                  f"train.out_dir={root / 'train' / strategy}"]}
          for strategy in EXPORTED),
        {"kind": "logits", "idx": x.tolist(), "overrides": start + ["strategy.name=zero3",
                                                                    f"train.out_dir={root / 'unused'}"]},
        {"kind": "routes", "tokens": list(tokens), "steps": 2, "overrides": routed},
        *jobs[2],
    ]}, timeout=300)
    # the world-2 zero2 run's step-2 checkpoint, copied to a run folder of its own, resumed at world 3 under fsdp
    resumed = root / "equal" / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(resume_source / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    jobs[3].append({"kind": "train", "fresh": False, "overrides": _equal(data, 3, "sequence", resumed, steps=4) + [
        f"strategy.name={later}", "checkpoint.every=2"]})
    trio = run_distributed("tests.support.moe_workers:moe_jobs", later_world, {"jobs": jobs[3]}, timeout=600)
    n1, n2 = len(jobs[1]), len(jobs[2])
    equal = {1: single[-n1:], 2: pair[0][-n2:-1], 3: trio[0][:-1]}
    return {"root": root, "hf": hf, "x": x, "y": y, "single": single, "pair": pair, "data": data,
            "equal": {w: list(zip(runs_of, equal[w])) for w, runs_of in equal_runs.items()},
            "resume": (pair[0][-1], trio[0][-1])}


def test_a_transformers_folder_starts_a_run_with_transformers_first_loss(runs):
    """model.hf_config + model.init_from of a transformers-made Qwen3-MoE folder, balance micro_batch: the
    first step's LM loss and balance loss are transformers' cross-entropy and aux_loss on the same batch,
    so the loss trained (LM + router_aux_loss_coef x balance) is transformers' loss with router logits."""
    got = runs["single"][0]
    with torch.no_grad():
        out = runs["hf"](runs["x"], output_router_logits=True)
    lm = F.cross_entropy(out.logits.reshape(-1, VOCAB), runs["y"].reshape(-1)).item()
    assert abs(got["loss"] - lm) <= TOL, (got, lm)
    assert abs(got["balance_loss"] - out.aux_loss.item()) <= TOL, (got, out.aux_loss)
    total = lm + 0.02 * out.aux_loss.item()
    assert abs(got["loss"] + 0.02 * got["balance_loss"] - total) <= TOL


def test_every_run_trains_and_exports_the_hub_layout(runs, capsys):
    """single, ddp, zero3 and fsdp (world 2) train 2 steps from the folder (metrics.jsonl shows balance_loss
    apart from loss); `zerodp convert RUN OUT --to hf` of each checkpoint (torch, DeepSpeed, DCP) writes one
    tensor per expert, as save_pretrained does, and transformers loads it with no missing or unexpected key
    and zerodp's logits. ZeRO-3 starts from the folder with its logits."""
    root, x, report = runs["root"], runs["x"], []
    with safe_open(str(root / "hf" / "model.safetensors"), "pt") as f:
        hub = sorted(f.keys())
    runs_of = {"single": runs["single"][1], **{s: runs["pair"][0][i] for i, s in enumerate(EXPORTED)}}
    for strategy, got in runs_of.items():
        records = [json.loads(line) for line in (root / "train" / strategy / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2] and all(r["balance_loss"] > 1.0 for r in records)
        assert [r["loss"] for r in records] == pytest.approx(got["losses"], abs=1e-6)
        dst = root / "hf-out" / strategy
        assert main(["convert", str(root / "train" / strategy), str(dst), "--to", "hf", "--no-progress"]) == 0
        with safe_open(str(dst / "model.safetensors"), "pt") as f:
            assert sorted(f.keys()) == hub
        model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
        assert {k: v for k, v in info.items() if v} == {}, (strategy, info)
        assert type(model).__name__ == "Qwen3MoeForCausalLM"
        ours = zerodp_logits(_keys("sparse"), got["weights"], x)
        diff = (hf_logits(model.eval(), x) - ours).abs().max().item()
        report.append(f"export {strategy:6s} max |logit diff| {diff:.1e}")
        assert diff <= TOL, report[-1]
    diff = (runs["pair"][0][len(EXPORTED)]["logits"] - hf_logits(runs["hf"], x)).abs().max().item()
    report.append(f"import zero3  max |logit diff| {diff:.1e}")
    assert diff <= TOL, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_sequence_balance_is_the_same_at_any_micro_batch_and_world_size(runs, capsys):
    """balance: sequence (the default) with router_aux_loss_coef 0.02 from the folder: one process at micro
    batch 2 (6 accumulation steps) and at 4 (3), and ddp, zero3 and fsdp on 2 ranks at 2 (3), train the same
    two steps: the same LM losses and balance losses, the second step's after an update that the balance
    loss is part of."""
    root = runs["root"]
    got = {run: [json.loads(line) for line in (root / "train" / run / "metrics.jsonl").read_text().splitlines()]
           for run in ("single", "mb4", *EXPORTED)}
    report = []
    for run in ("mb4", *EXPORTED):
        loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(got["single"], got[run]))
        balance = max(abs(a["balance_loss"] - b["balance_loss"]) for a, b in zip(got["single"], got[run]))
        report.append(f"{run:6s} vs single: max |loss diff| {loss:.1e}, max |balance_loss diff| {balance:.1e}")
        assert len(got[run]) == 2 and loss <= TOL and balance <= TOL, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_zero3_finishes_when_ranks_route_to_different_experts(runs):
    """ZeRO-3 at world 2, rank 0's tokens routed to experts rank 1's never see (in every block, at the first
    step): both steps finish (a hang would fail the call's timeout), nothing registered by the user. The
    stacked experts are one module's two parameters: every rank fetches the same tensors in the same order."""
    r0, r1 = (rank[len(EXPORTED) + 1] for rank in runs["pair"])
    assert len(r0["experts"]) == len(r1["experts"]) == 2
    assert all(not set(a) & set(b) for a, b in zip(r0["experts"], r1["experts"])), (r0["experts"], r1["experts"])
    assert len(r0["losses"]) == len(r1["losses"]) == 2
    assert r0["losses"] != r1["losses"]  # each rank trained on its own tokens


def test_every_strategy_at_world_2_and_3_follows_one_process(runs, capsys):
    """single (world 1), ddp, zero1, zero2, zero3 and fsdp at world 2 and 3 train 2 steps of the tiny MoE
    (balance loss weight 0.1) on documents with a loss mask and document masking, 2 micro batches per rank:
    their losses and weights follow one process's (tests.support.moe_workers.moe_reference) within 1e-5, in
    both balance modes: `sequence` with every parameter trained, `micro_batch` with LoRA on the attention
    projections (in that mode the reference takes the balance loss over the same micro batches; at
    micro batch 2 world 1 and world 2 have the same ones). The mode matters: the two references differ."""
    root, data, report, failures = runs["root"], runs["data"], [], []
    for world, got in runs["equal"].items():
        for (variant, strategy), result in got:
            ref_losses, ref_weights = _reference(str(data), max(world, 2), variant, world)
            label = f"{variant:16s} {strategy:6s} world {world}"
            assert result["weights"].keys() == ref_weights.keys() and len(result["losses"]) == STEPS, label
            loss = max(abs(a - b) for a, b in zip(result["losses"], ref_losses))
            weight = max((result["weights"][n] - ref_weights[n]).abs().max().item() for n in ref_weights)
            report.append(f"{label}: max |loss diff| {loss:.1e}, max |param diff| {weight:.1e}")
            if loss > TOL or weight > TOL:
                failures.append(report[-1])
    with capsys.disabled():
        print("\n" + "\n".join(report))
    assert not failures, "\n".join(failures)
    # micro_batch at world 1 and 2: the same micro batches, the same reference; sequence mode's differs
    mb1, mb2 = _reference(str(data), 2, "micro_batch+lora", 1), _reference(str(data), 2, "micro_batch+lora", 2)
    assert mb1[0] == mb2[0]
    cfg = load_config(None, _equal(data, 2, "micro_batch+lora", root / "unused") + ["model.moe.balance=sequence"])
    other = moe_reference(cfg, 2)[1]
    assert max((other[n] - mb2[1][n]).abs().max().item() for n in other) > 10 * TOL


def test_resume_at_another_strategy_and_world_size_continues(runs):
    """A zero2 run at world 2 (3 micro batches per rank), its step-2 checkpoint resumed by fsdp at world 3
    (2 per rank, the same global batch of 12): steps 3 and 4 and the final weights are one process's."""
    source, resumed = runs["resume"]
    ref_losses, ref_weights = moe_reference(load_config(None, _equal(runs["data"], 2, "sequence", "/unused", accum=3,
                                                                     steps=4)), 2)
    assert source["losses"] == pytest.approx(ref_losses, abs=TOL)
    assert resumed["losses"] == pytest.approx(ref_losses[2:], abs=TOL)
    assert max((resumed["weights"][n] - ref_weights[n]).abs().max().item() for n in ref_weights) <= TOL


@functools.cache
def _reference(data: str, world: int, variant: str, split_world: int):
    """moe_reference of the equivalence run at `world`'s global batch, split into micro batches for
    `split_world` ranks."""
    return moe_reference(load_config(None, _equal(data, world, variant, "/unused")), split_world)


def test_a_lora_run_exports_for_peft_over_transformers_qwen3_moe(tmp_path, capsys):
    """LoRA on the attention projections of a qwen3_moe run (configs/sft-qwen3-moe-lora.yaml at the tiny
    shapes, single, 3 steps; decoder_sparse_step 2: block 0 dense): `zerodp convert RUN --to peft` is a
    folder the real `peft` loads over transformers' Qwen3MoeForCausalLM (the base exported with --to hf)
    and computes zerodp's logits with, as `--to hf --merge` does without peft. Adapters on a dense block's
    MLP train, but peft (0.21) would load down_proj onto the stacked experts (its transformers-5
    remapping): --to peft refuses them in one line, exit 2, nothing written."""
    from tests.distributed.test_lora_export import base_export, logits_of, train

    sparse = [*MOE, "model.moe.decoder_sparse_step=2", "model.lora.rank=4"]
    # the shipped recipe at the tiny shapes (its adapters on the attention, their dropout keyed by row)
    train(tmp_path / "run", "configs/sft-qwen3-moe-lora.yaml", *RECIPE_ON_CPU, *sparse)
    base = base_export(tmp_path / "run", tmp_path)
    for to in (["--to", "peft"], ["--to", "hf", "--merge"]):
        assert main(["convert", str(tmp_path / "run"), str(tmp_path / to[-1].strip("-")), *to, "--no-progress"]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        assert len(f.keys()) == 2 * 4 * 2
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, peft, merged = logits_of(tmp_path, base, idx)
    d_peft, d_merged = (peft - ours).abs().max().item(), (merged - ours).abs().max().item()
    with capsys.disabled():
        print(f"\nqwen3_moe LoRA: max |PEFT - zerodp| {d_peft:.1e}, max |merged - zerodp| {d_merged:.1e}")
    assert d_peft <= TOL and d_merged <= TOL
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(idx).logits
    assert (plain - ours).abs().max().item() > 1e-4  # the adapters moved the logits

    train(tmp_path / "mlp", "configs/llama-tiny.yaml", *sparse, "model.lora.targets=[q_proj, down_proj]")
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "mlp"), str(tmp_path / "mlp-peft"), "--to", "peft", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["zerodp: error: cannot export qwen3_moe adapters on down_proj for PEFT: peft reads those names on a "
                   "qwen3_moe model as its stacked experts', so these adapters would not load; export with --to hf "
                   "--merge, or adapt the attention only (model.lora.targets=[q_proj, k_proj, v_proj, o_proj])"], err
    assert not (tmp_path / "mlp-peft").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
