"""Hugging Face both ways (issue 10): the name/layout table and the config.json mapping (zerodp/models/hf.py);
export (`zerodp convert --to hf`) from a checkpoint of every strategy, loaded by transformers with the same
logits; import of gpt2, llama, mistral and qwen2 folders (model.hf_config, model.init_from, `convert --to
zerodp` and resume) under every strategy with the same logits; and the errors, pinned.

The multi-rank work is two launches (world 2: ddp, zero1-3, fsdp; world 1: single), run once for the module."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.conftest import TINY
from tests.support.harness import run_distributed
from zerodp.checkpoint import store as checkpoint
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.convert import open_checkpoint
from zerodp.data.batches import TokenBatches, load_tokens
from zerodp.errors import ConfigError, UserError
from zerodp.models import arch_of, build_model, param_shapes
from zerodp.models.hf import TRANSPOSE, from_hf, hf_config_from_model, model_config_from_hf, to_hf
from zerodp.strategies.catalog import CATALOG
from zerodp.trainer.start import plan_start

TOL = 1e-5
SEQ, VOCAB = 32, 256  # TINY's block_size and the byte-level vocabulary, so imported models train on its data
STRATEGIES = {name: 1 if s.single_process else 2 for name, s in CATALOG.items()}  # name -> world size
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# a small llama on top of TINY: 4 query heads sharing 2 key/value heads (GQA), SwiGLU width 64, untied head
LLAMA = ["model.arch=llama", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.n_kv_head=2",
         "model.intermediate_size=64", "model.tie_embeddings=false"]
# zerodp models exported from a checkpoint of every strategy
EXPORTS = {
    "gpt2-tied": [],
    "gpt2-untied": ["model.tie_embeddings=false"],
    "llama-untied-gqa": LLAMA + ["model.rope_theta=50000", "model.rope_scaling=" + json.dumps(LLAMA3_ROPE)],
    "qwen2-tied": LLAMA + ["model.tie_embeddings=true", "model.qkv_bias=true"],
}
_HF_DIMS = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)
_LLAMA_DIMS = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, max_position_embeddings=SEQ, **_HF_DIMS)
# Hugging Face models imported under every strategy: untied heads, GQA, biases, rope scaling
IMPORTS = {
    "gpt2-tied": (GPT2LMHeadModel, GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=SEQ, **_HF_DIMS)),
    "gpt2-untied": (GPT2LMHeadModel, GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=SEQ,
                                                tie_word_embeddings=False, **_HF_DIMS)),
    "llama-gqa": (LlamaForCausalLM, LlamaConfig(num_attention_heads=4, num_key_value_heads=2,
                                                rope_parameters={"rope_theta": 50000.0, **LLAMA3_ROPE}, **_LLAMA_DIMS)),
    "mistral-gqa": (MistralForCausalLM, MistralConfig(num_attention_heads=4, num_key_value_heads=1,
                                                      sliding_window=SEQ, **_LLAMA_DIMS)),
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config(num_attention_heads=4, num_key_value_heads=2,
                                                 tie_word_embeddings=True, **_LLAMA_DIMS)),
}
NOT_MODEL = [o for o in TINY if not o.startswith("model.")]


def _ids(n: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def make_hf(name: str, folder):
    """A random HF model (biases and norms moved off their init, so a dropped or misplaced one shows), saved."""
    cls, cfg = IMPORTS[name]
    torch.manual_seed(len(name))
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def hf_logits(model, idx) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits.float()


def zerodp_logits(overrides: list[str], weights: dict, idx) -> torch.Tensor:
    model = build_model(load_config(None, overrides).model).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= set(model.tied_weights())
    with torch.no_grad():
        return model(idx)


# ---- the multi-rank runs, once for the module -------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf_models = {name: make_hf(name, root / "hf" / name) for name in IMPORTS}
    idx = _ids()
    jobs = {w: [] for w in set(STRATEGIES.values())}
    keys = {w: [] for w in jobs}
    for i, (strategy, world) in enumerate(STRATEGIES.items()):
        s = [f"strategy.name={strategy}"]
        for name, arch in EXPORTS.items():  # train 2 steps and save: the checkpoint to export
            jobs[world].append({"kind": "train", "overrides": TINY + arch + s + [
                "train.max_steps=2", f"train.out_dir={root / 'export' / strategy / name}"]})
            keys[world].append(("export", strategy, name))
        for name in IMPORTS:  # init_from an HF folder: the logits before the first step
            folder = root / "hf" / name
            jobs[world].append({"kind": "logits", "idx": idx.tolist(), "overrides": NOT_MODEL + s + [
                f"model.hf_config={folder}", f"model.init_from={folder}", f"train.out_dir={root / 'unused'}"]})
            keys[world].append(("import", strategy, name))
        # an HF folder converted with `zerodp convert --to zerodp`, resumed (one model per strategy, in turn)
        name = list(IMPORTS)[i % len(IMPORTS)]
        run = root / "resume" / strategy
        ckpt = run / "checkpoints" / "step_00000001"
        assert main(["convert", str(root / "hf" / name), str(ckpt), "--to", "zerodp", "--step", "1",
                     "--no-progress"]) == 0
        (ckpt.parent / "latest").write_text("step_00000001\n")
        jobs[world].append({"kind": "train", "fresh": False, "overrides": NOT_MODEL + s + [
            f"model.hf_config={root / 'hf' / name}", "train.max_steps=2", f"train.out_dir={run}"]})
        keys[world].append(("resume", strategy, name))
    results = {}
    for world in sorted(jobs, reverse=True):
        got = run_distributed("tests.support.hf_workers:hf_jobs", world, {"jobs": jobs[world]})[0]
        results.update(zip(keys[world], got))
    return {"root": root, "hf": hf_models, "idx": idx, "results": results}


def test_export_loads_in_transformers_with_the_same_logits(runs, capsys):
    """`zerodp convert CKPT DST --to hf` of a checkpoint written by each strategy at world size 2 (single: 1):
    transformers loads it with no missing, unexpected or mismatched key, and its logits are zerodp's."""
    root, idx, report = runs["root"], runs["idx"], []
    for strategy in STRATEGIES:
        for k, (name, arch) in enumerate(EXPORTS.items()):
            dst = root / "hf-out" / strategy / name
            shard = ["--max-shard-size", "40KB"] if k % 2 else []  # some sharded, with an index
            assert main(["convert", str(root / "export" / strategy / name), str(dst), "--to", "hf",
                         "--no-progress", *shard]) == 0
            assert (dst / "model.safetensors.index.json").is_file() == bool(shard)
            model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
            assert {k: v for k, v in info.items() if v} == {}, (strategy, name, info)
            want = type(model).__name__
            assert want == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                            "qwen2": "Qwen2ForCausalLM"}[name.split("-")[0]]
            assert model.config.tie_word_embeddings == name.endswith("-tied")
            ours = zerodp_logits(TINY + arch, runs["results"][("export", strategy, name)]["weights"], idx)
            diff = (hf_logits(model.eval(), idx) - ours).abs().max().item()
            report.append(f"export {strategy:6s} {name:17s} max |logit diff| {diff:.1e}")
            assert diff <= TOL, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_import_gives_the_same_logits_under_every_strategy(runs, capsys):
    """model.hf_config + model.init_from of an HF folder: before the first step, each strategy's model
    computes the HF model's logits (gpt2 tied and untied, llama with GQA and llama3 rope, mistral, qwen2)."""
    report = []
    for strategy in STRATEGIES:
        for name, model in runs["hf"].items():
            got = runs["results"][("import", strategy, name)]["logits"]
            diff = (got - hf_logits(model, runs["idx"])).abs().max().item()
            report.append(f"import {strategy:6s} {name:12s} max |logit diff| {diff:.1e}")
            assert diff <= TOL, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_converted_hf_folder_resumes_under_every_strategy(runs, capsys):
    """`zerodp convert HF --to zerodp` writes zerodp's own names and layout: every strategy resumes from it
    (single through its own loader), and the first step's loss is the HF model's on that batch."""
    report = []
    for strategy in STRATEGIES:
        key = next(k for k in runs["results"] if k[:2] == ("resume", strategy))
        name = key[2]
        cfg = load_config(None, NOT_MODEL + [f"model.hf_config={runs['root'] / 'hf' / name}"])
        data = TokenBatches(load_tokens(cfg), cfg, "train")
        x, y = data.rows(data.offsets(1, cfg.train.global_batch_size))
        logits = hf_logits(runs["hf"][name], x)
        want = F.cross_entropy(logits.view(-1, VOCAB), y.reshape(-1)).item()
        (got,) = runs["results"][key]["losses"]
        report.append(f"resume {strategy:6s} {name:12s} |loss diff| {abs(got - want):.1e}")
        assert abs(got - want) <= TOL, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))


