"""`zerodp prepare --chat`: the ids equal transformers' apply_chat_template(conversation, tokenize=True)
for a ChatML and a Llama-3 template, the mask covers exactly each assistant turn's content and its
end-of-turn token, and bad rows are counted while bad files are one line, exit 2."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.support.cli_checks import one_line_error
from tests.support.text_fixtures import EOT, train_bpe
from zerodp.cli.commands import main

SPECIAL = (EOT, "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>")
ROLES = "{% if message['role'] not in ['system', 'user', 'assistant'] %}" \
        "{{ raise_exception('Conversation roles must be system, user or assistant') }}{% endif %}"
CHATML = ("{% for message in messages %}" + ROLES +
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}" + ROLES +
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
          "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>")}

CONVERSATIONS = [
    [{"role": "system", "content": "You are a careful assistant."},
     {"role": "user", "content": "What does def do in Python?"},
     {"role": "assistant", "content": "It defines a function: def f(x): return x + 1"},
     {"role": "user", "content": "And class?"},
     {"role": "assistant", "content": "  It defines a class, été à Zürich.\n"}],
    [{"role": "user", "content": "Say assistant."}, {"role": "assistant", "content": "assistant"}],
    [{"role": "user", "content": "import os\nos.getcwd()"},
     {"role": "assistant", "content": "It returns the working directory."},
     {"role": "user", "content": "Thanks"}],
]
PROMPTS = [{"prompt": "2 + 2?", "response": "4, as int(2 + 2) says."}]


def as_messages(row):
    return row if isinstance(row, list) else [{"role": "user", "content": row["prompt"]},
                                              {"role": "assistant", "content": row["response"]}]


ROWS = [*({"messages": c} for c in CONVERSATIONS), *PROMPTS]


@pytest.fixture(scope="session")
def tok_file(tmp_path_factory):
    return train_bpe(tmp_path_factory.mktemp("chat_tok") / "tokenizer.json", vocab_size=400, n_files=10,
                     special=SPECIAL)


@pytest.fixture(scope="session", params=sorted(TEMPLATES))
def model(request, tok_file, tmp_path_factory):
    """(folder with tokenizer.json and tokenizer_config.json, transformers' tokenizer, end-of-turn token)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    template, end = TEMPLATES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    shutil.copy(tok_file, folder / "tokenizer.json")
    specials = {"bos_token": "<|begin_of_text|>", "eos_token": end}
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **specials}))
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tok_file)), chat_template=template,
                                 **specials)
    return folder, hf, end


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(*args):
    return main(["prepare", *map(str, args), "--no-progress"])


def prepared(out, split="train"):
    """The split's conversations: a list of (ids, mask) cut at the document index."""
    meta = json.loads((out / "meta.json").read_text())
    ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]).astype(np.int64)
    mask = np.fromfile(out / f"{split}.mask", dtype=np.uint8)
    idx = np.fromfile(out / f"{split}.idx", dtype=np.int64)
    assert len(mask) == len(ids) and set(np.unique(mask)) <= {0, 1}
    bounds = [*idx.tolist(), len(ids)]
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(bounds, bounds[1:])], meta


def runs(ids, mask):
    """The masked tokens as contiguous runs of ids."""
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


def assistant_texts(messages, end, trim):
    return [(m["content"].strip() if trim else m["content"]) + end for m in messages if m["role"] == "assistant"]


def test_ids_equal_apply_chat_template_and_the_mask_covers_assistant_turns(tmp_path, model, capsys):
    folder, hf, end = model
    src = write_rows(tmp_path / "chats.jsonl", ROWS)
    assert run(src, "--chat", "--tokenizer", folder, "--out", tmp_path / "out", "--val-fraction", 0) == 0
    assert "prepared 4 conversations of 4 rows" in capsys.readouterr().out
    docs, meta = prepared(tmp_path / "out")
    assert len(docs) == len(ROWS) and meta["chat"]["train_on"] == "assistant"
    # what the export and generate --chat take: the template, its special tokens, where a turn ends
    assert meta["chat"]["template_text"] == hf.chat_template and meta["chat"]["end_of_turn"] == end
    assert meta["chat"]["end_of_turn_id"] == hf.convert_tokens_to_ids(end)
    assert meta["chat"]["template_specials"]["bos_token"] == "<|begin_of_text|>"
    trim = end == "<|eot_id|>"  # the Llama 3 template trims each content
    for row, (ids, mask) in zip(ROWS, docs):
        messages = as_messages(row.get("messages", row))
        assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        got = [hf.decode(r, skip_special_tokens=False) for r in runs(ids, mask)]
        assert got == assistant_texts(messages, end, trim)
    assert meta["splits"]["train"]["targets"] == sum(sum(m) for _, m in docs) > 0


