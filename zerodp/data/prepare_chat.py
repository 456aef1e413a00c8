"""`zerodp prepare --chat`: conversations (JSONL, optionally .gz/.zst, or Parquet rows) -> DIR/train.bin,
val.bin, their .idx and their .mask, and meta.json.

    zerodp prepare chats.jsonl --chat --tokenizer path/to/hf_model --out data/sft

What it promises (besides zerodp.data.prepare's: the .bin layout, the split by a hash of (seed, row
number), nothing partial):
- Each row is `{"messages": [{"role", "content"}, ...]}` or `{"prompt", "response"}` (a user turn and an
  assistant turn); the field names are options. Its ids are the tokenizer's encoding of the conversation
  rendered by its chat template (zerodp.data.chat), with add_special_tokens=False: the ids transformers'
  apply_chat_template(messages, tokenize=True) gives. No separator follows: the template writes its own
  turn ends. Each conversation is one document of the index (train.idx).
- Beside each .bin, a .mask: one uint8 per token, 1 where the token is a target (train_on: every
  assistant turn's content and end-of-turn token, the last assistant turn's only, or every token).
- A row that holds no conversation, one the template refuses, and one longer than max_len tokens (with
  too_long='drop'; 'truncate' keeps its first max_len tokens) are counted, not fatal: meta.json's
  chat.skipped and the summary line say how many. A line that is not JSON is fatal (file and line named).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from zerodp import __version__
from zerodp.checkpoint.safe_output import check_output, staged
from zerodp.config.sources import FORMAT, META
from zerodp.data.chat import (
    TRAIN_ON,
    NotAConversation,
    Refused,
    conversation,
    end_of_turn,
    load_template,
    target_spans,
    token_mask,
)
from zerodp.data.sources import find_sources, records, sources_meta
from zerodp.data.tokenizer import load_tokenizer
from zerodp.errors import UserError

FORMAT_VERSION, SPLITS = 2, ("train", "val")
TOO_LONG = ("drop", "truncate")
SKIPS = ("not_a_conversation", "refused_by_template", "too_long")


def check_chat_options(opts) -> None:
    if opts.train_on not in TRAIN_ON:
        raise UserError(f"--train-on {opts.train_on!r} is not one of {', '.join(TRAIN_ON)}")
    if opts.too_long not in TOO_LONG:
        raise UserError(f"--too-long {opts.too_long!r} is not one of {', '.join(TOO_LONG)}")
    check_lengths(opts)


def check_lengths(opts) -> None:
    """--max-len and --val-fraction, as every prepare of rows (conversations, preference pairs) takes them."""
    if opts.max_len is not None and opts.max_len < 2:
        raise UserError(f"--max-len {opts.max_len} must be at least 2 tokens (model.block_size + 1, say)")
    if not 0.0 <= opts.val_fraction < 1.0:
        raise UserError(f"--val-fraction {opts.val_fraction} must be in [0, 1); 0 writes an empty val.bin")


def row_sources(opts, tokenizer: Path, flag: str, what: str, not_replaceable) -> list:
    """The JSONL/Parquet files of `opts.inputs` (a text file refused: `flag` reads `what`), after checking
    that `opts.out` may be written (zerodp.checkpoint.safe_output.check_output)."""
    sources = find_sources(opts.inputs, None)
    for s in sources:
        if s.kind == "text":
            raise UserError(f"{s.path} is a text file; {flag} reads {what} from JSONL (.jsonl, optionally "
                            f".gz/.zst) or Parquet files")
    extra = [Path(opts.chat_template)] if opts.chat_template else []
    check_output(opts.out, [tokenizer, *extra, *(Path(i) for i in opts.inputs), *(s.path for s in sources)],
                 opts.overwrite, "zerodp prepare", not_replaceable)
    return sources


def prepare_chat(opts, not_replaceable) -> dict:
    """Tokenize the conversations of `opts.inputs` into `opts.out`; return the meta.json written."""
    from zerodp.data.prepare import val_mask

    check_chat_options(opts)
    tok = load_tokenizer(opts.tokenizer, "none")
    tpl = load_template(tok.path, opts.chat_template)
    sources = row_sources(opts, tok.path, "--chat", "conversations", not_replaceable)
    fields = (opts.messages_field, opts.prompt_field, opts.response_field)
    skipped, truncated, rows = dict.fromkeys(SKIPS, 0), 0, 0
    counts = {s: {"documents": 0, "tokens": 0, "targets": 0} for s in SPLITS}
    t0 = time.time()
    with staged(opts.out) as tmp:
        files = {(s, kind): open(tmp / f"{s}.{kind}", "wb") for s in SPLITS for kind in ("bin", "idx", "mask")}
        try:
            for src in sources:
                pending: list[tuple[str, list[tuple[int, int]], int]] = []  # (rendered, spans, row number)
                for row, _where, _ in records(src, fields):
                    rows += 1
                    src.documents += 1
                    try:
                        messages = conversation(row, *fields)
                        rendered = tpl.render(messages)
                        pending.append((rendered, target_spans(tpl, messages, rendered, opts.train_on), rows - 1))
                    except NotAConversation:
                        skipped["not_a_conversation"] += 1
                    except Refused:
                        skipped["refused_by_template"] += 1
                    if len(pending) >= 256:
                        truncated += _flush(tok, pending, opts, files, counts, skipped, val_mask)
                        pending = []
                truncated += _flush(tok, pending, opts, files, counts, skipped, val_mask)
                if src.given and src.documents == 0:
                    raise UserError(f"{src.path} holds no rows; give files that hold conversations")
        finally:
            for f in files.values():
                f.close()
        moved = _keep_one_val(tmp, counts, tok.dtype, opts.val_fraction)
        if counts["train"]["documents"] == 0:
            why = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in skipped.items() if n)
            raise UserError(f"no conversation reached train.bin ({rows:,} rows{'; ' + why if why else ''}); check "
                            f"the rows' fields (--messages-field, --prompt-field, --response-field), --max-len "
                            f"and --val-fraction")
        meta = masked_meta(tok, counts, sources, t0, opts, special_tokens=False, counted=("documents", "tokens"),
                           index_of="each conversation's first token", mask_of="1 where the token is a target",
                           record={"field": opts.messages_field, "chat": {
                               **template_meta(tpl, tok), "train_on": opts.train_on, "max_len": opts.max_len,
                               "too_long": opts.too_long, "rows": rows, "skipped": skipped, "truncated": truncated,
                               "val_from_train": moved,
                               "fields": dict(zip(("messages", "prompt", "response"), fields))}},
                           command=command_line(opts, "--chat", "--messages-field", opts.messages_field,
                                                "--prompt-field", opts.prompt_field, "--response-field",
                                                opts.response_field, "--train-on", opts.train_on, "--too-long",
                                                opts.too_long))
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def template_meta(tpl, tok) -> dict:
    """meta.json's record of the chat template a folder was rendered with (source, sha256, text, specials)
    and its end-of-turn token: what start-up, generate and export read back."""
    return {"template": tpl.source, "template_sha256": _sha(tpl.text), "template_text": tpl.text,
            "template_specials": tpl.specials,
            **dict(zip(("end_of_turn", "end_of_turn_id"), end_of_turn(tpl, tok.tokenizer)))}


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _keep_one_val(tmp: Path, counts: dict, dtype, val_fraction: float) -> int:
    """Where --val-fraction > 0 put no conversation in val and train holds two or more, move train's last
    conversation (its tokens, mask and index entry) to val: a small set still gets a validation split.
    Returns the conversations moved (0 or 1); the summary says so."""
    last = counts["train"].pop("last", None)
    counts["val"].pop("last", None)
    if counts["val"]["documents"] or val_fraction <= 0 or counts["train"]["documents"] < 2 or last is None:
        return 0
    start, n, targets = last
    cuts = {"bin": start * np.dtype(dtype).itemsize, "mask": start, "idx": (counts["train"]["documents"] - 1) * 8}
    for kind, cut in cuts.items():
        with open(tmp / f"train.{kind}", "r+b") as f:
            f.seek(cut)
            tail = f.read()
            f.truncate(cut)
        # val is empty: the conversation is all of it, starting at token 0
        (tmp / f"val.{kind}").write_bytes(np.zeros(1, np.int64).tobytes() if kind == "idx" else tail)
    counts["train"].update(documents=counts["train"]["documents"] - 1, tokens=counts["train"]["tokens"] - n,
                           targets=counts["train"]["targets"] - targets)
    counts["val"].update(documents=1, tokens=n, targets=targets)
    return 1


def _flush(tok, pending, opts, files, counts, skipped, val_mask) -> int:
    """Encode `pending` conversations, append each kept one to its split; return how many were truncated."""
    if not pending:
        return 0
    encodings = tok.tokenizer.encode_batch([r for r, _, _ in pending], add_special_tokens=False)
    truncated = 0
    for (_, spans, number), enc in zip(pending, encodings):
        ids, mask = enc.ids, token_mask(enc.offsets, spans)
        if opts.max_len is not None and len(ids) > opts.max_len:
            if opts.too_long == "drop":
                skipped["too_long"] += 1
                continue
            ids, mask, truncated = ids[: opts.max_len], mask[: opts.max_len], truncated + 1
        if not ids:
            skipped["not_a_conversation"] += 1  # a template that renders it as nothing
            continue
        split = "val" if val_mask(opts.seed, number, 1, opts.val_fraction)[0] else "train"
        c = counts[split]
        c["last"] = (c["tokens"], len(ids), sum(mask))  # (start, tokens, targets): _keep_one_val may move it
        np.array([c["tokens"]], dtype=np.int64).tofile(files[split, "idx"])
        np.array(ids, dtype=tok.dtype).tofile(files[split, "bin"])
        np.array(mask, dtype=np.uint8).tofile(files[split, "mask"])
        c["documents"] += 1
        c["tokens"] += len(ids)
        c["targets"] += sum(mask)
    return truncated


def masked_meta(tok, counts: dict, sources, t0: float, opts, *, special_tokens: bool, counted: tuple[str, ...],
                index_of: str, mask_of: str, record: dict, command: str) -> dict:
    """meta.json of a folder of masked sequences (`prepare --chat`, `--preference`): the tokenizer, each split's
    files with its `counted` figures and targets (what its index and mask hold: `index_of`, `mask_of`), `record`
    (the kind's own keys), the sources and the `command` that makes the folder again."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "zerodp_version": __version__,
        "tokenizer": {"path": str(tok.path.resolve()), "sha256": tok.sha256},
        "vocab_size": tok.vocab_size, "dtype": tok.dtype.name,
        "eot_id": None, "eot_token": None, "special_tokens": special_tokens,
        "val_fraction": opts.val_fraction, "seed": opts.seed,
        "splits": {s: {"file": f"{s}.bin", **{k: counts[s][k] for k in counted}, "targets": counts[s]["targets"],
                       "index": {"file": f"{s}.idx", "dtype": "int64", "of": index_of},
                       "mask": {"file": f"{s}.mask", "dtype": "uint8", "of": mask_of}}
                   for s in SPLITS},
        **record,
        "documents": counts["train"]["documents"] + counts["val"]["documents"], "split_by_tokens": 0,
        "tokens": sum(counts[s]["tokens"] for s in SPLITS),
        **sources_meta(sources),
        "seconds": round(time.time() - t0, 3),
        "command": command,
    }


def command_line(opts, kind: str, *options: str) -> str:
    """`zerodp prepare INPUTS KIND --tokenizer T --out O OPTIONS ...`: the command that makes the folder again."""
    import shlex

    args = ["zerodp", "prepare", *opts.inputs, kind, "--tokenizer", opts.tokenizer, "--out", opts.out, *options,
            "--val-fraction", repr(opts.val_fraction), "--seed", str(opts.seed)]
    args += ["--chat-template", opts.chat_template] if opts.chat_template else []
    args += ["--max-len", str(opts.max_len)] if opts.max_len is not None else []
    return shlex.join(args)