# ---- the table and the config mapping -------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2-untied", "llama-gqa", "qwen2-tied"])
def test_table_names_every_parameter_both_ways(name):
    """Read forwards, the table turns every zerodp parameter into the HF model's own state-dict name
    (GPT-2's four Conv1D weights transposed, HF's shapes); read backwards, it gives the names back."""
    cls, hf_cfg = IMPORTS[name]
    model = cls(hf_cfg)
    hf_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        del hf_shapes["lm_head.weight"]  # tied: not stored
    cfg = load_config(None, [f"model.hf_config={_save_config(hf_cfg)}"])
    a = arch_of(cfg.model)
    mapped = {}
    for zname, shape in a.param_shapes().items():
        hname, transform = to_hf(a.family, zname)
        assert from_hf(a.family, hname) == (zname, transform)
        mapped[hname] = shape[::-1] if transform == TRANSPOSE else shape
    assert mapped == hf_shapes
    transposed = {n for n in a.param_shapes() if to_hf(a.family, n)[1]}
    if a.family == "gpt2":
        assert transposed == {f"transformer.h.{i}.{w}.weight" for i in range(2)
                              for w in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    else:
        assert transposed == set()


def _save_config(hf_cfg, folder=None):
    import tempfile
    from pathlib import Path

    folder = Path(folder or tempfile.mkdtemp())
    hf_cfg.save_pretrained(folder)
    return folder / "config.json"


@pytest.mark.parametrize("name", list(IMPORTS))
def test_config_json_both_ways(name):
    """config.json -> model.* keys -> config.json: transformers reads the export as the same model, and
    reading it back gives the same keys."""
    _, hf_cfg = IMPORTS[name]
    ours = model_config_from_hf(hf_cfg.to_dict())
    back = AutoConfig.for_model(**hf_config_from_model(ours))
    assert model_config_from_hf(back.to_dict()) == ours
    for key in ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size", "tie_word_embeddings",
                "num_key_value_heads", "intermediate_size", "rms_norm_eps", "layer_norm_epsilon", "n_inner"):
        if hasattr(hf_cfg, key) and getattr(hf_cfg, key) is not None:
            assert getattr(back, key) == getattr(hf_cfg, key), key
    if name == "llama-gqa":
        assert ours["rope_theta"] == 50000.0 and ours["rope_scaling"] == LLAMA3_ROPE
        assert back.rope_parameters["rope_type"] == "llama3" and back.rope_parameters["factor"] == 8.0


