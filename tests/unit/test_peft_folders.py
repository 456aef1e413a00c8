"""Folders the real `peft` saves open in zerodp: `get_peft_model(model, LoraConfig(target_modules=...))
.save_pretrained(dir)` for `all-linear` (which PEFT records as full module paths), a list mixing a short
and a full name, and a regular expression, for tiny llama and gpt2 built by transformers from a config.
zerodp matches the targets as PEFT does (lora_spec.matches), takes rank, alpha and targets from the folder
(model.lora.init_from without them), starts a run from it (--dry-run), and computes PEFT's logits, through
zerodp.load_model too; `zerodp generate FOLDER` takes the tokenizer and chat template of the base the
folder names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerodp
from tests.support.sft_fixtures import CHATML, END_OF_TURN, SPECIAL
from tests.support.text_fixtures import train_bpe
from zerodp.api import model_from_source
from zerodp.cli.commands import main
from zerodp.config import ModelConfig
from zerodp.convert.lora_source import open_model
from zerodp.models.arch import arch_of
from zerodp.models.lora_spec import adapted_modules, check_targets, lora_spec

FORMS = {
    "llama": {"all-linear": "all-linear", "list": ["q_proj", "model.layers.1.mlp.down_proj"],
              "regex": r".*\.(q|v)_proj"},
    "gpt2": {"all-linear": "all-linear", "list": ["c_attn", "transformer.h.1.mlp.c_proj"],
             "regex": r"transformer\.h\.1\..*c_\w+"},
}
ADAPTED = {  # what PEFT adapts (the saved tensors' modules), per form
    ("llama", "all-linear"): 14, ("llama", "list"): 3, ("llama", "regex"): 4,
    ("gpt2", "all-linear"): 8, ("gpt2", "list"): 3, ("gpt2", "regex"): 4,
}


def hf_model(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2))
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=1,
                                      eos_token_id=2))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-bases")
    # the llama base holds a tokenizer (a byte-level BPE) and a ChatML template, as a Hugging Face model does
    tok = train_bpe(root / "llama" / "tokenizer.json", vocab_size=VOCAB, n_files=4, special=SPECIAL)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tok)).get_vocab_size() == VOCAB
    (root / "llama" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML,
                                                                      "eos_token": END_OF_TURN}))
    for family in FORMS:
        hf_model(family).save_pretrained(root / family)
    return root


def save_peft(base: Path, folder: Path, targets):
    """PEFT's folder of random rank-4 adapters on `targets` over Hugging Face folder `base`; returns the PEFT
    model (eval mode)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1)  # init_lora_weights=False: A and B random, so the adapters change the logits
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    peft.save_pretrained(folder)
    return peft.eval()


@pytest.fixture(scope="module", params=[(f, form) for f in FORMS for form in FORMS[f]], ids=lambda p: "-".join(p))
def saved(request, bases, tmp_path_factory):
    """(family, form, base folder, PEFT folder, PEFT's logits of IDX, PEFT's adapted module names)."""
    family, form = request.param
    folder = tmp_path_factory.mktemp(f"peft-{family}-{form}") / "adapter"
    model = save_peft(bases / family, folder, FORMS[family][form])
    with torch.no_grad():
        logits = model(IDX).logits
        with model.disable_adapter():
            base_logits = model(IDX).logits
    assert (logits - base_logits).abs().max().item() > 1e-3  # the adapters matter: the test can fail
    adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
               for n, _ in model.named_parameters() if ".lora_A." in n}
    return family, form, bases / family, folder, logits, adapted


IDX = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
VOCAB = 300


def test_a_folder_peft_saved_computes_peft_logits_in_zerodp(saved):
    family, form, base, folder, logits, adapted = saved
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    assert len(adapted) == ADAPTED[family, form]
    # model.lora.init_from alone: rank, alpha and targets are the folder's, adapting what PEFT adapted
    model = ModelConfig(**_model_section(family))
    spec = lora_spec({"init_from": str(folder)})
    assert (spec.rank, spec.alpha) == (4, 8.0)
    check_targets(arch_of(model), spec)
    assert set(adapted_modules(arch_of(model), spec)) == adapted
    with open_model(folder) as source, torch.no_grad():
        ours = model_from_source(source)(IDX)
    with torch.no_grad():
        api = zerodp.load_model(folder)(IDX)  # the Python API opens what the CLI opens
    diff = max((ours - logits).abs().max().item(), (api - logits).abs().max().item())
    assert diff < 1e-5, diff


