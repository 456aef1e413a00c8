"""Mixtures of experts on one process: model.moe's settings (zerodp.models.moe_spec), where what a user gets
wrong is one line naming the key and the fix and `zerodp train` exits 2 before anything is written; and the
experts' two ways to compute (zerodp.models.moe.Experts)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.errors import ConfigError
from zerodp.models import arch_of

MOE = ["model.arch=qwen3_moe", "model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.intermediate_size=64"]

BAD = {
    "model.moe.num_experts_per_tok=9": r"^model.moe.num_experts_per_tok=9 is above model.moe.num_experts=8: a token "
                                       r"cannot go to more experts than there are; set num_experts_per_tok <= 8$",
    "model.moe.num_experts=0": r"^model.moe.num_experts=0 must be a whole number >= 1; a mixture of experts needs at "
                               r"least one expert \(8, 64, 128 are usual\)$",
    "model.moe.balance=batch": r"^model.moe.balance='batch' is not a balance mode; did you mean 'micro_batch'\? choose "
                               r"sequence \(per sequence, the same at any micro batch or world size\) or micro_batch "
                               r"\(transformers' loss\)$",
    "model.moe.router_aux_loss_coef=-0.1": r"^model.moe.router_aux_loss_coef=-0.1 must be a number >= 0 \(0.001 is "
                                           r"usual; 0 trains without the balance loss\)$",
    "model.moe.num_expert=4": r"^unknown key 'num_expert' in model.moe; did you mean 'num_experts'\?$",
}


@pytest.mark.parametrize("override", list(BAD))
def test_bad_moe_settings_are_one_line(override):
    with pytest.raises(ConfigError, match=BAD[override]):
        load_config(None, MOE + [override])


def test_moe_on_a_dense_family_is_refused():
    with pytest.raises(ConfigError, match=r"^model.moe applies to a mixture of experts \(model.arch=qwen3_moe\), not "
                                          r"llama; remove model.moe or set model.arch=qwen3_moe$"):
        load_config(None, ["model.arch=llama", "model.moe.num_experts=4"])


def test_the_experts_of_a_config_json_win_and_the_balance_mode_is_the_users(tmp_path):
    """model.hf_config sets the experts; model.moe.balance may be set beside it, a contradicting expert count not."""
    raw = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256,
           "max_position_embeddings": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "norm_topk_prob": True, "mlp_only_layers": [0], "router_aux_loss_coef": 0.01}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(None, [f"model.hf_config={tmp_path}", "model.moe.balance=micro_batch"])
    assert cfg.model.moe["balance"] == "micro_batch" and cfg.model.moe["router_aux_loss_coef"] == 0.01
    a = arch_of(cfg.model)
    assert (a.n_experts, a.experts_per_token, a.expert_ffn, a.dense_layers, a.norm_topk_prob) == (4, 2, 16, (0,), True)
    with pytest.raises(ConfigError, match=r"^model.moe.num_experts=8 contradicts model.hf_config .*config.json, which "
                                          r"gives num_experts=4; remove model.moe.num_experts or set it to 4$"):
        load_config(None, [f"model.hf_config={tmp_path}", "model.moe.num_experts=8"])


def test_zerodp_train_with_bad_moe_settings_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", *MOE, "model.moe.num_experts=2", "model.moe.num_experts_per_tok=3",
                 f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_experts_per_tok=3 is above model.moe.num_experts=2" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("target", ["gate_up_proj", "mlp.experts", "down_proj"])
def test_adapters_on_the_router_or_experts_are_refused_in_one_line(tmp_path, capsys, target):
    """The stacked experts and the router take no adapter (down_proj, every block sparse: the experts'): one line
    that says which layers do, exit 2, nothing written."""
    out = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", *MOE, "model.lora.rank=4", f"model.lora.targets=[q_proj, {target}]",
                 f"train.out_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"zerodp: error: model.lora.targets: '{target}' is the router or the stacked experts of qwen3_moe's "
                   f"mixture of experts, which take no adapter; adapters go on k_proj, o_proj, q_proj, v_proj (or "
                   f"all-linear), or train without model.lora"], err
    assert not out.exists()


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")
def test_the_grouped_matmul_computes_what_the_loop_over_experts_does(monkeypatch):
    """The CUDA path (tokens sorted by expert, one grouped matmul per projection, offsets from the counts) run
    on the CPU, where torch's grouped_mm takes fp32: the same outputs and gradients as one matmul per expert,
    two of the eight experts receiving no token."""
    from zerodp.models import moe

    torch.manual_seed(0)
    experts = moe.Experts(32, 16, 8)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    chosen = torch.stack([torch.randperm(6)[:2] for _ in range(64)])  # experts 6 and 7 idle
    weights = torch.rand(64, 2)
    results = []
    for grouped in (False, True):
        monkeypatch.setattr(moe, "_grouped", lambda rows, w, grouped=grouped: grouped)
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).requires_grad_()
        experts.zero_grad()
        out = experts(x, chosen, weights)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    assert results[1][3][6:].abs().sum() == 0
    for loop, grouped in zip(*results):
        assert (loop - grouped).abs().max() <= 1e-5


def test_adapters_leave_the_router_and_the_experts_alone():
    """LoRA all-linear on a qwen3_moe adapts the attention and the dense blocks' MLP, not the router (no
    linear layer PEFT adapts either) nor the stacked experts; a target naming only those is one line."""
    from zerodp.models import build_model
    from zerodp.models.lora_spec import adapted_modules, lora_spec

    cfg = load_config(None, MOE + ["model.moe.mlp_only_layers=[1]", "model.lora.rank=4"])
    adapted = {m.split(".", 3)[3] for m in adapted_modules(arch_of(cfg.model), lora_spec(cfg.model.lora))}
    assert adapted == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    model = build_model(cfg.model, seed=1)  # the adapters built where the spec says (an assert otherwise)
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".experts." in n or ".mlp.gate." in n)
    with pytest.raises(ConfigError, match=r"^model.lora.targets: 'gate' is the router or the stacked experts of "
                                          r"qwen3_moe's mixture of experts, which take no adapter; adapters go on "
                                          r"down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj \(or "
                                          r"all-linear\), or train without model.lora$"):
        load_config(None, MOE + ["model.moe.mlp_only_layers=[1]", "model.lora.rank=4", "model.lora.targets=[gate]"])


def test_a_resume_at_another_micro_batch_says_what_it_changes_in_micro_batch_mode(tmp_path):
    """model.moe.balance=micro_batch: a resume at another train.micro_batch_size says, in its start-up line,
    that the balance loss (and so what is trained) changes with it; sequence mode has nothing to say."""
    from zerodp.trainer.resume import carry_over

    for balance, said in (("micro_batch", True), ("sequence", False)):
        cfg = load_config(None, MOE + [f"model.moe.balance={balance}", "train.micro_batch_size=4"])
        saved = json.loads(json.dumps(cfg.to_dict()))
        saved["train"]["micro_batch_size"] = 2
        carried = carry_over(cfg, tmp_path, {"step": 10, "config": saved}, {"samples": 160}, False)
        note = [s for s in carried.said if "balance" in s]
        assert note == ([("train.micro_batch_size=2 there, 4 here with model.moe.balance=micro_batch: the balance "
                          "loss is taken over each micro batch of 4 sequences, so the micro batch size changes what "
                          "is trained (model.moe.balance=sequence does not)")] if said else [])


def test_router_telemetry_names_the_idle_experts(group, tmp_path, monkeypatch, capsys):
    """A router set to send every token to experts 2 and 5 (of 8, in both sparse blocks): each log interval's
    last record holds, per block, the most loaded expert's share against the mean (8 / 2 = 4.0), the least
    used one's (0.0) and the six idle experts; a line says so once per interval and the log line sums it up.
    The counts are the blocks' own, added up on the device and read with the step figures."""
    from zerodp.models.moe import Router
    from zerodp.trainer.loop import train

    routed = Router.forward

    def two_experts(self, x):
        probs, weights, experts = routed(self, x)
        return probs, weights, torch.tensor([2, 5]).expand_as(experts)

    monkeypatch.setattr(Router, "forward", two_experts)
    cfg = load_config(None, TINY + MOE + ["model.n_kv_head=2", "strategy.name=single", "train.max_steps=4",
                                          "train.log_every=2", "train.global_batch_size=4",
                                          f"train.out_dir={tmp_path}"])
    train(cfg, fresh=True)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ["moe/max_load" in r for r in records] == [False, True, False, True]
    for r in records[1::2]:
        assert r["moe/max_load"] == [4.0, 4.0] and r["moe/min_load"] == [0.0, 0.0]
        assert r["moe/idle_experts"] == [[0, 1, 3, 4, 6, 7]] * 2
    err = capsys.readouterr().err
    for steps in ("steps 1-2", "steps 3-4"):
        assert (f"router: 12 expert(s) received no token in {steps} (block 0: 0, 1, 3, 4, 6, 7; block 1: 0, 1, 3, 4, "
                f"6, 7): they train on nothing while idle; a larger model.moe.router_aux_loss_coef spreads the "
                f"tokens") in err, err
    assert ", experts max load 4.00x mean, 12 idle, lr " in err, err


def test_router_telemetry_of_a_balanced_interval():
    """router_figures on counts a real router could give: shares against the mean, no line without an idle
    expert."""
    from zerodp.telemetry.router import idle_warning, router_figures

    figures = router_figures([[4.0, 2.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    assert figures == {"moe/max_load": [2.0, 1.0], "moe/min_load": [0.5, 1.0], "moe/idle_experts": [[], []]}
    assert idle_warning(figures, [0, 1], 1, 10) is None
