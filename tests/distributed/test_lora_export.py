"""A LoRA run leaves zerodp the way users take it: `zerodp convert RUN --to peft` is a folder the real
`peft` client loads over the base's Hugging Face export and computes zerodp's logits with; `--to hf
--merge` is a plain Hugging Face model that computes the same; `zerodp eval` of the run prints the val_loss
it logged; a run with model.lora.init_from = a PEFT export starts where that run ended.

Tiny llama and gpt2 (fp32, strategy single, 3 steps): the base is the seed's initial weights (the run sets
no model.init_from), exported for transformers as a user would export a base model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import zerodp
from tests.support.cli_checks import one_line_error
from zerodp.api import model_from_source
from zerodp.cli.commands import main
from zerodp.config import from_dict, resolve_model
from zerodp.convert.lora_base import base_sha256
from zerodp.convert.lora_source import open_model
from zerodp.models import build_model
from zerodp.models.hf import TRANSPOSE, to_hf

SMALL = ["strategy.name=single", "model.n_layer=2", "model.n_embd=32", "model.block_size=16",
         "train.global_batch_size=2", "train.micro_batch_size=2", "train.progress=false", "train.sample_tokens=0",
         "data.max_bytes=200000", "data.prefetch=0", "optim.warmup_steps=1"]
FAMILIES = {
    "llama": ["configs/llama-tiny.yaml", "model.intermediate_size=64", "model.lora.rank=4",
              "model.lora.targets=[q_proj, v_proj, down_proj]"],
    "gpt2": ["configs/tiny.yaml", "model.n_head=2", "model.lora.rank=4", "model.lora.alpha=16"],  # all-linear
}


def train(out, config, *extra):
    assert main(["train", config, *SMALL, "train.max_steps=3", "train.eval_every=3", "checkpoint.every=3",
                 f"train.out_dir={out}", *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_meta(run) -> dict:
    return json.loads((run / "checkpoints" / "step_00000003" / "meta.json").read_text())


def base_config(run):
    """The ModelConfig of the run's base: its model section without model.lora."""
    model = {k: v for k, v in run_meta(run)["config"]["model"].items() if k != "lora"}
    return resolve_model(from_dict({"model": model}, "base")).model


def base_export(run, out):
    """The run's base (its seed's initial weights) as a Hugging Face folder, through zerodp convert --to hf."""
    meta = run_meta(run)
    model = {k: v for k, v in meta["config"]["model"].items() if k != "lora"}
    base = build_model(base_config(run), seed=meta["config"]["train"]["seed"])
    (out / "base").mkdir()
    save_file({n: p.detach() for n, p in base.named_parameters()}, out / "base" / "model.safetensors",
              metadata={"zerodp.config": json.dumps({"model": model}), "zerodp.layout": "zerodp"})
    assert main(["convert", str(out / "base"), str(out / "base-hf"), "--to", "hf", "--no-progress"]) == 0
    return out / "base-hf"


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tmp_path_factory):
    family = request.param
    tmp = tmp_path_factory.mktemp(f"lora-{family}")
    config, *settings = FAMILIES[family]
    metrics = train(tmp / "run", config, *settings)
    base = base_export(tmp / "run", tmp)
    for to in (["--to", "peft"], ["--to", "hf", "--merge"]):
        assert main(["convert", str(tmp / "run"), str(tmp / to[-1].strip("-")), *to, "--no-progress"]) == 0
    return family, tmp, metrics, base