@pytest.mark.parametrize("train_on", ["last", "all"])
def test_train_on_last_and_all(tmp_path, model, train_on):
    folder, hf, end = model
    src = write_rows(tmp_path / "chats.jsonl", ROWS)
    out = tmp_path / "out"
    assert run(src, "--chat", "--tokenizer", folder, "--out", out, "--val-fraction", 0, "--train-on", train_on) == 0
    docs, meta = prepared(out)
    assert meta["chat"]["train_on"] == train_on
    for row, (ids, mask) in zip(ROWS, docs):
        messages = as_messages(row.get("messages", row))
        if train_on == "all":
            assert mask == [1] * len(ids)
        else:
            got = [hf.decode(r, skip_special_tokens=False) for r in runs(ids, mask)]
            assert got == assistant_texts(messages, end, end == "<|eot_id|>")[-1:]


def test_parquet_and_gzip_rows_with_other_field_names(tmp_path, model):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, hf, _ = model
    pq.write_table(pa.table({"chat": CONVERSATIONS}), tmp_path / "a.parquet")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"q": "2 + 2?", "a": "4."}) + "\n")
    out = tmp_path / "out"
    assert run(tmp_path / "a.parquet", tmp_path / "b.jsonl.gz", "--chat", "--tokenizer", folder, "--out", out,
               "--val-fraction", 0, "--messages-field", "chat", "--prompt-field", "q", "--response-field", "a") == 0
    docs, _ = prepared(out)
    expected = [*CONVERSATIONS, [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4."}]]
    assert [ids for ids, _ in docs] == [hf.apply_chat_template(c, tokenize=True, return_dict=False) for c in expected]


def test_bad_rows_are_counted_and_reported(tmp_path, model, capsys):
    folder, hf, _ = model
    lengths = [len(hf.apply_chat_template(as_messages(r.get("messages", r)), return_dict=False)) for r in ROWS]
    limit = sorted(lengths)[1]  # two conversations fit, two are longer
    bad = [{"text": "no conversation"}, [1, 2], {"messages": [{"role": "user"}]},
           {"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]}]
    src = write_rows(tmp_path / "chats.jsonl", [*ROWS, *bad])
    out = tmp_path / "drop"
    assert run(src, "--chat", "--tokenizer", folder, "--out", out, "--val-fraction", 0, "--max-len", limit) == 0
    line = capsys.readouterr().out
    assert "prepared 2 conversations of 8 rows" in line, line
    assert "3 not a conversation; 1 refused by the chat template; 2 longer than --max-len" in line, line
    docs, meta = prepared(out)
    assert meta["chat"]["skipped"] == {"not_a_conversation": 3, "refused_by_template": 1, "too_long": 2}
    assert sorted(len(ids) for ids, _ in docs) == sorted(n for n in lengths if n <= limit)

    out = tmp_path / "truncate"
    assert run(src, "--chat", "--tokenizer", folder, "--out", out, "--val-fraction", 0, "--max-len", limit,
               "--too-long", "truncate") == 0
    assert "2 truncated to --max-len" in capsys.readouterr().out
    docs, meta = prepared(out)
    assert [len(ids) for ids, _ in docs] == [min(n, limit) for n in lengths]
    full = [hf.apply_chat_template(as_messages(r.get("messages", r)), return_dict=False) for r in ROWS]
    assert [ids for ids, _ in docs] == [f[:limit] for f in full]


def test_a_malformed_line_and_a_missing_template_are_one_line_exit_2(tmp_path, model, tok_file, capsys):
    folder, _, _ = model
    src = write_rows(tmp_path / "chats.jsonl", [*ROWS[:2], '{"messages": [', *ROWS[2:]])
    one_line_error(capsys, run(src, "--chat", "--tokenizer", folder, "--out", tmp_path / "a"),
                   r"chats\.jsonl, line 3: not JSON")
    assert not (tmp_path / "a").exists()
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tok_file, bare / "tokenizer.json")
    good = write_rows(tmp_path / "good.jsonl", ROWS)
    one_line_error(capsys, run(good, "--chat", "--tokenizer", bare, "--out", tmp_path / "b"),
                   r"no chat template for .*; give one with --chat-template FILE")
    (tmp_path / "t.jinja").write_text(CHATML)  # given on the command line, it serves
    assert run(good, "--chat", "--tokenizer", bare, "--out", tmp_path / "c", "--chat-template",
               tmp_path / "t.jinja", "--val-fraction", 0) == 0
    one_line_error(capsys, run(good, "--chat", "--tokenizer", bare, "--out", tmp_path / "d", "--chat-template",
                               tmp_path / "missing.jinja"), r"--chat-template .*missing\.jinja not found")


BAD_INPUTS = {
    "--max-len": (["good.jsonl", "--max-len", "1"], r"--max-len 1 must be at least 2 tokens"),
    "--val-fraction": (["good.jsonl", "--val-fraction", "1"], r"--val-fraction 1\.0 must be in \[0, 1\)"),
    "text file": (["a.txt"], r"a\.txt is a text file; --chat reads conversations from JSONL"),
    "no rows": (["blank.jsonl"], r"blank\.jsonl holds no rows; give files that hold conversations"),
    "no conversation": (["none.jsonl"], r"no conversation reached train\.bin \(1 rows; 1 not a conversation\); "
                                        r"check the rows' fields"),
    "template syntax": (["good.jsonl", "--chat-template", "bad.jinja"],
                        r"the chat template of .*bad\.jinja is not valid Jinja \(line 1: "),
    "template json": (["good.jsonl", "--chat-template", "plain.json"],
                      r"--chat-template .*plain\.json is JSON without a chat_template string"),
    "tokenizer_config": (["good.jsonl", "--tokenizer", "broken"], r"tokenizer_config\.json is not JSON \("),
    "--train-on": (["good.jsonl", "--train-on", "answers"], r"argument --train-on: invalid choice: 'answers'"),
    "--too-long": (["good.jsonl", "--too-long", "cut"], r"argument --too-long: invalid choice: 'cut'"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_chat_inputs_are_one_line_exit_2(tmp_path, tok_file, capsys, case):
    args, pattern = BAD_INPUTS[case]
    (tmp_path / "tok").mkdir()
    shutil.copy(tok_file, tmp_path / "tok" / "tokenizer.json")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    (tmp_path / "broken").mkdir()
    shutil.copy(tok_file, tmp_path / "broken" / "tokenizer.json")
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{not json")
    write_rows(tmp_path / "good.jsonl", ROWS)
    write_rows(tmp_path / "none.jsonl", [{"text": "no conversation"}])
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "a.txt").write_text("plain text\n")
    (tmp_path / "bad.jinja").write_text("{% for message in messages %}")
    (tmp_path / "plain.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    given = [str(tmp_path / a) if (tmp_path / a).exists() else a for a in args]
    if "--tokenizer" not in given:
        given += ["--tokenizer", str(tmp_path / "tok")]
    try:
        code = run(given[0], "--chat", "--out", tmp_path / "out", *given[1:])
    except SystemExit as e:  # argparse's choices: the parser's own one line and exit 2
        code = e.code
    one_line_error(capsys, code, pattern)
    assert not (tmp_path / "out").exists()


def test_a_samples_y_is_ignore_index_exactly_at_the_non_targets(tmp_path, model, tiny):
    import torch
    import torch.nn.functional as F

    from zerodp.config import load_config
    from zerodp.data.batches import IGNORE_INDEX, TokenBatches, load_tokens
    from zerodp.models import build_model

    folder, _, _ = model
    out = tmp_path / "out"
    assert run(write_rows(tmp_path / "chats.jsonl", ROWS * 6), "--chat", "--tokenizer", folder, "--out", out,
               "--val-fraction", 0.2) == 0
    cfg = load_config(None, tiny + [f"data.source={out}", "model.vocab_size=512", "model.block_size=16"])
    T = cfg.model.block_size
    for split in ("train", "val"):
        tokens = np.fromfile(out / f"{split}.bin", dtype=json.loads((out / "meta.json").read_text())["dtype"])
        mask = np.fromfile(out / f"{split}.mask", dtype=np.uint8)
        data = TokenBatches(load_tokens(cfg), cfg, split)
        n = data.samples_per_epoch()[0]
        offsets = data.offsets(0, n)  # every sample of the epoch
        x, y = data.rows(offsets)
        for r, o in enumerate(offsets.tolist()):
            assert x[r].tolist() == tokens[o : o + T].tolist()
            want = np.where(mask[o + 1 : o + T + 1] == 1, tokens[o + 1 : o + T + 1].astype(np.int64), IGNORE_INDEX)
            assert y[r].tolist() == want.tolist()
        assert (y == IGNORE_INDEX).any() and (y != IGNORE_INDEX).any()
    torch.manual_seed(0)
    net = build_model(cfg.model).eval()
    with torch.no_grad():
        logits = net(x).float()
        keep = y != IGNORE_INDEX
        per_token = F.cross_entropy(logits[keep], y[keep], reduction="none")
        assert torch.allclose(net(x, y), per_token.mean(), rtol=1e-5)  # the loss: the mean over targets only


def test_the_mask_equals_transformers_assistant_masks_of_a_generation_template(tmp_path, tok_file):
    """A template marking each assistant content and end-of-turn token with {% generation %}: transformers'
    own return_assistant_tokens_mask, computed from those marks, equals the mask found from prefixes."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
                "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
                "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
                "{% endfor %}")
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(tok_file, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tok_file)), chat_template=template)
    assert run(write_rows(tmp_path / "c.jsonl", ROWS), "--chat", "--tokenizer", folder, "--out", tmp_path / "out",
               "--val-fraction", 0) == 0
    docs, _ = prepared(tmp_path / "out")
    for row, (ids, mask) in zip(ROWS, docs):
        want = hf.apply_chat_template(as_messages(row.get("messages", row)), return_assistant_tokens_mask=True)
        assert ids == want["input_ids"] and mask == want["assistant_masks"] and sum(mask) > 0


def test_a_mixture_masks_only_the_rows_of_its_masked_source(tmp_path, model, tiny):
    from zerodp.config import load_config
    from zerodp.data.batches import IGNORE_INDEX, TokenBatches, load_tokens

    folder, _, _ = model
    chat, text = tmp_path / "chat", tmp_path / "text"
    assert run(write_rows(tmp_path / "c.jsonl", ROWS * 6), "--chat", "--tokenizer", folder, "--out", chat,
               "--val-fraction", 0) == 0
    (tmp_path / "t.txt").write_text("def f(x):\n    return x + 1\n" * 60)
    assert run(tmp_path / "t.txt", "--tokenizer", folder, "--out", text, "--val-fraction", 0) == 0
    cfg = load_config(None, tiny + [f"data.sources=[{{path: {chat}, weight: 1}}, {{path: {text}, weight: 1}}]",
                                    "model.vocab_size=512", "model.block_size=16"])
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    where = data.locate(0, 24)
    _, y = data.rows(data.offsets(0, 24))
    ignored = (y == IGNORE_INDEX).any(dim=1).numpy()
    assert set(where.source[ignored].tolist()) == {0} and ignored.any()  # only chat rows have ignored targets
    assert (where.source == 1).any()


def test_a_small_set_keeps_one_conversation_for_validation_and_says_so(tmp_path, model, capsys):
    """With --val-fraction 0.01 none of 4 conversations falls in val: the last one goes there (tokens, mask
    and index), one note says so, and --val-fraction 0 still means no validation split."""
    folder, _, _ = model
    src = write_rows(tmp_path / "chats.jsonl", ROWS)
    assert run(src, "--chat", "--tokenizer", folder, "--out", tmp_path / "all", "--val-fraction", 0) == 0
    everything, _ = prepared(tmp_path / "all")
    capsys.readouterr()
    assert run(src, "--chat", "--tokenizer", folder, "--out", tmp_path / "out", "--val-fraction", 0.01) == 0
    err = capsys.readouterr().err
    assert err == ("zerodp: note: --val-fraction 0.01 put none of the 4 conversations in val.bin, so the last one "
                   "went there for validation (--val-fraction 0: no validation split)\n"), err
    train, meta = prepared(tmp_path / "out")
    val, _ = prepared(tmp_path / "out", "val")
    assert train == everything[:3] and val == everything[3:]
    splits = meta["splits"]
    assert (splits["train"]["documents"], splits["val"]["documents"]) == (3, 1)
    assert splits["val"]["tokens"] == len(val[0][0]) and splits["val"]["targets"] == sum(val[0][1]) > 0
    assert splits["train"]["tokens"] == sum(len(i) for i, _ in train) and meta["chat"]["val_from_train"] == 1
    # the recipe's --max-len (block_size + 1): a val.bin too short for one sample of that run is said too
    assert run(src, "--chat", "--tokenizer", folder, "--out", tmp_path / "long", "--max-len", 2049) == 0
    n = splits["val"]["tokens"]
    assert (f"zerodp: note: val.bin holds {n} tokens, fewer than --max-len + 1 = 2,050: a run at model.block_size "
            f"2,048 cannot validate on it (a sample is block_size + 1 tokens, and validation needs a split of "
            f"block_size + 2 at least)") in capsys.readouterr().err


def test_chat_rows_prepared_without_chat_are_told_to_use_chat(tmp_path, tok_file, capsys):
    """Conversations given to the text path: the one line suggests --chat, not --field."""
    src = write_rows(tmp_path / "chats.jsonl", ROWS)
    one_line_error(capsys, run(src, "--tokenizer", tok_file, "--out", tmp_path / "out"),
                   r"chats\.jsonl, line 1: no field 'text' \(its fields: messages\); these rows are conversations: "
                   r"prepare them with --chat")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["2 + 2?"], "response": ["4"]}), tmp_path / "pairs.parquet")
    one_line_error(capsys, run(tmp_path / "pairs.parquet", "--tokenizer", tok_file, "--out", tmp_path / "out"),
                   r"no column 'text' \(its columns: prompt, response\); these rows are conversations: prepare "
                   r"them with --chat")
    assert not (tmp_path / "out").exists()