@pytest.mark.parametrize("raw, match", [
    ({"model_type": "bert"}, r"config.json: model_type 'bert' is not supported; zerodp reads gpt2, llama, mistral, "
                             r"qwen2, qwen3, qwen3_moe$"),
    ({"model_type": "llama", "attention_bias": True}, r"attention_bias=true is not supported; zerodp's llama "
                                                      r"family has biases only on q, k and v \(Qwen2\)"),
    ({"model_type": "llama", "mlp_bias": True}, r"mlp_bias=true is not supported"),
    ({"model_type": "mistral", "sliding_window": 16, "max_position_embeddings": 64},
     r"sliding_window=16 is shorter than block_size=64; zerodp attends over the whole block, so tokens more than "
     r"16 apart would see each other, which this model never did; set model.block_size <= 16"),
    ({"model_type": "gpt2", "activation_function": "relu"}, r"activation_function 'relu' is not supported; "
                                                            r"zerodp's gpt2 computes GELU's tanh approximation"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope scaling 'yarn' is not supported; zerodp computes llama3 and linear"),
    ({"model_type": "llama", "hidden_size": 64}, r"the llama config lacks 'num_attention_heads'; is it the model's "
                                                 r"config.json\?"),
])
def test_hf_config_refusals(raw, match):
    dims = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 100, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}
    full = {**dims, **raw} if "lacks" not in match else raw
    with pytest.raises(UserError, match=match):
        model_config_from_hf(full)


