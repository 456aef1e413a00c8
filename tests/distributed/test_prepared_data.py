"""Training on a `zerodp prepare` folder: batches from train.bin / val.bin, the sample decoded with the
tokenizer, the tokenizer recorded in the checkpoint and copied into a --to hf export; bad inputs are one
line on stderr with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from tests.conftest import TINY
from tests.support.cli_checks import zerodp_here
from tests.support.harness import ROOT
from tests.support.reference import LLAMA, reference_run
from tests.support.text_fixtures import stdlib_texts, train_bpe, write_jsonl
from zerodp.config import load_config
from zerodp.data.batches import PreparedTokens, TokenBatches, load_tokens
from zerodp.data.prepare import PrepareOptions, prepare
from zerodp.errors import UserError
from zerodp.trainer.sample import decode, prompt_tokens

STEPS = 3


def cli(*args):
    """A training run through the command line, in a new process (the other commands: zerodp_here)."""
    return subprocess.run([sys.executable, "-m", "zerodp", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def overrides(data_dir, out_dir, vocab, *more):
    """TINY on the prepared folder; vocab None leaves model.vocab_size unset (meta.json's is taken)."""
    tiny = [o for o in TINY if vocab is not None or not o.startswith("model.vocab_size=")]
    given = [] if vocab is None else [f"model.vocab_size={vocab}"]
    return [*tiny, *LLAMA, f"data.source={data_dir}", *given, f"train.max_steps={STEPS}", f"train.out_dir={out_dir}",
            *more]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    tok = train_bpe(root / "tok" / "tokenizer.json", vocab_size=400, n_files=20)
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    docs = write_jsonl(root / "docs.jsonl", stdlib_texts(30))
    meta = prepare(PrepareOptions(inputs=[str(docs)], tokenizer=str(tok), out=str(root / "data"),
                   val_fraction=0.2, progress=False))
    return root, tok, meta


@pytest.fixture(scope="module")
def trained(prepared):
    """3 steps through the CLI, with a checkpoint at the end and the end-of-run sample; model.vocab_size
    left unset, as configs/tiny.yaml leaves it."""
    root, tok, meta = prepared
    out = root / "run"
    r = cli("train", "configs/tiny.yaml", *overrides(root / "data", out, None,
            "train.sample_tokens=12", "train.eval_every=3", f"checkpoint.every={STEPS}"))
    assert r.returncode == 0, r.stderr
    return out, r


def test_batches_come_from_train_bin_and_val_bin(prepared, tmp_path):
    root, _, meta = prepared
    cfg = load_config("configs/tiny.yaml", overrides(root / "data", tmp_path, meta["vocab_size"]))
    data = load_tokens(cfg)
    assert isinstance(data, PreparedTokens)
    dtype = np.dtype(meta["dtype"])
    train_bin = np.fromfile(root / "data" / "train.bin", dtype=dtype)
    val_bin = np.fromfile(root / "data" / "val.bin", dtype=dtype)
    assert len(train_bin) == meta["splits"]["train"]["tokens"] > 0
    assert len(val_bin) == meta["splits"]["val"]["tokens"] > 0
    T, G = cfg.model.block_size, cfg.train.global_batch_size
    for split, stream in (("train", train_bin), ("val", val_bin)):
        batches = TokenBatches(data, cfg, split)
        offsets = batches.offsets(0, G)  # samples: windows of T + 1 tokens every T tokens (zerodp.data.samples)
        assert offsets.max() <= len(stream) - T - 1 and (offsets % T == 0).all()
        x, y = batches.rows(offsets)
        assert x.tolist() == [stream[o : o + T].tolist() for o in offsets]
        assert y.tolist() == [stream[o + 1 : o + T + 1].tolist() for o in offsets]
    # rank 1 of 2 takes the second half of the same global batch: independent of world size
    x0, _ = TokenBatches(data, cfg, "train").rows(TokenBatches(data, cfg, "train").offsets(0, G))
    micro = TokenBatches(data, cfg, "train").rank_micro_batches(0, G, 2, rank=1, world=2)
    assert np.array_equal(np.concatenate([m[0].numpy() for m in micro]), x0[G // 2 :].numpy())


def test_training_reads_the_prepared_folder(prepared, trained):
    root, tok, meta = prepared
    out, r = trained
    cfg = load_config("configs/tiny.yaml", overrides(root / "data", out, meta["vocab_size"]))
    expected, _ = reference_run(cfg)  # one process, the full batch of each step from train.bin
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [rec["loss"] for rec in records if "loss" in rec]
    assert len(losses) == STEPS
    assert np.allclose(losses, expected, atol=1e-4), (losses, expected)
    assert np.isfinite(records[-1]["val_loss"])
    ckpt_meta = json.loads(next(out.glob("checkpoints/step_*/meta.json")).read_text())
    assert {k: ckpt_meta["tokenizer"][k] for k in ("path", "sha256")} == meta["tokenizer"]
    assert ckpt_meta["tokenizer"]["eot_id"] == meta["eot_id"]


def test_sample_is_decoded_with_the_tokenizer(prepared, trained):
    from tokenizers import Tokenizer

    root, tok, meta = prepared
    _, r = trained
    text = r.stderr.split("sample:\n", 1)[1]
    assert "<|endoftext|>" in text  # the prompt: the end-of-text token, decoded
    cfg = load_config("configs/tiny.yaml", overrides(root / "data", root, meta["vocab_size"]))
    assert prompt_tokens(cfg) == [meta["eot_id"]]
    ids = Tokenizer.from_file(str(tok)).encode("def main():\n    return 1").ids
    assert decode(cfg, ids) == "def main():\n    return 1"


def test_sample_falls_back_to_ids_when_the_tokenizer_changed(prepared, tmp_path):
    root, tok, meta = prepared
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    m = json.loads((data / "meta.json").read_text())
    m["tokenizer"]["sha256"] = "0" * 64
    (data / "meta.json").write_text(json.dumps(m))
    cfg = load_config("configs/tiny.yaml", overrides(data, tmp_path, meta["vocab_size"]))
    assert decode(cfg, [5, 7]) == f"(tokenizer {tok} changed since zerodp prepare (sha256 differs): token ids)\n5 7"


def test_an_unset_vocab_size_is_taken_from_meta_json(prepared, tmp_path, capsys):
    """Unset (in neither the YAML nor an override): meta.json's, said on stderr. Written: kept, even when
    it equals the default; below the tokenizer's vocabulary it stays an error that names both fixes."""
    root, _, meta = prepared
    vocab, where = meta["vocab_size"], root / "data" / "meta.json"
    cfg = load_config("configs/tiny.yaml", overrides(root / "data", tmp_path, None))
    assert cfg.model.vocab_size == vocab
    assert capsys.readouterr().err == (f"zerodp: model.vocab_size={vocab} taken from {where} (the tokenizer's "
                                       f"vocabulary; the config leaves model.vocab_size unset)\n")
    bigger = load_config("configs/tiny.yaml", overrides(root / "data", tmp_path, vocab + 64))
    assert bigger.model.vocab_size == vocab + 64
    written = tmp_path / "mine.yaml"
    written.write_text(f"model:\n  vocab_size: 256\ndata:\n  source: {root / 'data'}\n")
    cfg = load_config(written, [f"train.out_dir={tmp_path}"])
    assert cfg.model.vocab_size == 256 and capsys.readouterr().err == ""
    with pytest.raises(UserError, match=rf"model.vocab_size=256 is smaller than the vocabulary of .*data "
                                        rf"\(meta.json vocab_size={vocab}\); set model.vocab_size >= {vocab}, or "
                                        rf"leave it unset to take meta.json's$"):
        load_tokens(cfg)
    assert load_config(None, ["data.source=builtin"]).model.vocab_size == 256  # byte level: the default


def test_the_run_records_the_vocabulary_it_took_and_resumes(prepared, trained, tmp_path):
    """config.yaml holds the number taken from meta.json; the same command (still without it) resumes."""
    root, _, meta = prepared
    out, r = trained
    assert f"model.vocab_size={meta['vocab_size']} taken from {root / 'data' / 'meta.json'}" in r.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["vocab_size"] == meta["vocab_size"]
    run = tmp_path / "run"
    shutil.copytree(out, run)
    again = cli("train", "configs/tiny.yaml", *overrides(root / "data", run, None, f"train.max_steps={STEPS + 1}"))
    assert again.returncode == 0, again.stderr
    assert f"resuming from {run / 'checkpoints'}" in again.stderr and f"at step {STEPS}" in again.stderr, again.stderr
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == STEPS + 1


def test_the_run_says_what_the_prepared_folder_holds(prepared, trained):
    """One line, as the built-in corpus gets: documents, tokens of each split, the tokenizer."""
    root, tok, meta = prepared
    _, r = trained
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    line = (f"zerodp: data.source={root / 'data'}: a zerodp prepare folder, {meta['documents']} documents, "
            f"{meta['tokens']:,} tokens: train {tr['tokens']:,} ({tr['documents']} documents), val {va['tokens']:,} "
            f"({va['documents']} documents); tokenizer {tok.resolve()} (vocabulary {meta['vocab_size']}, "
            f"model.vocab_size={meta['vocab_size']}, uint16)")
    assert r.stderr.splitlines().count(line) == 1, r.stderr


def test_vocab_too_small_is_one_line_exit_2(prepared, tmp_path):
    root, _, meta = prepared
    r = cli("train", "configs/tiny.yaml", *overrides(root / "data", tmp_path / "run", 300))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "model.vocab_size=300" in lines[0] and f"vocab_size={meta['vocab_size']}" in lines[0]
    assert f"set model.vocab_size >= {meta['vocab_size']}" in lines[0]


def test_dry_run_reads_both_splits(prepared, tmp_path):
    root, _, meta = prepared
    r = zerodp_here("train", "--dry-run", "configs/tiny.yaml",
                    *overrides(root / "data", tmp_path / "run", meta["vocab_size"]))
    assert r.returncode == 0, r.stderr
    assert f"# data: {meta['tokens']:,} tokens from {root / 'data'}" in r.stdout


def test_empty_val_with_eval_on_is_one_line_exit_2(prepared, tmp_path):
    root, _, meta = prepared
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    (data / "val.bin").write_bytes(b"")
    r = cli("train", "configs/tiny.yaml", *overrides(data, tmp_path / "run", meta["vocab_size"], "train.eval_every=2"))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "val.bin has 0 tokens" in lines[0] and "train.eval_every=0" in lines[0], r.stderr
    # eval off: val.bin is never read, so an empty one is no error
    cfg = load_config("configs/tiny.yaml", overrides(data, tmp_path / "run", meta["vocab_size"]))
    TokenBatches(load_tokens(cfg), cfg, "val")


@pytest.fixture(scope="module")
def exported(prepared, trained):
    root, _, _ = prepared
    out, _ = trained
    dst = root / "hf"
    r = zerodp_here("convert", out, dst, "--to", "hf", "--no-progress")
    assert r.returncode == 0, r.stderr
    return dst


def test_hf_export_holds_the_tokenizer(prepared, trained, exported):
    root, tok, meta = prepared
    out, _ = trained
    dst = exported
    assert (dst / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert (dst / "tokenizer_config.json").read_bytes() == (tok.parent / "tokenizer_config.json").read_bytes()
    assert json.loads((dst / "config.json").read_text())["eos_token_id"] == meta["eot_id"]
    r = zerodp_here("convert", out, dst, "--to", "hf", "--no-progress", "--overwrite")  # still recognised as ours
    assert r.returncode == 0, r.stderr
    # --to safetensors keeps the tokenizer record: a later --to hf of that file still carries the tokenizer
    st = root / "weights"  # a folder: convert refuses a DST named like a file
    assert zerodp_here("convert", out, st, "--to", "safetensors", "--no-progress").returncode == 0
    r = zerodp_here("convert", st, root / "hf2", "--to", "hf", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert (root / "hf2" / "tokenizer.json").read_bytes() == tok.read_bytes()


def test_generate_continues_as_the_run_sampled(prepared, trained):
    """zerodp generate from the start of a document, with the run's seed and the sample's settings, prints
    the end-of-run sample: the same weights loaded on one process give the same draws."""
    out, r = trained
    sample = r.stderr.split("sample:\n", 1)[1].rstrip("\n")
    g = zerodp_here("generate", out, "--max-new-tokens", 12)
    assert g.returncode == 0, g.stderr
    assert sample == "<|endoftext|>" + g.stdout[:-1]
    again = zerodp_here("generate", out, "--max-new-tokens", 12, "--prompt", "def ", "--seed", 5)
    assert again.returncode == 0 and again.stdout.startswith("def ")
    assert zerodp_here("generate", out, "--max-new-tokens", 12, "--prompt", "def ", "--seed", 5).stdout == again.stdout


def test_eval_matches_transformers_on_the_export(prepared, trained, exported):
    """zerodp eval's loss over val.bin equals the cross-entropy transformers computes with the --to hf
    export on the same windows; the export evaluates the same as the run once its data is named."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    root, _, meta = prepared
    out, _ = trained
    r = zerodp_here("eval", out, "--json", "--batch-size", 3, "--all")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    val = np.fromfile(root / "data" / "val.bin", dtype=meta["dtype"]).astype(np.int64)
    T = 32
    windows = (len(val) - 1) // T
    assert result["samples"] == windows and result["tokens"] == windows * T
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    buf = torch.from_numpy(np.stack([val[i * T : i * T + T + 1] for i in range(windows)]))
    with torch.no_grad():
        logits = model(buf[:, :-1]).logits
    expected = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), buf[:, 1:].reshape(-1)).item()
    assert abs(result["val_loss"] - expected) < 1e-4, (result, expected)
    assert abs(result["perplexity"] - np.exp(expected)) < 1e-3 * np.exp(expected)
    hf = zerodp_here("eval", exported, f"data.source={root / 'data'}", "--json")
    assert hf.returncode == 0, hf.stderr
    assert abs(json.loads(hf.stdout)["val_loss"] - result["val_loss"]) < 1e-5
    bare = zerodp_here("eval", exported)  # an HF folder records no training data
    assert bare.returncode == 2 and bare.stderr.count("\n") == 1 and "data.source=DIR" in bare.stderr


def test_the_export_runs_in_the_text_generation_pipeline(prepared, exported):
    """The export is a complete model folder: transformers' pipeline runs it as it is, and greedy decoding
    there gives what zerodp generate --temperature 0 gives from the same context."""
    from transformers import pipeline

    root, _, meta = prepared
    pipe = pipeline("text-generation", model=str(exported), device="cpu")
    out = pipe("def ", max_new_tokens=8, do_sample=False, return_full_text=False)
    g = zerodp_here("generate", exported, "--prompt", "def ", "--max-new-tokens", 8, "--temperature", 0)
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("def ")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(exported / "tokenizer.json"))
    context = [meta["eot_id"], *tok.encode("def ").ids]
    hf_ids = pipe.model.generate(torch_tensor([context]), max_new_tokens=8, do_sample=False)[0, len(context):]
    assert g.stdout[:-1] == "def " + tok.decode(hf_ids.tolist(), skip_special_tokens=False)
    assert isinstance(out[0]["generated_text"], str)


def torch_tensor(rows):
    import torch

    return torch.tensor(rows, dtype=torch.long)


def test_generate_and_eval_refuse_bad_input(prepared, trained, tmp_path):
    out, _ = trained
    for args, says in [(("generate", out, "--max-new-tokens", 0), "--max-new-tokens"),
                       (("generate", tmp_path / "nothing"), "nothing"),
                       (("generate", out, "--tokenizer", tmp_path), "tokenizer.json"),
                       (("eval", out, "model.n_layer=3"), "data.*"),
                       (("eval", out, "--batch-size", 0), "--batch-size")]:
        r = zerodp_here(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, (args, r.stderr)


def test_generate_and_eval_name_a_prepared_folder_and_what_to_pass(prepared, tmp_path, capsys):
    """A prepare folder where the checkpoint goes is called a dataset, with what to pass instead; a
    checkpoint without data (an export) is told the command that works, with its path as typed."""
    import torch
    from safetensors.torch import save_file

    from zerodp.cli.commands import main

    data = prepared[0] / "data"
    assert main(["generate", str(data)]) == 2
    assert capsys.readouterr().err == (f"zerodp: error: {data} is a dataset written by zerodp prepare (train.bin, "
                                       f"val.bin, meta.json), not a checkpoint; pass a checkpoint: the run folder of "
                                       f"a training on it (its train.out_dir), a step folder or an export\n")
    assert main(["eval", str(data)]) == 2
    assert capsys.readouterr().err.endswith(f"not a checkpoint; give the checkpoint first and the data after it: "
                                            f"zerodp eval RUN data.source={data} (RUN: a run folder, step folder or "
                                            f"export)\n")
    export = tmp_path / "hf-llama"
    export.mkdir()
    save_file({"lm_head.weight": torch.zeros(4, 4)}, export / "model.safetensors")
    assert main(["eval", str(export)]) == 2
    assert capsys.readouterr().err == (f"zerodp: error: {export} records no training data; name it: zerodp eval "
                                       f"{export} data.source=DIR (a zerodp prepare folder)\n")