def test_generate_and_load_model_open_a_peft_folder_over_its_base(bases, tmp_path, capsys):
    """generate takes the tokenizer and chat template of the base the folder names; zerodp.load_model
    computes PEFT's logits."""
    folder = tmp_path / "adapter"
    peft = save_peft(bases / "llama", folder, ["q_proj", "v_proj"])
    with torch.no_grad():
        diff = (zerodp.load_model(folder)(IDX) - peft(IDX).logits).abs().max().item()
    assert diff < 1e-5, diff
    assert not (folder / "tokenizer.json").exists()  # PEFT saves none: the base's is the one
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("def ") and len(said) > 5, said
    assert main(["generate", str(folder), "--chat", "hello", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip(), "no answer printed"


def _model_section(family: str) -> dict:
    if family == "llama":
        return dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64,
                    vocab_size=VOCAB, block_size=16)
    return dict(arch="gpt2", n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)


def test_a_run_starts_from_a_folder_peft_saved(saved, tmp_path, capsys):
    family, form, base, folder, _, _ = saved
    config = "configs/llama-tiny.yaml" if family == "llama" else "configs/tiny.yaml"
    dims = [f"model.{k}={v}" for k, v in _model_section(family).items() if k != "arch"]
    code = main(["train", config, "strategy.name=single", *dims, f"model.init_from={base}",
                 f"model.lora.init_from={folder}", "train.global_batch_size=2",
                 "train.micro_batch_size=2", "data.max_bytes=100000", f"train.out_dir={tmp_path / 'run'}",
                 "--dry-run"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "adapters: LoRA rank 4, alpha 8" in out.out  # the folder's, model.lora gave none


@pytest.mark.parametrize("targets,adapted", [
    (["model.layers.1.self_attn.q_proj", "mlp.down_proj"], ["model.layers.0.mlp.down_proj",
                                                           "model.layers.1.mlp.down_proj",
                                                           "model.layers.1.self_attn.q_proj"]),
    (r"model\.layers\.0\.self_attn\.[qk]_proj", ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"]),
    ("q_proj, v_proj", ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]),
])
def test_model_lora_targets_take_full_names_and_patterns(targets, adapted):
    arch = arch_of(ModelConfig(**_model_section("llama")))
    spec = lora_spec({"rank": 4, "targets": targets})
    check_targets(arch, spec)
    assert sorted(adapted_modules(arch, spec)) == adapted


def test_a_pattern_that_reaches_outside_the_blocks_is_refused():
    from zerodp.errors import ConfigError

    arch = arch_of(ModelConfig(**_model_section("llama")))
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets: the pattern '\.\*_proj\|lm_head' matches lm_head, "
                                          r"which zerodp never adapts \(the blocks' linear layers only\); narrow the "
                                          r"pattern$"):
        check_targets(arch, lora_spec({"rank": 4, "targets": ".*_proj|lm_head"}))
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets: the pattern '\.\*\\\.qq_proj' matches no linear "
                                          r"layer of llama's blocks \(it is matched against whole names such as "
                                          r"model\.layers\.0\.mlp\.down_proj\); its linear layers are down_proj, "):
        check_targets(arch, lora_spec({"rank": 4, "targets": r".*\.qq_proj"}))
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets: '\(q_proj' is not a valid regular expression"):
        lora_spec({"rank": 4, "targets": ["(q_proj"]})


@pytest.mark.parametrize("targets,written", [
    ([r".*\.(q|v)_proj"], r".*\.(q|v)_proj"),  # one pattern: PEFT's pattern string
    (["model.layers.1.mlp.down_proj", r".*\.0\.self_attn\.k_proj"],  # names beside a pattern: the full names
     ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"]),
])
def test_zerodp_adapters_on_full_names_and_patterns_export_to_what_peft_adapts(bases, tmp_path, targets, written):
    """The other direction: adapters of a model.lora.targets with full names and patterns, written as a PEFT
    folder (zerodp convert --to peft's writer), load in PEFT over the base and compute zerodp's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from zerodp.convert.peft import write_peft
    from zerodp.models.lora_spec import adapter_shapes

    arch = arch_of(ModelConfig(**_model_section("llama")))
    spec = lora_spec({"rank": 4, "alpha": 8, "targets": targets})
    g = torch.Generator().manual_seed(5)
    adapters = {n: torch.randn(s, generator=g) / 4 for n, s in adapter_shapes(arch, spec).items()}
    write_peft(adapters, tmp_path / "ours", arch, spec, str(bases / "llama"), {"zerodp.source": "{}"})
    assert json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_modules"] == written
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bases / "llama", dtype=torch.float32),
                                         tmp_path / "ours").eval()
        adapted = {n.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
                   for n, _ in peft.named_parameters() if ".lora_A." in n}
        diff = (zerodp.load_model(tmp_path / "ours")(IDX) - peft(IDX).logits).abs().max().item()
    assert adapted == set(adapted_modules(arch, spec)) and diff < 1e-5, (adapted, diff)