def test_model_hf_config_sets_every_dimension(tmp_path):
    _, hf_cfg = IMPORTS["llama-gqa"]
    path = _save_config(hf_cfg, tmp_path / "llama")
    m = load_config(None, [f"model.hf_config={tmp_path / 'llama'}"]).model
    assert (m.arch, m.n_layer, m.n_head, m.n_kv_head, m.head_dim, m.n_embd, m.intermediate_size, m.vocab_size,
            m.block_size, m.tie_embeddings, m.norm_eps, m.rope_theta) == \
        ("llama", 2, 4, 2, 8, 32, 64, VOCAB, SEQ, False, 1e-6, 50000.0)
    assert m.rope_scaling == LLAMA3_ROPE
    # a llama's block_size is the length to train at: the config's wins (not past a sliding window)
    assert load_config(None, [f"model.hf_config={path}", "model.block_size=16"]).model.block_size == 16
    # agreeing keys are fine; a contradicting one names both values
    load_config(None, [f"model.hf_config={path}", "model.n_kv_head=2", "model.arch=llama"])
    with pytest.raises(ConfigError, match=rf"^model.n_kv_head=4 in defaults \(with overrides\) contradicts "
                                          rf"model.hf_config {path}, which gives n_kv_head=2; remove model.n_kv_head "
                                          rf"or set it to 2$"):
        load_config(None, [f"model.hf_config={path}", "model.n_kv_head=4"])
    with pytest.raises(ConfigError, match=r"model.arch='gpt2' .* gives arch='llama'"):
        load_config(None, [f"model.hf_config={path}", "model.arch=gpt2"])
    gpt2 = _save_config(IMPORTS["gpt2-untied"][1], tmp_path / "gpt2")
    m = load_config(None, [f"model.hf_config={gpt2}"]).model
    assert (m.arch, m.n_head, m.block_size, m.tie_embeddings, m.bias) == ("gpt2", 4, SEQ, False, True)
    with pytest.raises(ConfigError, match=r"model.block_size=64 .* gives block_size=32"):  # gpt2: a table's size
        load_config(None, [f"model.hf_config={gpt2}", "model.block_size=64"])
    with pytest.raises(ConfigError, match=r"model.hf_config .*missing: file not found; pass a Hugging Face model "
                                          r"folder or its config.json"):
        load_config(None, [f"model.hf_config={tmp_path / 'missing'}"])


def test_contradiction_is_one_line_exit_2_via_the_cli(tmp_path, capsys):
    path = _save_config(IMPORTS["gpt2-tied"][1], tmp_path / "gpt2")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  hf_config: {path}\n  n_embd: 64\n")
    assert main(["train", str(cfg), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"zerodp: error: model.n_embd=64 in {cfg} contradicts "
                                                   f"model.hf_config {path}, which gives n_embd=32"), err


# ---- init_from checks, the untied GPT-2 head, and what convert writes --------------------------------


def test_init_from_hf_folder_of_another_model_is_refused(tmp_path):
    """The HF config.json is checked against the model being built (kv heads, tying, arch, widths) before
    anything starts; a file whose names fit while its settings do not is refused as well."""
    folder = tmp_path / "llama"
    make_hf("llama-gqa", folder)
    base = NOT_MODEL + [f"model.init_from={folder}", f"train.out_dir={tmp_path / 'run'}"]
    ok = load_config(None, base + [f"model.hf_config={folder}"])
    assert plan_start(ok, fresh=True, set_aside_damaged=False).init_from == str(folder)
    for over, diff in [(["model.n_kv_head=4"], r"model.n_kv_head=2 there, 4 here"),
                       (["model.tie_embeddings=true"], r"model.tie_embeddings=False there, True here"),
                       (["model.rope_theta=10000"], r"model.rope_theta=50000.0 there, 10000.0 here")]:
        cfg = load_config(None, base + LLAMA + ["model.rope_scaling=" + json.dumps(LLAMA3_ROPE),
                                                "model.rope_theta=50000", "model.norm_eps=1e-6"] + over)
        with pytest.raises(UserError, match=rf"^model.init_from {folder} holds a different model than this config "
                                            rf"\({diff}\); set model.hf_config: {folder} \(its config.json gives "
                                            rf"every dimension\)$"):
            plan_start(cfg, fresh=True, set_aside_damaged=False)
    gpt2 = load_config(None, base)  # zerodp's default gpt2
    with pytest.raises(UserError, match=r"model.arch='llama' there, 'gpt2' here"):
        plan_start(gpt2, fresh=True, set_aside_damaged=False)


def test_untied_gpt2_head_is_never_dropped(tmp_path):
    """An HF GPT-2 with tie_word_embeddings: false keeps its separate head: a tied model is refused (with
    or without the config.json), and the untied import computes the HF model's logits."""
    folder = tmp_path / "gpt2"
    hf = make_hf("gpt2-untied", folder)
    tied = load_config(None, NOT_MODEL + ["model.n_head=4", "model.n_layer=2", "model.n_embd=32",
                                          f"model.block_size={SEQ}"])
    with pytest.raises(UserError, match=r"model.tie_embeddings=False there, True here"):
        plan_start(_with(tied, init_from=str(folder)), fresh=True, set_aside_damaged=False)
    bare = tmp_path / "bare.safetensors"  # the weights alone: the names tell
    shutil.copy(folder / "model.safetensors", bare)
    check = checkpoint.check_model(bare, tied.to_dict()["model"], param_shapes(tied.model))
    assert check.problem == "1 parameters there are not in this model (e.g. lm_head.weight)"
    untied = load_config(None, [f"model.hf_config={folder}"])
    with open_checkpoint(bare) as src:
        from zerodp.strategies.common import FullState

        state = FullState(src, with_optimizer=False)
        assert state.mismatch(param_shapes(untied.model)) is None
        weights = {n: state.get(n, "param", s) for n, s in param_shapes(untied.model).items()}
    assert not torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    diff = (zerodp_logits([f"model.hf_config={folder}"], weights, _ids()) - hf_logits(hf, _ids())).abs().max()
    assert diff <= TOL


def _with(cfg, **model):
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_convert_to_zerodp_writes_zerodp_names_and_layout(tmp_path):
    """From HF's GPT2Model layout (no `transformer.` prefix, Conv1D weights (in, out), mask buffers), the
    zerodp checkpoint holds nn.Linear (out, in) weights under the model's names, and records the tie."""
    hf = make_hf("gpt2-tied", tmp_path / "full")
    conv = {k: v for k, v in load_file(tmp_path / "full" / "model.safetensors").items()}
    bare = {k.removeprefix("transformer."): v for k, v in conv.items()}
    bare.update({f"h.{i}.attn.bias": torch.ones(1, 1, SEQ, SEQ) for i in range(2)})
    save_file(bare, tmp_path / "gpt2model.safetensors")
    for src in (tmp_path / "full", tmp_path / "gpt2model.safetensors"):
        dst = tmp_path / f"z-{src.stem}"
        assert main(["convert", str(src), str(dst), "--to", "zerodp", "--no-progress"]) == 0
        with safe_open(dst / "model.safetensors", "pt") as f:
            names = set(f.keys())
            c_attn = f.get_tensor("transformer.h.0.attn.c_attn.weight")
            assert f.metadata()["zerodp.layout"] == "zerodp"
        assert names == set(param_shapes(load_config(None, [f"model.hf_config={tmp_path / 'full'}"]).model))
        assert torch.equal(c_attn, conv["transformer.h.0.attn.c_attn.weight"].t())
        assert checkpoint.read_meta(dst)["params"]["transformer.h.0.mlp.c_fc.weight"]["shape"] == [128, 32]
    meta = checkpoint.read_meta(tmp_path / "z-full")  # config.json says the head is tied; the bare file cannot
    assert meta["tied"] == {"lm_head.weight": "transformer.wte.weight"} and meta["config"]["model"]["n_head"] == 4
    del hf


def test_hf_output_is_replaced_only_with_overwrite(tmp_path, capsys):
    folder = tmp_path / "llama"
    make_hf("llama-gqa", folder)
    dst = tmp_path / "out"
    assert main(["convert", str(folder), str(dst), "--to", "hf", "--no-progress"]) == 0
    # the source's generation_config.json (transformers writes one) comes along, as every file it was given
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((dst / "config.json").read_text())["max_position_embeddings"] == SEQ
    assert main(["convert", str(folder), str(dst), "--to", "hf", "--no-progress"]) == 2
    assert "already exists and is not empty; choose a new folder or pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(folder), str(dst), "--to", "hf", "--no-progress", "--overwrite",
                 "--max-shard-size", "20KB"]) == 0
    assert (dst / "model.safetensors.index.json").is_file() and not (dst / "model.safetensors").exists()
    assert main(["convert", str(folder), str(dst), "--to", "safetensors", "--overwrite"]) == 2
    assert "is the output of `zerodp convert --to hf`" in capsys.readouterr().err
    (dst / "tokenizer.json").write_text("{}")
    assert main(["convert", str(folder), str(dst), "--to", "hf", "--overwrite"]) == 2
    assert "holds tokenizer.json, which zerodp convert did not write" in capsys.readouterr().err