def logits_of(tmp, base, idx):
    """(zerodp's LoRA model, PEFT over transformers' base, transformers' merged export) logits of `idx`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with open_model(tmp / "run") as source, torch.no_grad():
        ours = model_from_source(source).eval()(idx)
    with torch.no_grad():
        hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        peft = PeftModel.from_pretrained(hf_base, tmp / "peft").eval()(idx).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp / "merge", dtype=torch.float32).eval()(idx).logits
    return ours, peft, merged


def test_peft_and_the_merged_export_compute_the_lora_model(exported, capsys):
    family, tmp, _, base = exported
    config = json.loads((tmp / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_dropout"]) == ("LORA", "CAUSAL_LM", 4,
                                                                                                0.0)
    assert config["fan_in_fan_out"] is (family == "gpt2")  # GPT-2's c_attn, c_proj, c_fc are Conv1D in HF's layout
    assert config["target_modules"] == (["c_attn", "c_fc", "c_proj"] if family == "gpt2" else
                                        ["q_proj", "v_proj", "down_proj"])
    assert config["lora_alpha"] == (16 if family == "gpt2" else 8)
    with safe_open(tmp / "peft" / "adapter_model.safetensors", "pt") as f:
        keys = set(f.keys())
    with safe_open(tmp / "run" / "checkpoints" / "step_00000003" / "model.safetensors", "pt") as f:
        trained = set(f.keys())
    # PEFT's keys are the HF names of the adapted layers (the family's table) under base_model.model.
    modules = {n.rpartition(".lora_")[0] for n in trained}
    hf_modules = {to_hf(family, f"{m}.weight")[0].removesuffix(".weight") for m in modules}
    assert keys == {f"base_model.model.{m}.lora_{x}.weight" for m in hf_modules for x in "AB"}
    assert len(keys) == len(trained) == (2 * 2 * 4 if family == "gpt2" else 2 * 2 * 3)
    if family == "gpt2":
        assert all(to_hf(family, f"{m}.weight")[1] == TRANSPOSE for m in modules)

    # the base is the seed's initial weights, which no folder holds: written inside, and named
    assert config["base_model_name_or_path"] == str((tmp / "peft" / "base").resolve())
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ours, peft, merged = logits_of(tmp, base, idx)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        own = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32).eval()
        on_own_base = PeftModel.from_pretrained(own, tmp / "peft").eval()(idx).logits
        api = zerodp.load_model(tmp / "run")(idx)  # the Python API opens a LoRA run as eval and convert do
    assert (on_own_base - ours).abs().max().item() < 1e-5 and (api - ours).abs().max().item() == 0
    with torch.no_grad():
        plain = build_model(base_config(tmp / "run"), seed=1337)(idx)  # train.seed's initial weights: the base
    d_peft, d_merged = (peft - ours).abs().max().item(), (merged - peft).abs().max().item()
    with capsys.disabled():  # the figures, for `pytest -s`
        print(f"\n{family}: max |PEFT - zerodp| {d_peft:.2e}, max |merged - PEFT| {d_merged:.2e}")
    assert d_peft < 1e-5 and d_merged < 1e-5
    assert (ours - plain).abs().max().item() > 1e-3  # the adapters trained: the test can fail

    # A LoRA checkpoint as a Hugging Face model needs --merge; an output is never written over
    capsys.readouterr()
    one_line_error(capsys, main(["convert", str(tmp / "run"), str(tmp / "hf"), "--to", "hf", "--no-progress"]),
                   r"^zerodp: error: .*run is a LoRA run's checkpoint \(its adapters alone, not a model\); pass "
                   r"--merge for the base with the adapters merged in, or --to peft for a PEFT adapter folder$")
    assert not (tmp / "hf").exists()
    before = (tmp / "peft" / "adapter_model.safetensors").read_bytes()
    one_line_error(capsys, main(["convert", str(tmp / "run"), str(tmp / "peft"), "--to", "peft", "--no-progress"]),
                   r"^zerodp: error: .*peft already exists and is not empty; choose a new folder or pass --overwrite$")
    one_line_error(capsys, main(["convert", str(tmp / "run"), str(tmp / "merge"), "--to", "peft", "--overwrite",
                                 "--no-progress"]),
                   r"^zerodp: error: .*merge is the output of `zerodp convert --to hf`; zerodp convert --to peft never "
                   r"replaces it")
    assert (tmp / "peft" / "adapter_model.safetensors").read_bytes() == before
    (tmp / "theirs").mkdir()  # a PEFT folder of someone else's (no zerodp metadata) is never replaced
    (tmp / "theirs" / "adapter_config.json").write_text("{}")
    one_line_error(capsys, main(["convert", str(tmp / "run"), str(tmp / "theirs"), "--to", "peft", "--overwrite"]),
                   r"theirs is a PEFT adapter folder zerodp convert did not write; zerodp convert --to peft never "
                   r"replaces it, even with --overwrite")
    assert main(["convert", str(tmp / "run"), str(tmp / "peft"), "--to", "peft", "--overwrite", "--no-progress"]) == 0
    assert (tmp / "peft" / "adapter_model.safetensors").read_bytes() == before  # its own output: replaced, the same
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith(".")) == []  # no staging folder left


def test_eval_and_generate_see_base_plus_adapters(exported, capsys, tmp_path):
    """zerodp eval of the LoRA run prints the val_loss it logged; its PEFT folder (its base named) and merged
    export evaluate alike; generate prints the same text from the run and from the merged export. With the
    base read from model.init_from (the meta of a copy names the base's export) the merge is the same."""
    family, tmp, metrics, base = exported
    capsys.readouterr()
    assert main(["eval", str(tmp / "run"), "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert abs(got["val_loss"] - metrics[-1]["val_loss"]) < 1e-6, (got, metrics[-1])
    peft = tmp / "peft-named"
    shutil.copytree(tmp / "peft", peft)
    config = json.loads((peft / "adapter_config.json").read_text())
    (peft / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
    data = ["data.source=builtin", "data.max_bytes=200000", "--max-tokens", "400", "--json", "--no-progress"]
    results = []
    for path in (peft, tmp / "merge"):
        assert main(["eval", str(path), *data]) == 0
        results.append(json.loads(capsys.readouterr().out)["val_loss"])
    assert abs(results[0] - results[1]) < 1e-5, results
    # the PEFT folder merged over the base it names: the run's merged export, bit for bit
    assert main(["convert", str(peft), str(tmp_path / "peft-merged"), "--to", "hf", "--merge", "--no-progress"]) == 0
    same(tmp / "merge", tmp_path / "peft-merged")
    capsys.readouterr()
    assert main(["inspect", str(tmp / "run")]) == 0 and main(["inspect", str(peft)]) == 0
    said = capsys.readouterr().out
    assert "(LoRA adapters alone: rank 4" in said and "base the initial weights of seed 1337)" in said
    assert f"(PEFT LORA adapter: r 4, alpha {16 if family == 'gpt2' else 8}, targets" in said and str(base) in said
    texts = []
    for path in (tmp / "run", tmp / "merge", tmp / "peft"):  # the PEFT export over the base written inside it
        assert main(["generate", str(path), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) > 4
    if family != "llama":
        return
    # the base from model.init_from, read through zerodp.convert (here its Hugging Face export)
    copy = tmp / "from-init"
    shutil.copytree(tmp / "run" / "checkpoints" / "step_00000003", copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["config"]["model"]["init_from"] = str(base)
    meta["lora"]["base"] = {"init_from": str(base), "seed": meta["lora"]["base"]["seed"],
                            "sha256": base_sha256(str(base), meta["config"]["model"], 0, None)}
    (copy / "meta.json").write_text(json.dumps(meta))
    assert main(["convert", str(copy), str(tmp / "merge-init"), "--to", "hf", "--merge", "--no-progress"]) == 0
    same(tmp / "merge", tmp / "merge-init")  # (written beside the run and the base: neither one's folder)
    # the base at that path is no longer the one the adapters were trained on: refused, nothing written
    meta["lora"]["base"]["sha256"] = "0" * 64
    (copy / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["convert", str(copy), str(tmp / "merge-other"), "--to", "hf", "--merge", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is not the one" in err and "000000000000 recorded" in err and err.count("\n") == 1, err
    assert not (tmp / "merge-other").exists()


def same(one, other) -> None:
    """Two Hugging Face exports hold the same tensors, bit for bit."""
    with safe_open(one / "model.safetensors", "pt") as a, safe_open(other / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_a_run_from_a_peft_export_starts_where_its_run_ended(exported, tmp_path):
    """model.lora.init_from = the PEFT export: the new run's adapters are the old run's last ones, so
    its validation after one step at a learning rate of 1e-12 is the old run's last val_loss."""
    family, tmp, metrics, _ = exported
    config, *settings = FAMILIES[family]
    again = train(tmp_path / "again", config, *settings, f"model.lora.init_from={tmp / 'peft'}", "train.max_steps=1",
                  "train.eval_every=1", "checkpoint.every=1", "optim.lr=1e-12", "optim.min_lr=1e-12")
    assert abs(again[-1]["val_loss"] - metrics[-1]["val_loss"]) < 1e-6, (again[-1], metrics[-1])
    assert abs(again[0]["loss"] - metrics[0]["loss"]) > 1e-4  # the first run started elsewhere (B = 0)


def test_a_lora_run_resumes_only_on_the_base_it_was_trained_on(exported, tmp_path, capsys):
    """A LoRA run on a base folder (model.init_from): a resume with another model.lora.dropout is accepted;
    one whose base weights changed says the weights at that path changed; a missing base says it is not
    there; `zerodp inspect` checks the base and says either. model.init_from at a LoRA run's checkpoint
    says it holds adapters. Each refusal one line, nothing written."""
    family, tmp, _, base = exported
    if family != "llama":
        return
    config, *settings = FAMILIES[family]
    capsys.readouterr()
    one_line_error(capsys, main(["train", config, *SMALL, *settings, f"model.init_from={tmp / 'run'}",
                                 f"train.out_dir={tmp_path / 'wrong'}", "--dry-run"]),
                   rf"^zerodp: error: model\.init_from {tmp / 'run'} is a LoRA run's checkpoint \(its adapters alone, "
                   rf"not a model\); to go on from its adapters, export them with `zerodp convert {tmp / 'run'} OUT "
                   r"--to peft` and set model\.lora\.init_from=OUT, or merge them into a model with `zerodp convert "
                   rf"{tmp / 'run'} OUT --to hf --merge` and set model\.init_from=OUT$")
    assert not (tmp_path / "wrong").exists()
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    run = tmp_path / "run"
    train(run, config, *settings, f"model.init_from={copy}")
    # dropout is a training setting: the adapters resume under another (docs/checkpoints.md)
    assert main(["train", config, *SMALL, *settings, f"model.init_from={copy}", f"train.out_dir={run}",
                 "model.lora.dropout=0.1", "train.max_steps=4", "train.eval_every=4", "checkpoint.every=4"]) == 0
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    capsys.readouterr()
    # (--dry-run: the same start checks; a refused launch leaves its process at once, a test's included)
    resume = ["train", config, *SMALL, *settings, f"model.init_from={copy}", f"train.out_dir={run}",
              "train.max_steps=5", "--dry-run"]
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    one_line_error(capsys, main([*resume, "model.lora.rank=8", "model.lora.targets=[q_proj]"]),
                   r"holds a different model than this config \(model\.lora\.rank=4 there, 8 here, "
                   r"model\.lora\.alpha=8 there, 16 here, model\.lora\.targets=\[q_proj, v_proj, down_proj\] there, "
                   r"\[q_proj\] here\); rerun with the checkpoint's model settings")
    weights = copy / "model.safetensors"
    with safe_open(weights, "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, tmp_path / "changed.safetensors", metadata=metadata)
    (tmp_path / "changed.safetensors").replace(weights)  # the same path, other weights
    one_line_error(capsys, main(resume),
                   rf"^zerodp: error: {run / 'checkpoints'}/step_00000004 holds LoRA adapters trained on the base "
                   rf"model {copy} \(model\.init_from\), and the weights at that path changed since \(sha256 \w{{12}} "
                   r"recorded, \w{12} now\): they would be resumed on weights they were not fitted to; put the "
                   r"original base back there, or start over with --fresh$")
    assert main(["inspect", str(run)]) == 1
    said = capsys.readouterr().out
    assert f"base:        {copy} (model.init_from): CHANGED" in said, said
    assert f"integrity:   every file present and intact, but the weights at {copy} changed since" in said, said
    assert "integrity:   ok" not in said
    copy.rename(tmp_path / "moved")
    one_line_error(capsys, main(resume), rf"^zerodp: error: model\.init_from {copy} does not exist: the base model is "
                                         r"not there; run where it is or copy it to that path")
    one_line_error(capsys, main([*resume, f"model.hf_config={copy}", "model.n_layer=2"]),
                   rf"^zerodp: error: the base model {copy} \(model\.init_from and model\.hf_config\) is not here; run "
                   r"where it is, or copy it to that path$")
    assert main(["inspect", str(run)]) == 1
    said = capsys.readouterr().out
    assert f"base:        {copy} (model.init_from): NOT HERE" in said and "integrity:   ok" not in said, said
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # nothing written


def test_a_run_starts_from_a_folder_peft_itself_saved(exported, tmp_path):
    """`get_peft_model(base, LoraConfig(target_modules="all-linear")).save_pretrained` records the targets
    as full module names; model.lora.init_from = that folder, with no rank, alpha or targets given, starts
    a run on the same base (one step at a learning rate of 1e-12) whose model computes PEFT's logits."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    family, _, _, base = exported
    config, *settings = FAMILIES[family]
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(3)  # init_lora_weights=False: A and B random, so the adapters change the logits
    get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
                   ).save_pretrained(tmp_path / "theirs")
    assert "." in json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())["target_modules"][0]
    plain = [s for s in settings if not s.startswith("model.lora.")]  # rank, alpha, targets: the folder's
    train(tmp_path / "run", config, *plain, f"model.init_from={base}", f"model.lora.init_from={tmp_path / 'theirs'}",
          "train.max_steps=1", "train.eval_every=1", "checkpoint.every=1", "optim.lr=1e-12", "optim.min_lr=1e-12")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                         tmp_path / "theirs").eval()(idx).logits
        plain_logits = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(idx).logits
        ours = zerodp.load_model(tmp_path / "run")(idx)
    assert (ours - peft).abs().max().item() < 1e-5
    assert (peft - plain_logits).abs().max().item() > 1e-3  # the adapters matter: the test can fail
