"""Every file in configs/ is a config `zerodp train --dry-run` accepts, and its header comment says how
to launch it and what its global batch is, with arithmetic that agrees with the file.

A config that trains on a token file of its own (gpt2-124m, llama3-8b) dry-runs on a small .bin made
here in its data.token_dtype, with ids below its vocab_size: the dry run reads the data as a launch
would, and none of those files ship with the repository.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.support.cli_checks import zerodp_here
from tests.support.harness import ROOT
from zerodp.config import load_config

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# "Global batch: 12 micro x 8 GPUs x 5 accumulation = 480 sequences x 1,024 tokens = 491,520 tokens/step"
BATCH = re.compile(r"Global batch: (\d+) micro x (\d+) (?:GPUs|processes) x (\d+) accumulation = ([\d,]+) sequences "
                   r"x ([\d,]+) tokens = ([\d,]+) tokens/step")


def number(text: str) -> int:
    return int(text.replace(",", ""))


def header(path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join(line.removeprefix("#").strip() for line in lines[:next(
        i for i, line in enumerate(lines) if not line.startswith("#"))])


def test_the_configs_are_found():
    assert {"tiny", "gpt2-124m", "llama-tiny", "llama3-8b", "sft-llama"} <= {p.stem for p in CONFIGS}


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    """configs/sft-llama.yaml's placeholders filled in: a tiny Hugging Face Llama folder (tokenizer, chat
    template, weights) and conversations prepared with it."""
    from tests.support.sft_fixtures import llama_folder, reverse_rows, write_rows
    from zerodp.cli.commands import main

    root = tmp_path_factory.mktemp("sft_inputs")
    llama = llama_folder(root / "llama")
    rows = write_rows(root / "chats.jsonl", reverse_rows(600))
    assert main(["prepare", str(rows), "--chat", "--tokenizer", str(llama), "--out", str(root / "sft"),
                 "--val-fraction", "0.3", "--no-progress"]) == 0
    return [f"model.hf_config={llama}", f"model.init_from={llama}", f"data.source={root / 'sft'}"]


@pytest.fixture(scope="module")
def moe_inputs(sft_inputs, tmp_path_factory):
    """configs/sft-qwen3-moe-lora.yaml's placeholders: a tiny Qwen3-MoE folder saved by transformers, with
    the Llama folder's tokenizer and template (the same ids: the same prepared conversations)."""
    import shutil

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    llama = sft_inputs[0].split("=", 1)[1]
    folder = tmp_path_factory.mktemp("moe_inputs") / "qwen3-moe"
    torch.manual_seed(0)
    vocab = json.loads((ROOT / llama / "config.json").read_text())["vocab_size"]
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{llama}/{name}", folder / name)
    return [f"model.hf_config={folder}", f"model.init_from={folder}", sft_inputs[2]]


@pytest.fixture(scope="module")
def dpo_inputs(sft_inputs, tmp_path_factory):
    """configs/dpo-llama-lora.yaml's placeholders: the Llama folder as the SFT export, and preference pairs
    prepared with its tokenizer (plain rows: the reversed words chosen, the words as given rejected)."""
    from tests.support.sft_fixtures import reverse_rows, write_rows
    from zerodp.cli.commands import main

    llama = sft_inputs[0].split("=", 1)[1]
    root = tmp_path_factory.mktemp("dpo_inputs")
    rows = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": r["prompt"].removeprefix("reverse: ")}
            for r in reverse_rows(200)]
    write_rows(root / "pairs.jsonl", rows)
    assert main(["prepare", str(root / "pairs.jsonl"), "--preference", "--tokenizer", llama, "--out",
                 str(root / "dpo"), "--val-fraction", "0.3", "--no-progress"]) == 0
    return [f"model.hf_config={llama}", f"model.init_from={llama}", f"data.source={root / 'dpo'}"]


def filled(path, request) -> list[str]:
    """The overrides that fill in a config's placeholders (path/to/...): a tiny folder of the config's own
    kind (a Llama, a Qwen3-MoE) and data of its objective (conversations, preference pairs)."""
    text = path.read_text()
    if "path/to/" not in text:
        return []
    if re.search(r"^\s*objective:\s*dpo", text, re.M):
        return request.getfixturevalue("dpo_inputs")
    return request.getfixturevalue("moe_inputs" if "path/to/qwen3-moe" in text else "sft_inputs")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_dry_runs(path, tmp_path, request):
    cfg = load_config(path, filled(path, request))
    over = [f"train.out_dir={tmp_path / 'run'}", *filled(path, request)]
    if cfg.data.source.endswith(".bin"):
        # enough for both splits of the longest block (llama3-8b's 8,192: val is data.val_fraction=5%)
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 200_000)
        tokens.astype(cfg.data.token_dtype).tofile(tmp_path / "train.bin")
        over.append(f"data.source={tmp_path / 'train.bin'}")
    r = zerodp_here("train", path, *over, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"arch: {cfg.model.arch}" in r.stdout and "# world_size 1, grad_accum_steps" in r.stdout
    if cfg.strategy.name != "auto":  # auto: the planner's choice on this machine
        assert f", strategy {cfg.strategy.name}" in r.stdout
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_header_has_launch_line_and_batch_arithmetic(path, request):
    text, cfg = header(path), load_config(path, filled(path, request))
    assert f"--module zerodp train configs/{path.name}" in text, f"{path.name}: no launch line in the header"
    m = BATCH.search(text.replace("\n", " "))
    assert m, f"{path.name}: the header lacks 'Global batch: M micro x N GPUs x A accumulation = ...'"
    micro, world, accum, seqs, seq_len, tokens = (number(g) for g in m.groups())
    assert micro == cfg.train.micro_batch_size and seqs == cfg.train.global_batch_size, path.name
    assert cfg.check_batch_split(world) == accum and micro * world * accum == seqs, path.name
    assert seq_len == cfg.model.block_size and seqs * seq_len == tokens, path.name