def test_export_refuses_what_hf_cannot_express(tmp_path, capsys):
    with pytest.raises(UserError, match=r"a gpt2 model with model.bias=false has no Hugging Face equivalent "
                                        r"\(GPT2LMHeadModel always has biases\); export it with --to safetensors"):
        hf_config_from_model(load_config(None, ["model.bias=false"]).to_dict()["model"])
    weights = tmp_path / "w.safetensors"
    save_file({"x.weight": torch.zeros(2)}, weights)
    assert main(["convert", str(weights), str(tmp_path / "o"), "--to", "hf"]) == 2
    assert capsys.readouterr().err == (f"zerodp: error: {weights} records no model config (a safetensors checkpoint "
                                       f"written outside zerodp); pass --config with the zerodp config it was "
                                       f"trained with\n")


def test_export_with_config_for_a_source_without_one(tmp_path):
    """Weights alone in zerodp's layout (nn.Linear (out, in), as `c_attn`'s (3h, h) shape tells) plus
    `--config`: transformers loads the export and computes zerodp's logits."""
    yaml = tmp_path / "c.yaml"
    yaml.write_text("model:\n  n_layer: 2\n  n_head: 2\n  n_embd: 32\n  block_size: 32\n  tie_embeddings: false\n")
    cfg = load_config(yaml)
    torch.manual_seed(5)
    model = build_model(cfg.model).eval()
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, tmp_path / "w.safetensors")
    dst = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "w.safetensors"), str(dst), "--to", "hf", "--config", str(yaml),
                 "--no-progress"]) == 0
    hf, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    with torch.no_grad():
        assert (hf_logits(hf.eval(), _ids()) - model(_ids())).abs().max() <= TOL
