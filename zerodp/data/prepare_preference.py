"""`zerodp prepare --preference`: preference pairs (JSONL, optionally .gz/.zst, or Parquet rows) ->
DIR/train.bin, val.bin, their .idx and .mask, and meta.json, for `train.objective: dpo`.

    zerodp prepare pairs.jsonl --preference --tokenizer path/to/hf_model --out data/dpo

The rows are TRL's two standard preference forms, told apart row by row as TRL's is_conversational does
(a `prompt` that is a list of messages):
- plain: `{"prompt": str, "chosen": str, "rejected": str}`. As TRL's DPOTrainer tokenizes it: the
  tokenizer's eos_token appended to each completion that does not end with it, then the prompt and
  prompt + completion encoded with the tokenizer's special tokens (a BOS, say).
- conversational: `{"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}`, rendered by
  the tokenizer's chat template (zerodp.data.chat): the prompt with its generation prompt, and prompt +
  completion without.
The completion is what prompt + completion holds past the longest prefix it shares with the prompt's
ids, both completions measured against the one prompt (TRL's common_prefix_length): for ChatML,
`It is 4.<|im_end|>\n`, the newline the template writes after the turn included.

Each kept pair is two documents of the index, the chosen sequence then the rejected one, both the same
prompt ids followed by the completion's; the .mask holds 1 on the completion tokens only. Both go to the
same split (val.bin with probability --val-fraction, by a hash of (seed, row number), as chat data's
conversations), so pair i of a split is documents 2i and 2i+1. A row without the three fields as one of
the forms (missing_field), a pair with an empty completion (empty_completion) and one whose prompt alone
has --max-len tokens or more (prompt_too_long, as TRL drops it) are counted, not fatal; a sequence longer
than --max-len keeps its first --max-len tokens (TRL's keep_start), counted as truncated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from zerodp.checkpoint.safe_output import staged
from zerodp.config.sources import META
from zerodp.data.chat import Refused, load_template
from zerodp.data.prepare_chat import SPLITS, check_lengths, command_line, masked_meta, row_sources, template_meta
from zerodp.data.sources import records
from zerodp.data.tokenizer import load_tokenizer
from zerodp.errors import UserError

FIELDS = ("prompt", "chosen", "rejected")
SKIPS = ("missing_field", "empty_completion", "prompt_too_long", "refused_by_template")


class Skip(ValueError):
    """A row that gives no pair: its reason (one of SKIPS) is the message."""


def pair_form(row) -> str:
    """'plain' or 'conversational' for a preference row; Skip('missing_field') for anything else, and
    Skip('empty_completion') for an empty chosen or rejected."""
    if not isinstance(row, dict) or any(row.get(f) is None for f in FIELDS):
        raise Skip("missing_field")
    prompt, chosen, rejected = (row[f] for f in FIELDS)
    if all(isinstance(x, str) for x in (prompt, chosen, rejected)):
        if not chosen or not rejected:
            raise Skip("empty_completion")
        return "plain"
    if all(isinstance(x, list) for x in (prompt, chosen, rejected)):
        for m in (*prompt, *chosen, *rejected):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise Skip("missing_field")
        if not chosen or not rejected or not any(m["content"] for m in chosen) or not any(
                m["content"] for m in rejected):
            raise Skip("empty_completion")
        return "conversational"
    raise Skip("missing_field")


def _messages(msgs: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if v is not None} for m in msgs]  # as transformers normalises them


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PairEncoder:
    """Token ids of a preference row: (prompt ids, chosen completion ids, rejected completion ids), as TRL's
    DPOTrainer computes them (see the module docstring)."""

    def __init__(self, tok, chat_template: str | None):
        self.tok, self.template = tok, _lenient_template(tok.path, chat_template)
        self.eos = self.template.specials.get("eos_token") or tok.eot_token

    def encode(self, row: dict, form: str) -> tuple[list[int], list[int], list[int]]:
        enc = self.tok.tokenizer.encode
        if form == "plain":
            if self.eos is None:
                raise UserError(f"{self.tok.path}: plain preference rows end each completion with the tokenizer's "
                                f"eos_token, and it names none; put its tokenizer_config.json (with eos_token) "
                                f"beside the tokenizer.json")
            completions = [c if c.endswith(self.eos) else c + self.eos for c in (row["chosen"], row["rejected"])]
            prompt = enc(row["prompt"]).ids
            full = [enc(row["prompt"] + c).ids for c in completions]
        else:
            tpl, prompt_msgs = self.template, _messages(row["prompt"])
            if tpl.template is None:
                raise UserError(tpl.source)
            prompt = enc(tpl.render(prompt_msgs, add_generation_prompt=True), add_special_tokens=False).ids
            full = [enc(tpl.render(prompt_msgs + _messages(row[f])), add_special_tokens=False).ids
                    for f in ("chosen", "rejected")]
        n = min(common_prefix_length(prompt, full[0]), common_prefix_length(prompt, full[1]))
        return prompt[:n], full[0][n:], full[1][n:]


def _lenient_template(tokenizer_file: Path, given: str | None):
    """The chat template, or one whose `template` is None and `source` the one-line reason there is none
    (raised only when a conversational row needs it); its specials are the tokenizer_config.json's."""
    try:
        return load_template(tokenizer_file, given)
    except UserError as e:
        from zerodp.data.chat import ChatTemplate

        config = tokenizer_file.with_name("tokenizer_config.json")
        try:
            data = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        except ValueError:
            data = {}
        eos = data.get("eos_token") if isinstance(data, dict) else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        return ChatTemplate(str(e), "", {"eos_token": eos} if isinstance(eos, str) else {}, None)


