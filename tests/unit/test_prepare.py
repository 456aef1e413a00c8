"""`zerodp prepare`: the token files equal the tokenizers library's own encoding, the split is by whole
documents and deterministic, and every bad input is one line on stderr, exit 2, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.support.cli_checks import one_line_error
from tests.support.harness import ROOT
from tests.support.text_fixtures import EOT, stdlib_texts, train_bpe, write_jsonl, write_parquet, write_text_folder
from zerodp.cli.commands import main
from zerodp.data.prepare import val_mask

TEXTS = stdlib_texts(36, max_bytes=12_000)  # ~150 KB: documents of real source code


@pytest.fixture(scope="session")
def tok_path(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=400, n_files=20)


@pytest.fixture(scope="session")
def tokenizer(tok_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_path))


def run(*args):
    return main(["prepare", *map(str, args), "--no-progress"])


def nothing_left(out):
    """No output and no hidden staging folder beside it: nothing training could take for a prepare."""
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def expected(tokenizer, texts, seed, fraction, eot_id, input_bytes=None):
    """train.bin and val.bin as the docs say: whole documents by hash, and with `input_bytes` (the input
    files' size) one longer than `fraction` of it split by tokens, its last round(fraction * n) in val."""
    train, val = [], []
    for i, t in enumerate(texts):
        ids = tokenizer.encode(t).ids
        if input_bytes is not None and len(t.encode()) > fraction * input_bytes:
            n_val = round(fraction * len(ids))
            train += ids[: len(ids) - n_val] + [eot_id]
            val += ids[len(ids) - n_val :] + [eot_id]
        else:
            (val if val_mask(seed, i, 1, fraction)[0] else train).extend(ids + [eot_id])
    return np.array(train), np.array(val)


def test_token_files_equal_the_tokenizers_encoding(tmp_path, tok_path, tokenizer, capsys):
    """Text folder, gzipped JSONL and Parquet in one run: each document's encode(text).ids, then the
    separator, in document order, split by whole documents."""
    a, b, c = TEXTS[:12], TEXTS[12:24], TEXTS[24:]
    folder = write_text_folder(tmp_path / "docs", a)
    jsonl = write_jsonl(tmp_path / "b.jsonl.gz", b)
    parquet = write_parquet(tmp_path / "c.parquet", c)
    out = tmp_path / "out"
    assert run(folder, jsonl, parquet, "--tokenizer", tok_path, "--out", out, "--val-fraction", 0.25,
               "--seed", 3, "--batch-size", "20kB") == 0
    assert "prepared 36 documents" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    eot = tokenizer.token_to_id(EOT)
    train, val = expected(tokenizer, TEXTS, 3, 0.25, eot)
    assert 0 < len(val) < len(train)
    np.testing.assert_array_equal(np.fromfile(out / "train.bin", dtype=np.uint16), train)
    np.testing.assert_array_equal(np.fromfile(out / "val.bin", dtype=np.uint16), val)
    assert meta["format"] == "zerodp-prepare" and meta["dtype"] == "uint16" and meta["vocab_size"] == 400
    assert meta["eot_id"] == eot and meta["eot_token"] == EOT
    assert meta["splits"]["train"]["tokens"] == len(train) and meta["splits"]["val"]["tokens"] == len(val)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 36
    for split, tokens in (("train", train), ("val", val)):  # the document index: each document's first token
        assert meta["splits"][split]["index"] == {"file": f"{split}.idx", "dtype": "int64",
                                                  "of": "each document's first token"}
        index, ends = np.fromfile(out / f"{split}.idx", dtype=np.int64), np.flatnonzero(tokens == eot)
        assert len(index) == meta["splits"][split]["documents"] == len(ends) and ends[-1] == len(tokens) - 1
        assert index[0] == 0 and np.array_equal(index[1:], ends[:-1] + 1)
    import hashlib

    assert meta["tokenizer"]["sha256"] == hashlib.sha256(tok_path.read_bytes()).hexdigest()
    assert [s["documents"] for s in meta["sources"]] == [1] * 12 + [12, 12]
    assert meta["sources"][-1]["bytes"] == parquet.stat().st_size
    assert meta["command"].startswith("zerodp prepare ") and "--val-fraction 0.25" in meta["command"]


def test_output_does_not_depend_on_batching(tmp_path, tok_path, tokenizer):
    """Nor does the split: one document longer than the val share, split by tokens, among whole ones."""
    texts = TEXTS[:20] + ["".join(TEXTS[20:])] + TEXTS[:3]
    jsonl = write_jsonl(tmp_path / "a.jsonl", texts)
    outs = []
    for size in ("1kB", "100MB"):
        out = tmp_path / f"out{size}"
        assert run(jsonl, "--tokenizer", tok_path, "--out", out, "--val-fraction", 0.3, "--batch-size", size) == 0
        outs.append(out)
    for name in ("train.bin", "val.bin", "train.idx", "val.idx"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    train, val = expected(tokenizer, texts, 0, 0.3, tokenizer.token_to_id(EOT), jsonl.stat().st_size)
    np.testing.assert_array_equal(np.fromfile(outs[0] / "val.bin", dtype=np.uint16), val)
    np.testing.assert_array_equal(np.fromfile(outs[0] / "train.bin", dtype=np.uint16), train)
    assert json.loads((outs[0] / "meta.json").read_text())["split_by_tokens"] == 1


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.99])
def test_one_text_file_gets_a_val_split_by_tokens(tmp_path, tok_path, tokenizer, capsys, fraction):
    """nanoGPT's input.txt: one document, longer than any share of the input, gives val.bin the last
    `fraction` of its tokens, and prepare says so."""
    text = "".join(TEXTS)
    (tmp_path / "input.txt").write_text(text)
    out = tmp_path / "out"
    assert run(tmp_path / "input.txt", "--tokenizer", tok_path, "--out", out, "--val-fraction", fraction) == 0
    ids, eot = tokenizer.encode(text).ids, tokenizer.token_to_id(EOT)
    n_val = round(fraction * len(ids))
    np.testing.assert_array_equal(np.fromfile(out / "train.bin", dtype=np.uint16), ids[: len(ids) - n_val] + [eot])
    np.testing.assert_array_equal(np.fromfile(out / "val.bin", dtype=np.uint16), ids[len(ids) - n_val :] + [eot])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 1 and meta["split_by_tokens"] == 1
    assert meta["splits"]["train"]["documents"] == meta["splits"]["val"]["documents"] == 1
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith(f"prepared 1 document ({(tmp_path / 'input.txt').stat().st_size / 1e3:.1f} kB in 1 "
                                f"file) into {out}: train 1 document / {len(ids) - n_val + 1:,} tokens, val 1 "
                                f"document / {n_val + 1:,} tokens; uint16, vocabulary 400, separator"), stdout
    assert stdout[1] == (f"split by tokens: 1 document is longer than --val-fraction {fraction} of the input, so the "
                         f"last {fraction * 100:g}% of its tokens went to val.bin, the rest to train.bin")


