"""The fine-tuning path of configs/sft-llama.yaml end to end on 2 CPU processes, as the README writes it:
the commands of its fine-tuning block, read from README.md, their placeholders filled with this test's
folders (the launch's processes are the harness's, set up as torchrun sets them; the run made a few
steps long and small, the config's data and run folders pointed here): conversations
prepared with a Hugging Face Llama folder's tokenizer and chat template, zero3 from its weights
(model.init_from), `zerodp convert --to hf`, and transformers loading the export: its tokenizer renders
the template as zerodp prepare did, generation_config.json's eos is the template's end-of-turn token,
and `apply_chat_template(add_generation_prompt=True)` + `generate` stops there (or at max_new_tokens),
answering what `zerodp generate --chat` answers."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from tests.distributed.test_readme import README, commands
from tests.support.cli_checks import one_line_error
from tests.support.harness import ROOT, run_distributed
from tests.support.sft_fixtures import END_OF_TURN, llama_folder, reverse_rows, write_rows
from tests.support.text_fixtures import train_bpe
from zerodp.cli.commands import main

STEPS = 4
QUESTION = "reverse: red cat sun"


def readme_block(fill: dict[str, str]) -> dict[str, list[str]]:
    """The README's fine-tuning commands by zerodp subcommand (prepare, train, convert, generate, eval), each
    the shell's words with the placeholders of `fill` replaced."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Fine-tune a Hugging Face model on conversations\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for command in commands(section):
        shell = " ".join(line.rstrip().removesuffix("\\") for line in command.text.splitlines())
        for placeholder, value in fill.items():
            shell = shell.replace(placeholder, value)
        words = shlex.split(shell, comments=True)
        out[words[words.index("zerodp") + 1]] = words
    assert sorted(out) == ["convert", "eval", "generate", "prepare", "train"], out
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    llama = llama_folder(root / "llama")
    rows = write_rows(root / "chats.jsonl", reverse_rows(240))
    readme = readme_block({"path/to/chats.jsonl": str(rows), "path/to/llama": str(llama), "path/to/export":
                           str(root / "hf"), "data/sft": str(root / "data"), "runs/sft-llama": str(root / "run")})
    prepare, train, convert = readme["prepare"], readme["train"], readme["convert"]
    assert prepare[:2] == ["zerodp", "prepare"] and convert[:2] == ["zerodp", "convert"], (prepare, convert)
    assert main([*prepare[1:], "--val-fraction", "0.1", "--no-progress"]) == 0
    # python -m zerodp.distributed.launcher (torchrun) --nproc-per-node N -m zerodp train CONFIG OVERRIDES, on
    # the harness's N processes
    launcher = ["python", "-m", "zerodp.distributed.launcher", "--nproc-per-node"]
    assert train[:4] == launcher and train[5:8] == ["-m", "zerodp", "train"], train
    train = train[2:]  # as torchrun's words: the launcher takes torchrun's options
    small = [f"data.source={root / 'data'}", f"train.out_dir={root / 'run'}",  # the config's data/sft, runs/sft-llama
             "model.block_size=64", "train.global_batch_size=8", "train.micro_batch_size=2",
             f"train.max_steps={STEPS}", "train.precision=fp32", "train.eval_every=4", "train.eval_batches=2",
             "train.progress=false", "optim.warmup_steps=1", "optim.lr=3e-3", "optim.min_lr=3e-4",
             f"checkpoint.every={STEPS}", "data.prefetch=0"]
    result = run_distributed("tests.support.sft_workers:train_config", world_size=int(train[2]),
                             kwargs={"path": str(ROOT / train[6]), "overrides": train[7:] + small})
    assert main([*convert[1:], "--no-progress"]) == 0
    return root, result, readme


def test_the_run_trains_on_the_answers_under_zero3(sft):
    root, result, _ = sft
    assert result[0]["final_step"] == STEPS and len(result[0]["losses"]) == STEPS
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert all(0 < r["target_tokens"] < 8 * 64 for r in steps)  # answers only: fewer than every token
    # tokens and tokens/s (and MFU, a multiple of tokens/s) count every token computed, not the targets
    assert [r["tokens"] for r in steps] == [r["step"] * 8 * 64 for r in steps]
    assert all(r["tokens_per_s"] * r["max_step_time_s"] == pytest.approx(8 * 64) for r in steps)
    assert np.isfinite(steps[-1]["val_loss"])
    config = (root / "run" / "config.yaml").read_text()
    assert "name: zero3" in config and "packing: true" in config


