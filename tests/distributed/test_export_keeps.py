"""What a conversion keeps (issue 38): the context and rope of the Hugging Face model a run started from
(item 6); the tokenizer and chat template through every conversion, and `zerodp generate` refusing to
guess an encoding for a model whose vocabulary is not bytes (item 7); a DST named like a file refused, and
one default sampling seed for a run and its export (item 18). Tiny models written by transformers (no
download), read back by transformers."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY
from tests.support.harness import run_distributed
from tests.support.sft_fixtures import CHATML, END_OF_TURN, llama_folder
from zerodp.cli.commands import main

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
NOT_MODEL = [o for o in TINY if not o.startswith("model.")]


def llama31_folder(folder):
    """A 2-layer Llama of width 32 saved by transformers with Llama 3.1's context (131,072) and rope
    (llama3 scaling, theta 500,000), over the byte-level vocabulary the built-in data has."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
                         rope_parameters={"rope_theta": 500000.0, **LLAMA31_ROPE}, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """(the Llama 3.1-shaped folder, a run fine-tuned from it at block_size 16 for one step on one process)."""
    root = tmp_path_factory.mktemp("keeps")
    hf = llama31_folder(root / "llama31")
    run = root / "run"
    overrides = NOT_MODEL + [f"model.hf_config={hf}", f"model.init_from={hf}", "model.block_size=16",
                             "train.max_steps=1", "checkpoint.every=1", f"train.out_dir={run}", "train.seed=7"]
    run_distributed("tests.support.hf_workers:hf_jobs", 1, {"jobs": [{"kind": "train", "overrides": overrides}]})
    return hf, run


def test_export_keeps_the_context_and_rope_of_the_model_it_started_from(finetuned, tmp_path, capfd):
    """Item 6: the export of a run fine-tuned at block_size 16 said max_position_embeddings 16 (transformers:
    "original_max_position_embeddings field must be less than max_position_embeddings"); it keeps the
    source's 131,072 and rope, directly and through a zerodp checkpoint and back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, run = finetuned
    direct, back = tmp_path / "hf", tmp_path / "hf-again"
    assert main(["convert", str(run), str(direct), "--to", "hf", "--no-progress"]) == 0
    assert main(["convert", str(direct), str(tmp_path / "z"), "--to", "zerodp", "--no-progress"]) == 0
    assert main(["convert", str(tmp_path / "z"), str(back), "--to", "hf", "--no-progress"]) == 0
    capfd.readouterr()
    source = AutoConfig.from_pretrained(hf)
    for export in (direct, back):
        assert json.loads((export / "config.json").read_text())["max_position_embeddings"] == 131072
        config = AutoConfig.from_pretrained(export)
        assert config.max_position_embeddings == source.max_position_embeddings
        assert config.rope_parameters == source.rope_parameters
        AutoModelForCausalLM.from_pretrained(export)
    assert "max_position_embeddings" not in capfd.readouterr().err


def test_every_conversion_carries_the_tokenizer_and_template(tmp_path, capsys):
    """Item 7: an export converted back with --to zerodp lost tokenizer.json and the chat template, and
    `generate` then encoded the prompt as bytes into the 400-token BPE model. Through HF folder -> hf ->
    zerodp -> safetensors -> hf the tokenizer files stay byte for byte; generate and generate --chat on
    the zerodp checkpoint encode with the tokenizer and answer with the template."""
    src = llama_folder(tmp_path / "llama")
    hops = [(src, tmp_path / "hf", "hf"), (tmp_path / "hf", tmp_path / "z", "zerodp"),
            (tmp_path / "z", tmp_path / "st", "safetensors"), (tmp_path / "st", tmp_path / "hf2", "hf")]
    for a, b, to in hops:
        assert main(["convert", str(a), str(b), "--to", to, "--no-progress"]) == 0, capsys.readouterr().err
        assert (b / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes(), b
        assert json.loads((b / "tokenizer_config.json").read_text())["chat_template"] == CHATML, b
    capsys.readouterr()
    generate = ["generate", str(tmp_path / "z"), "--prompt", "def main(", "--max-new-tokens", "3", "--temperature", "0"]
    assert main(generate) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def main(") and out.err == ""
    assert main(generate + ["--tokenizer", str(src)]) == 0  # what the model's own tokenizer makes of it
    assert capsys.readouterr().out == out.out
    assert main(["generate", str(tmp_path / "z"), "--chat", "reverse: red cat", "--max-new-tokens", "4"]) == 0
    assert END_OF_TURN not in capsys.readouterr().out


def test_generate_refuses_to_encode_bytes_into_a_vocabulary_that_is_not(tmp_path, capsys):
    """Item 7: with no tokenizer anywhere, a 400-token model's prompt was encoded as bytes (exit 0, garbage
    printed); now one line, exit 2. A 256-token model without a recorded data source is still bytes."""
    src = llama_folder(tmp_path / "llama")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((src / name).read_bytes())
    z = tmp_path / "z"
    assert main(["convert", str(bare), str(z), "--to", "zerodp", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["generate", str(z), "--prompt", "def main("]) == 2
    err = capsys.readouterr().err
    assert err == ("zerodp: error: this checkpoint has a vocabulary of 400 tokens, not bytes, and no tokenizer (none "
                   "recorded, none beside it), so --prompt cannot be encoded; pass --tokenizer "
                   "path/to/tokenizer.json\n")
    assert main(["generate", str(z), "--prompt", "def main(", "--tokenizer", str(src), "--max-new-tokens", "2"]) == 0


def test_a_destination_named_like_a_file_is_refused(tmp_path, capsys):
    """Item 18: `zerodp convert SRC x.safetensors` made a folder named x.safetensors."""
    src = llama_folder(tmp_path / "llama")
    dst = tmp_path / "x.safetensors"
    capsys.readouterr()
    assert main(["convert", str(src), str(dst)]) == 2
    assert capsys.readouterr().err == (
        f"zerodp: error: {dst} names a .safetensors file, but zerodp convert writes a folder (model.safetensors or "
        f"shards with their index, and the tokenizer, config.json for --to hf); give a folder, e.g. {tmp_path / 'x'}\n")
    assert not dst.exists()


def test_a_run_and_its_export_sample_with_the_same_default_seed(finetuned, tmp_path, capsys):
    """Item 18: `zerodp generate` took the run's train.seed on a run and 0 on its export: the same weights
    printed other text. The export records the seed; both print the same."""
    _, run = finetuned
    export = tmp_path / "hf"
    assert main(["convert", str(run), str(export), "--to", "hf", "--no-progress"]) == 0
    capsys.readouterr()
    texts = []
    for path in (run, export):
        assert main(["generate", str(path), "--prompt", "def ", "--max-new-tokens", "24"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]
    assert main(["generate", str(export), "--prompt", "def ", "--max-new-tokens", "24", "--seed", "0"]) == 0
    assert capsys.readouterr().out != texts[0]  # seed 7 (the run's) is not seed 0


def test_the_origin_is_found_through_init_from_too(finetuned, tmp_path):
    """Item 6: the Hugging Face model a run starts from is model.hf_config's, else model.init_from's folder,
    else what the zerodp checkpoint given as model.init_from records (a fine-tune of a fine-tune); none for
    a model trained from scratch."""
    from zerodp.checkpoint.manifest import resolve_step_folder
    from zerodp.models.hf import origin_config

    hf, run = finetuned
    original = json.loads((hf / "config.json").read_text())
    step = resolve_step_folder(run)
    assert json.loads((step / "meta.json").read_text())["hf_origin"] == original
    assert origin_config(None, str(hf)) == origin_config(str(hf), None) == original
    assert origin_config(None, str(hf / "model.safetensors")) == original
    assert origin_config(None, str(step)) == original
    assert origin_config(None, None) is None and origin_config(None, str(tmp_path)) is None