def test_val_mask_is_a_pure_function_of_seed_and_index():
    whole = val_mask(7, 0, 10_000, 0.1)
    parts = np.concatenate([val_mask(7, i, 1000, 0.1) for i in range(0, 10_000, 1000)])
    np.testing.assert_array_equal(whole, parts)
    assert 0.08 < whole.mean() < 0.12
    assert not np.array_equal(whole, val_mask(8, 0, 10_000, 0.1))
    assert not val_mask(7, 0, 1000, 0.0).any()


def test_uint32_for_a_vocabulary_over_65536(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w70000 w65535")
    assert run(tmp_path / "a.txt", "--tokenizer", tmp_path, "--out", tmp_path / "out", "--val-fraction", 0) == 0
    assert np.fromfile(tmp_path / "out/train.bin", dtype=np.uint32).tolist() == [3, 70001, 0, 65537, 1]
    assert json.loads((tmp_path / "out/meta.json").read_text())["dtype"] == "uint32"


def test_the_summary_says_counts_and_sizes_as_a_person_would(tmp_path, tok_path, capsys):
    (tmp_path / "a.txt").write_text("x = 1\n")
    assert run(tmp_path / "a.txt", "--tokenizer", tok_path, "--out", tmp_path / "out", "--val-fraction", 0) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"prepared 1 document (6 bytes in 1 file) into {tmp_path / 'out'}: train 1 document / "), out
    assert ", val 0 documents / 0 tokens; uint16, vocabulary 400, separator '<|endoftext|>' (" in out


