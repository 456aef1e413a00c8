"""`zerodp prepare --preference`: each pair's two sequences equal what TRL's own DPOTrainer tokenizes
(its _prepare_dataset on the same rows and tokenizer, plain and conversational), the mask is the
completion exactly, a pair's sequences are adjacent documents of one split, and bad rows are counted."""

from __future__ import annotations

import json
import shutil
import types

import pytest

from tests.support.cli_checks import one_line_error
from tests.unit.test_chat_prepare import CHATML, prepared, run, write_rows

CONVERSATIONAL = [
    {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What does def do?"}],
     "chosen": [{"role": "assistant", "content": "It defines a function."}],
     "rejected": [{"role": "assistant", "content": "It deletes a file, été."}]},
    {"prompt": [{"role": "user", "content": "2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "22"}]},
]
PLAIN = [{"prompt": "def add(a, b):", "chosen": "\n    return a + b", "rejected": "\n    return a - b"},
         {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Rome.<|im_end|>"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder with tokenizer.json and tokenizer_config.json, transformers' tokenizer)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from tests.support.text_fixtures import EOT, train_bpe

    folder = tmp_path_factory.mktemp("pref")
    train_bpe(folder / "tokenizer.json", vocab_size=400, n_files=10, special=(EOT, "<|im_start|>", "<|im_end|>"))
    specials = {"eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, **specials}))
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(folder / "tokenizer.json")),
                                 chat_template=CHATML, **specials)
    return folder, hf


def trl_pairs(hf, rows):
    """TRL 1.16's own tokenization of `rows` (DPOTrainer._prepare_dataset, no max_length)."""
    from datasets import Dataset
    from trl import DPOTrainer

    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    out = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=hf), Dataset.from_list(rows), hf, args, "t")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in out]


@pytest.mark.parametrize("rows", [CONVERSATIONAL, PLAIN], ids=["conversational", "plain"])
def test_pairs_equal_trls_tokenization_with_the_completion_as_the_mask(tmp_path, model, rows, capsys):
    folder, hf = model
    src = write_rows(tmp_path / "pairs.jsonl", rows)
    assert run(src, "--preference", "--tokenizer", folder, "--out", tmp_path / "out", "--val-fraction", "0") == 0
    assert "prepared 2 preference pairs" in capsys.readouterr().out
    docs, meta = prepared(tmp_path / "out")
    assert len(docs) == 4 and meta["splits"]["train"]["pairs"] == 2 and meta["splits"]["val"]["pairs"] == 0
    for i, (prompt, chosen, rejected) in enumerate(trl_pairs(hf, rows)):
        assert chosen and rejected
        for (ids, mask), completion in zip(docs[2 * i : 2 * i + 2], (chosen, rejected)):
            assert ids == prompt + completion
            assert mask == [0] * len(prompt) + [1] * len(completion)
    if rows is CONVERSATIONAL:  # the template's newline after the end of turn is part of the completion
        assert hf.decode(docs[0][0][-len(trl_pairs(hf, rows)[0][1]):]) == "It defines a function.<|im_end|>\n"
        assert meta["chat"]["template_text"] == CHATML  # an export carries the template
    else:
        assert meta["preference"]["eos_token"] == "<|im_end|>"


def test_bad_rows_are_counted_and_a_pair_never_splits(tmp_path, model, capsys):
    folder, _ = model
    rows = [*PLAIN * 20,
            {"prompt": "x", "chosen": "", "rejected": "y"},                      # empty completion
            {"prompt": "x", "chosen": "y"},                                     # missing field
            {"prompt": "x", "chosen": [{"role": "assistant", "content": "y"}], "rejected": "z"},  # mixed: no form
            {"prompt": "a very long prompt " * 20, "chosen": "y", "rejected": "z"}]  # prompt alone past --max-len
    src = write_rows(tmp_path / "pairs.jsonl", rows)
    assert run(src, "--preference", "--tokenizer", folder, "--out", tmp_path / "out", "--max-len", "40",
               "--val-fraction", "0.3") == 0
    out = capsys.readouterr().out
    assert ("1 with an empty completion" in out and "2 without prompt, chosen and rejected of one form" in out
            and "1 whose prompt alone fills --max-len 40" in out)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["preference"]["skipped"] == {"missing_field": 2, "empty_completion": 1, "prompt_too_long": 1,
                                             "refused_by_template": 0}
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    assert tr["pairs"] + va["pairs"] == 40 and va["pairs"] > 0 and tr["documents"] == 2 * tr["pairs"]
    for split in ("train", "val"):
        docs, _ = prepared(tmp_path / "out", split)
        for chosen, rejected in zip(docs[::2], docs[1::2]):  # the two share the prompt: masks start together
            first = chosen[1].index(1)
            assert first == rejected[1].index(1) and chosen[0][:first] == rejected[0][:first]


def test_no_pair_and_preference_with_chat_are_one_line_exit_2(tmp_path, model, capsys):
    folder, _ = model
    src = write_rows(tmp_path / "pairs.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    one_line_error(capsys, run(src, "--preference", "--tokenizer", folder, "--out", tmp_path / "o"),
                   "no preference pair reached train.bin \\(1 row; 1 missing field\\)")
    assert not (tmp_path / "o").exists()
    one_line_error(capsys, run(src, "--preference", "--chat", "--tokenizer", folder, "--out", tmp_path / "o"),
                   "--preference and --chat are two kinds of rows")
    shutil.rmtree(tmp_path / "o", ignore_errors=True)
    pairs = write_rows(tmp_path / "pairs.jsonl", PLAIN)  # without --preference: told to add it
    one_line_error(capsys, run(pairs, "--tokenizer", folder, "--out", tmp_path / "o"),
                   r"pairs\.jsonl, line 1: no field 'text' \(its fields: prompt, chosen, rejected\); these rows are "
                   r"preference pairs: prepare them with --preference")
    assert not (tmp_path / "o").exists()