def test_the_export_carries_the_chat_template_and_the_end_of_turn_id(sft):
    root, _, _ = sft
    hf = root / "hf"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= \
        {p.name for p in hf.iterdir()}
    tok_config = json.loads((hf / "tokenizer_config.json").read_text())
    meta = json.loads((root / "data" / "meta.json").read_text())
    assert tok_config["chat_template"] == meta["chat"]["template_text"]
    generation = json.loads((hf / "generation_config.json").read_text())
    assert generation["eos_token_id"] == meta["chat"]["end_of_turn_id"]
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == generation["eos_token_id"]
    # recognised as ours: --overwrite replaces it
    assert main(["convert", str(root / "run"), str(hf), "--to", "hf", "--no-progress", "--overwrite"]) == 0


def test_transformers_answers_with_the_template_and_stops_at_the_end_of_turn(sft, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    root, _, readme = sft
    hf = root / "hf"
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    eos = GenerationConfig.from_pretrained(hf).eos_token_id
    assert eos == tok.convert_tokens_to_ids(END_OF_TURN)
    # the template round trips: transformers' ids of a training conversation are the prepared ones
    meta = json.loads((root / "data" / "meta.json").read_text())
    train = np.fromfile(root / "data" / "train.bin", dtype=meta["dtype"]).astype(np.int64)
    idx = np.fromfile(root / "data" / "train.idx", dtype=np.int64)
    first = train[idx[0] : idx[1]].tolist()
    assert tok.decode(first) .startswith("<|im_start|>user\nreverse: ")
    text = tok.decode(first)
    user, answer = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0], text.split("assistant\n")[1]
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer.split("<|im_end|>")[0]}]
    assert tok.apply_chat_template(messages, tokenize=True, return_dict=False) == first
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    assert prompt[-3:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    import torch

    as_docs = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=False)  # docs/fine_tuning.md's form
    assert as_docs.tolist() == [prompt]

    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert eos not in out[:-1] and (out[-1] == eos or len(out) == 12), out
    # zerodp generate --chat answers the same from the run folder and from the export
    answer_ids = out[:-1] if out[-1] == eos else out
    for path in (root / "run", hf):
        assert main(["generate", str(path), "--chat", QUESTION, "--temperature", "0", "--max-new-tokens", "12"]) == 0
        assert capsys.readouterr().out == tok.decode(answer_ids) + "\n"
    assert main(readme["generate"][1:]) == 0  # the README's command as written: it samples, and answers
    assert capsys.readouterr().out.endswith("\n")


def test_eval_reports_the_loss_over_the_answers(sft, capsys):
    root, _, readme = sft
    assert main(["eval", str(root / "run"), "--json", "--no-progress"]) == 0  # the run's validation set
    logged = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    assert abs(json.loads(capsys.readouterr().out)["val_loss"] - logged["val_loss"]) < 1e-6  # zero3, world 2
    assert main(["eval", str(root / "run"), "--json", "--no-progress", "--all"]) == 0  # the whole split
    result = json.loads(capsys.readouterr().out)
    meta = json.loads((root / "data" / "meta.json").read_text())
    assert 0 < result["targets"] < result["tokens"] and np.isfinite(result["val_loss"])
    assert result["targets"] <= meta["splits"]["val"]["targets"]
    assert main(["eval", str(root / "run"), "--no-progress", "--all"]) == 0
    assert f"{result['targets']:,} of them targets" in capsys.readouterr().out
    # the README's form: the export, the prepared folder named: the whole split, the same loss
    assert main([*readme["eval"][1:], "--json", "--no-progress"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert (exported["targets"], exported["tokens"]) == (result["targets"], result["tokens"])
    assert exported["val_loss"] == pytest.approx(result["val_loss"], rel=1e-5)


def test_generate_chat_refuses_bad_input(sft, tmp_path, capsys):
    root, _, _ = sft
    code = main(["generate", str(root / "run"), "--chat", "hi", "--prompt", "x"])
    one_line_error(capsys, code, r"--chat and --prompt are two prompts; give one")
    plain = tmp_path / "plain"
    (plain / "llama").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (plain / "llama" / name).write_bytes((root / "llama" / name).read_bytes())
    code = main(["generate", str(plain / "llama"), "--chat", "hi"])
    one_line_error(capsys, code, r"records no chat template .*; use --prompt, or train on chat data")
    (plain / "llama" / "tokenizer.json").unlink()  # an export without its tokenizer
    (plain / "llama" / "tokenizer_config.json").write_bytes((root / "llama" / "tokenizer_config.json").read_bytes())
    code = main(["generate", str(plain / "llama"), "--chat", "hi"])
    one_line_error(capsys, code, r"no tokenizer to encode the message with.*; pass --tokenizer path/to/tokenizer.json")
    wide = train_bpe(tmp_path / "wide" / "tokenizer.json", vocab_size=1200, n_files=10)  # not the model's 400 ids
    code = main(["generate", str(root / "hf"), "--chat", "def __init__(self): return self", "--tokenizer", str(wide)])
    one_line_error(capsys, code, r"the message encodes to token id \d+, beyond the model's vocabulary of \d+; use "
                                 r"the tokenizer the model was trained with")