def test_separator_choice(tmp_path, tok_path, tokenizer):
    """tokenizer_config.json's eos_token in a model folder, --eot TOKEN, --eot none."""
    folder = tmp_path / "model"
    folder.mkdir()
    train_bpe(folder / "tokenizer.json", vocab_size=300, n_files=5, special=("<s>", "</s>", EOT))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    (tmp_path / "a.txt").write_text("x = 1\n")
    args = [tmp_path / "a.txt", "--val-fraction", 0]
    assert run(*args, "--tokenizer", folder, "--out", tmp_path / "o1") == 0
    assert json.loads((tmp_path / "o1/meta.json").read_text())["eot_token"] == "</s>"
    assert run(*args, "--tokenizer", tok_path, "--out", tmp_path / "o2", "--eot", "none") == 0
    assert np.fromfile(tmp_path / "o2/train.bin", dtype=np.uint16).tolist() == tokenizer.encode("x = 1\n").ids


def test_overwrite_replaces_an_earlier_prepare(tmp_path, tok_path, capsys):
    (tmp_path / "a.txt").write_text("a = 1\n")
    (tmp_path / "b.txt").write_text("b = 22222\n")
    out = tmp_path / "out"
    assert run(tmp_path / "a.txt", "--tokenizer", tok_path, "--out", out, "--val-fraction", 0) == 0
    before = (out / "train.bin").read_bytes()
    one_line_error(capsys, run(tmp_path / "b.txt", "--tokenizer", tok_path, "--out", out, "--val-fraction", 0),
                   r"out already exists and is not empty; choose a new folder or pass --overwrite")
    assert (out / "train.bin").read_bytes() == before
    assert run(tmp_path / "b.txt", "--tokenizer", tok_path, "--out", out, "--val-fraction", 0, "--overwrite") == 0
    assert (out / "train.bin").read_bytes() != before