def prepare_preference(opts, not_replaceable) -> dict:
    """Tokenize the preference pairs of `opts.inputs` into `opts.out`; return the meta.json written."""
    from zerodp.data.prepare import val_mask

    check_lengths(opts)
    tok = load_tokenizer(opts.tokenizer, None)
    encoder = PairEncoder(tok, opts.chat_template)
    sources = row_sources(opts, tok.path, "--preference", "pairs", not_replaceable)
    skipped, forms, truncated, rows = dict.fromkeys(SKIPS, 0), {"plain": 0, "conversational": 0}, 0, 0
    counts = {s: {"pairs": 0, "documents": 0, "tokens": 0, "targets": 0} for s in SPLITS}
    t0 = time.time()
    with staged(opts.out) as tmp:
        files = {(s, kind): open(tmp / f"{s}.{kind}", "wb") for s in SPLITS for kind in ("bin", "idx", "mask")}
        try:
            for src in sources:
                for row, _where, _ in records(src, FIELDS):
                    rows += 1
                    src.documents += 1
                    try:
                        form = pair_form(row)
                        prompt, chosen, rejected = encoder.encode(row, form)
                    except Skip as e:
                        skipped[str(e)] += 1
                        continue
                    except Refused:
                        skipped["refused_by_template"] += 1
                        continue
                    if not chosen or not rejected:
                        skipped["empty_completion"] += 1
                        continue
                    if opts.max_len is not None and len(prompt) >= opts.max_len:
                        skipped["prompt_too_long"] += 1
                        continue
                    forms[form] += 1
                    split = "val" if val_mask(opts.seed, rows - 1, 1, opts.val_fraction)[0] else "train"
                    c = counts[split]
                    c["pairs"] += 1
                    for completion in (chosen, rejected):
                        ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
                        if opts.max_len is not None and len(ids) > opts.max_len:
                            ids, mask, truncated = ids[: opts.max_len], mask[: opts.max_len], truncated + 1
                        np.array([c["tokens"]], dtype=np.int64).tofile(files[split, "idx"])
                        np.array(ids, dtype=tok.dtype).tofile(files[split, "bin"])
                        np.array(mask, dtype=np.uint8).tofile(files[split, "mask"])
                        c["documents"] += 1
                        c["tokens"] += len(ids)
                        c["targets"] += sum(mask)
                if src.given and src.documents == 0:
                    raise UserError(f"{src.path} holds no rows; give files that hold preference pairs")
        finally:
            for f in files.values():
                f.close()
        if counts["train"]["pairs"] == 0:
            why = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in skipped.items() if n)
            what = f"{rows:,} row{'s' * (rows != 1)}{'; ' + why if why else ''}"
            raise UserError(f"no preference pair reached train.bin ({what}); each "
                            f"row needs prompt, chosen and rejected (strings, or lists of messages), and "
                            f"--max-len and --val-fraction must leave some")
        tpl = encoder.template if forms["conversational"] else None
        meta = masked_meta(tok, counts, sources, t0, opts, special_tokens=bool(forms["plain"]),
                           counted=("pairs", "documents", "tokens"),
                           index_of="each sequence's first token: pair i is the chosen 2i, the rejected 2i+1",
                           mask_of="1 where the token is a completion's",
                           record={"preference": {"rows": rows, "forms": forms, "skipped": skipped,
                                                  "truncated": truncated, "max_len": opts.max_len,
                                                  "eos_token": encoder.eos if forms["plain"] else None},
                                   **({"chat": template_meta(tpl, tok)} if tpl is not None else {})},
                           command=command_line(opts, "--preference"))
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta
