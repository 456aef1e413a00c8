"""`zerodp prepare INPUT... --tokenizer TOKENIZER --out DIR`: documents -> train.bin, val.bin, meta.json.

zerodp/cli.py registers it with `add_prepare_parser(subparsers)`; `run_prepare(args)` returns the exit
code and raises UserError for bad input (one line on stderr, exit 2). Never imports zerodp.cli.commands (no
import circle) nor torch.
"""

from __future__ import annotations

import argparse
import sys

from zerodp.data.prepare import BATCH_BYTES, PrepareOptions, plural, size_text
from zerodp.errors import UserError

BATCH_SIZE = f"{BATCH_BYTES >> 10}KiB"  # --batch-size's default, as written on the command line

EXAMPLES = """examples:
  zerodp prepare builtin --tokenizer tok.json --out data/stdlib
  zerodp prepare docs/ notes.txt --tokenizer path/to/hf_model --out data/mine --val-fraction 0.05
  zerodp prepare shard-*.jsonl.gz --field content --tokenizer gpt2/tokenizer.json --out data/web
  zerodp prepare train-*.parquet --tokenizer path/to/hf_model --out data/pq --eot '</s>'
  zerodp prepare chats.jsonl --chat --tokenizer path/to/hf_model --out data/sft --max-len 2049
  zerodp prepare pairs.jsonl --preference --tokenizer path/to/hf_model --out data/dpo --max-len 1025
then train on the folder:  zerodp train configs/tiny.yaml data.source=data/mine (see docs/data.md)
"""


def add_prepare_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prepare", help="tokenize text, JSONL or Parquet into train.bin/val.bin with a Hugging Face tokenizer",
        description="Encode documents with a tokenizers tokenizer.json (every core), each followed by the "
                    "end-of-text token, split by whole documents (by tokens for one longer than the val "
                    "split's share) into DIR/train.bin and DIR/val.bin (uint16, or "
                    "uint32 for a vocabulary over 65536) and describe them in DIR/meta.json. Streams: memory "
                    "does not grow with the input. See docs/data.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text file, folder (every text/.jsonl/.parquet file in it, one document per text file), "
                        ".jsonl[.gz|.zst] (one document per line), .parquet, or 'builtin' (the Python stdlib)")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, or a Hugging Face model folder holding one")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (new or empty; see --overwrite)")
    p.add_argument("--field", default="text", help="JSONL field / Parquet column with the text (default: text)")
    p.add_argument("--val-fraction", type=float, default=PrepareOptions.val_fraction,
                   help=f"share of the input for val.bin: documents chosen by a hash of (seed, document number); "
                        f"a document longer than that share of the input gives val.bin the same share of its "
                        f"tokens, its last ones (default {PrepareOptions.val_fraction})")
    p.add_argument("--seed", type=int, default=0, help="which documents go to val.bin (default 0)")
    p.add_argument("--eot", default=None, metavar="TOKEN",
                   help="separator after each document (default: the tokenizer's end-of-text token); 'none': none")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="do not let the tokenizer's post-processor add its special tokens (a BOS, say)")
    p.add_argument("--batch-size", default=BATCH_SIZE, metavar="SIZE",
                   help=f"text per encode batch, e.g. 1MiB or 4MB (default {BATCH_SIZE}); changes memory, not output")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it holds an earlier zerodp prepare")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = p.add_argument_group("conversations (--chat)", "rows of messages (or a prompt and a response) rendered by "
                             "the tokenizer's chat template, with a loss mask (DIR/train.mask): see docs/data.md")
    c.add_argument("--chat", action="store_true", help="the inputs are JSONL/Parquet rows of conversations")
    c.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (default: the chat_template.jinja "
                   "or tokenizer_config.json chat_template beside the tokenizer.json)")
    c.add_argument("--messages-field", default="messages", help="field with the list of {role, content} messages "
                   "(default: messages)")
    c.add_argument("--prompt-field", default="prompt", help="field of a row's user prompt (default: prompt)")
    c.add_argument("--response-field", default="response", help="field of a row's response (default: response)")
    c.add_argument("--train-on", default="assistant", choices=("assistant", "last", "all"),
                   help="the loss's targets: every assistant turn (default), the last one only, or every token")
    c.add_argument("--max-len", type=int, default=None, metavar="TOKENS",
                   help="a conversation longer than this many tokens is dropped or truncated (--too-long)")
    c.add_argument("--too-long", default="drop", choices=("drop", "truncate"),
                   help="what --max-len does to a longer conversation: drop it (default) or keep its first tokens")
    d = p.add_argument_group("preference pairs (--preference)", "rows of TRL's preference forms (prompt, chosen, "
                             "rejected: strings, or lists of messages rendered by the chat template) for "
                             "train.objective=dpo: see docs/fine_tuning.md")
    d.add_argument("--preference", action="store_true", help="the inputs are JSONL/Parquet rows of preference pairs "
                   "(--chat-template and --max-len apply)")
    p.set_defaults(func=run_prepare)
    return p