@pytest.mark.parametrize("setup, args, pattern", [
    (None, ["{a}", "--tokenizer", "{tmp}/nope.json"], r"tokenizer .*nope.json not found; give a tokenizer.json"),
    (None, ["{a}", "--tokenizer", "{tmp}/bad.json"], r"bad.json is not a tokenizer the tokenizers library can read"),
    (None, ["{a}", "--tokenizer", "{tmp}/docs"], r"docs holds no tokenizer.json"),
    (None, ["{a}", "--eot", "<nope>"], r"--eot '<nope>' is not a token of"),
    ("bad_line", ["{tmp}/b.jsonl"], r"b.jsonl, line 3: not JSON \(.*\); each line must be one JSON object"),
    ("no_field", ["{tmp}/b.jsonl"], r"b.jsonl, line 2: no field 'text' \(its fields: id, body\); .*--field"),
    ("not_str", ["{tmp}/b.jsonl"], r"b.jsonl, line 1: field 'text' is 3, not a string"),
    ("late_error", ["{a}", "{tmp}/ok.jsonl", "{tmp}/b.jsonl", "--batch-size", "10kB"], r"b.jsonl, line 40: not JSON"),
    ("parquet", ["{tmp}/c.parquet"], r"c.parquet has no column 'text' \(its columns: id, body\); .*--field"),
    (None, ["{tmp}/bad.json.parquet"], r"is not a Parquet file pyarrow can read"),
    (None, ["{tmp}/empty.txt"], r"empty.txt is empty; give files that hold documents"),
    (None, ["{tmp}/blank.jsonl"], r"blank.jsonl holds no documents"),
    (None, ["{tmp}/emptydir"], r"emptydir holds no text .*point it at documents"),
    (None, ["{tmp}/missing.txt"], r"input .*missing.txt not found"),
    (None, ["{tmp}/bad.jsonl.gz"], r"bad.jsonl.gz is not valid gzip"),
    (None, ["{a}", "--val-fraction", "1.5"], r"--val-fraction 1.5 must be in \[0, 1\)"),
    (None, ["{a}", "--batch-size", "0.5"], r"--batch-size '0.5' is not a size; write a number and a unit, e.g. 256KiB"),
    ("foreign", ["{a}", "--overwrite"], r"out holds notes.txt, which zerodp prepare did not write; .*never replaces"),
    ("run", ["{a}", "--overwrite"], r"out is a training run folder"),
    (None, ["{tmp}/docs", "--out", "{tmp}/docs/out"], r"the output .*docs/out lies inside the input"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, tok_path, capsys, setup, args, pattern):
    write_text_folder(tmp_path / "docs", TEXTS[:2])
    (tmp_path / "a.txt").write_text(TEXTS[0])
    (tmp_path / "bad.json").write_text('{"model": ')
    (tmp_path / "bad.json.parquet").write_text("not parquet")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "emptydir" / "image.png").write_bytes(b"\x89PNG")
    write_jsonl(tmp_path / "ok.jsonl", TEXTS[:20])
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(TEXTS[:3] * 20)]
    if setup == "bad_line":
        lines[2] = '{"text": "unterminated'
    elif setup == "no_field":
        lines[1] = json.dumps({"id": 1, "body": "x"})
    elif setup == "not_str":
        lines[0] = json.dumps({"text": 3})
    elif setup == "late_error":
        lines[39] = "not json"
    elif setup == "parquet":
        write_parquet(tmp_path / "c.parquet", TEXTS[:3], column="body")
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    if setup in ("foreign", "run"):
        out.mkdir()
        (out / ("notes.txt" if setup == "foreign" else "metrics.jsonl")).write_text("mine\n")
    argv = [a.format(tmp=tmp_path, a=tmp_path / "a.txt") for a in args]
    if "--tokenizer" not in argv:
        argv += ["--tokenizer", str(tok_path)]
    if "--out" not in argv:
        argv += ["--out", str(out)]
    one_line_error(capsys, run(*argv), pattern)
    if setup in ("foreign", "run"):
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt" if setup == "foreign" else "metrics.jsonl"]
    else:
        nothing_left(out)


def test_the_help_says_sizes_as_a_person_would(capsys):
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--batch-size SIZE text per encode batch, e.g. 1MiB or 4MB (default 256KiB)" in text
    assert "0.262144" not in text


def test_zstd_jsonl(tmp_path, tok_path, tokenizer):
    zstandard = pytest.importorskip("zstandard")
    raw = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:5]).encode()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    assert run(tmp_path / "a.jsonl.zst", "--tokenizer", tok_path, "--out", tmp_path / "out", "--val-fraction", 0) == 0
    train, _ = expected(tokenizer, TEXTS[:5], 0, 0.0, tokenizer.token_to_id(EOT))
    np.testing.assert_array_equal(np.fromfile(tmp_path / "out/train.bin", dtype=np.uint16), train)


def test_the_command_line(tmp_path, tok_path):
    """The real entry point: `python -m zerodp prepare`, an error as one line and exit 2."""
    write_jsonl(tmp_path / "a.jsonl", TEXTS[:4], field="content")
    cmd = [sys.executable, "-m", "zerodp", "prepare", str(tmp_path / "a.jsonl"), "--tokenizer", str(tok_path),
           "--out", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "line 1: no field 'text'" in r.stderr, r.stderr
    r = subprocess.run(cmd + ["--field", "content"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "prepared 4 documents" in r.stdout, r.stderr