def run_prepare(args) -> int:
    from zerodp.data.prepare import prepare
    from zerodp.planner.units import parse_bytes  # the sizes --max-memory and --hbm take, no torch

    opts = PrepareOptions(inputs=list(args.inputs), tokenizer=args.tokenizer, out=args.out, field=args.field,
                          val_fraction=args.val_fraction, seed=args.seed, eot=args.eot,
                          special_tokens=not args.no_special_tokens, overwrite=args.overwrite,
                          progress=not args.no_progress,
                          batch_bytes=parse_bytes(args.batch_size, "--batch-size", example=BATCH_SIZE),
                          chat=args.chat, chat_template=args.chat_template, messages_field=args.messages_field,
                          prompt_field=args.prompt_field, response_field=args.response_field,
                          train_on=args.train_on, max_len=args.max_len, too_long=args.too_long,
                          preference=args.preference)
    if opts.preference and opts.chat:
        raise UserError("--preference and --chat are two kinds of rows; give one (--preference reads prompt, chosen "
                        "and rejected)")
    meta = prepare(opts)
    if opts.preference:
        return _preference_summary(meta, args.out)
    if opts.chat:
        return _chat_summary(meta, args.out)
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    seconds = meta["seconds"]
    print(f"prepared {plural(meta['documents'], 'document')} ({size_text(meta['bytes'])} in "
          f"{plural(len(meta['sources']), 'file')}) into {args.out}: train {plural(tr['documents'], 'document')} "
          f"/ {plural(tr['tokens'], 'token')}, val {plural(va['documents'], 'document')} / "
          f"{plural(va['tokens'], 'token')}; "
          f"{meta['dtype']}, vocabulary {meta['vocab_size']:,}, separator {meta['eot_token']!r} ({seconds:.1f} s, "
          f"{size_text(meta['bytes'] / max(seconds, 1e-9))}/s)")
    split, share = meta["split_by_tokens"], f"{meta['val_fraction'] * 100:g}%"
    if split:
        is_, whose = ("is", "its") if split == 1 else ("are", "each one's")
        print(f"split by tokens: {plural(split, 'document')} {is_} longer than --val-fraction {meta['val_fraction']} "
              f"of the input, so the last {share} of {whose} tokens went to val.bin, the rest to train.bin")
    if va["documents"] == 0 and meta["val_fraction"] > 0:
        print(f"zerodp: note: no document fell in val.bin (--val-fraction {meta['val_fraction']}, "
              f"{plural(meta['documents'], 'document')}); raise it for a validation split", file=sys.stderr)
    return 0


def _preference_summary(meta: dict, out: str) -> int:
    tr, va, pref = meta["splits"]["train"], meta["splits"]["val"], meta["preference"]
    why = {"missing_field": "without prompt, chosen and rejected of one form", "empty_completion":
           "with an empty completion", "prompt_too_long": f"whose prompt alone fills --max-len {pref['max_len']}",
           "refused_by_template": "refused by the chat template"}
    left = [f"{n:,} {why[k]}" for k, n in pref["skipped"].items() if n]
    left += [f"{pref['truncated']:,} sequences truncated to --max-len {pref['max_len']}"] if pref["truncated"] else []
    forms = ", ".join(f"{n:,} {k}" for k, n in pref["forms"].items() if n)
    print(f"prepared {plural(tr['pairs'] + va['pairs'], 'preference pair')} ({forms}) of "
          f"{plural(pref['rows'], 'row')} into {out}: train {plural(tr['pairs'], 'pair')} / "
          f"{plural(tr['tokens'], 'token')} ({tr['targets']:,} completion tokens), val {plural(va['pairs'], 'pair')} "
          f"/ {plural(va['tokens'], 'token')}; {'; '.join(left) if left else 'no row skipped'} "
          f"({meta['seconds']:.1f} s)")
    if va["pairs"] == 0 and meta["val_fraction"] > 0:
        print(f"zerodp: note: no pair fell in val.bin (--val-fraction {meta['val_fraction']}, "
              f"{plural(tr['pairs'], 'pair')}); raise it for validation pairs, or train with train.eval_every=0",
              file=sys.stderr)
    return 0


def _chat_summary(meta: dict, out: str) -> int:
    tr, va, chat = meta["splits"]["train"], meta["splits"]["val"], meta["chat"]
    skipped = chat["skipped"]
    why = {"not_a_conversation": "not a conversation", "refused_by_template": "refused by the chat template",
           "too_long": f"longer than --max-len {chat['max_len']}"}
    left = [f"{n:,} {why[k]}" for k, n in skipped.items() if n]
    left += [f"{chat['truncated']:,} truncated to --max-len {chat['max_len']}"] if chat["truncated"] else []
    print(f"prepared {plural(meta['documents'], 'conversation')} of {plural(chat['rows'], 'row')} into {out}: "
          f"train {plural(tr['documents'], 'conversation')} / {plural(tr['tokens'], 'token')} "
          f"({tr['targets']:,} targets), val {plural(va['documents'], 'conversation')} / "
          f"{plural(va['tokens'], 'token')} ({va['targets']:,} targets); train on {chat['train_on']}; "
          f"{'; '.join(left) if left else 'no row skipped'} ({meta['seconds']:.1f} s)")
    if chat.get("val_from_train"):
        print(f"zerodp: note: --val-fraction {meta['val_fraction']} put none of the "
              f"{plural(meta['documents'], 'conversation')} in val.bin, so the last one went there for validation "
              f"(--val-fraction 0: no validation split)", file=sys.stderr)
    if chat["max_len"] and 0 < va["tokens"] < chat["max_len"] + 1:  # --max-len is block_size + 1 in the recipe
        print(f"zerodp: note: val.bin holds {plural(va['tokens'], 'token')}, fewer than --max-len + 1 = "
              f"{chat['max_len'] + 1:,}: a run at model.block_size {chat['max_len'] - 1:,} cannot validate on it (a "
              f"sample is block_size + 1 tokens, and validation needs a split of block_size + 2 at least); raise "
              f"--val-fraction, or train with train.eval_every=0", file=sys.stderr)
    return 0
