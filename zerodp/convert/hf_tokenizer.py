"""What a `zerodp convert` output carries beside its weights: the tokenizer files the source carries
(`tokenizer_files`: a Hugging Face folder's, an export's, a converted checkpoint's) or the run's recorded
tokenizer; and for --to hf, so that transformers loads it as a chat model, the run's tokenizer.json, its
tokenizer_config.json with the chat template the run's data was rendered with (`zerodp prepare --chat`;
zerodp.data.chat.chat_record), and a generation_config.json whose eos_token_id is the template's
end-of-turn token, so that `apply_chat_template(add_generation_prompt=True)` then `generate` stops at the
end of the answer. No torch."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from zerodp.convert.destination import TOKENIZER_FILES

GENERATION_CONFIG = TOKENIZER_FILES[2]


def with_chat_files(found: dict[str, bytes], meta: dict, hf_config: dict) -> dict[str, bytes]:
    """`found` (recorded_tokenizer's files) with, for a checkpoint whose metadata `meta` records chat data
    (its "tokenizer" record's "chat"), the chat template in tokenizer_config.json and generation_config.json;
    `hf_config`: the config.json being written (its bos id). As it is otherwise."""
    found = dict(found)
    chat = (meta.get("tokenizer") or {}).get("chat")
    if not found or not chat:
        return found
    config = {}
    if TOKENIZER_FILES[1] in found:
        try:
            config = json.loads(found[TOKENIZER_FILES[1]])
        except ValueError:
            config = {}
    config = config if isinstance(config, dict) else {}
    config["chat_template"] = chat["template"]  # the one the data was rendered with
    # Without a class transformers picks the model type's (LlamaTokenizerFast adds a BOS of its own): the
    # tokenizer.json as it is encodes as zerodp prepare encoded.
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for name, token in (chat.get("specials") or {}).items():  # what the template renders as bos_token etc.
        config.setdefault(name, token)
    if chat.get("end_of_turn"):
        config.setdefault("eos_token", chat["end_of_turn"])
    found[TOKENIZER_FILES[1]] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
    if chat.get("end_of_turn_id") is not None:
        generation = {"eos_token_id": int(chat["end_of_turn_id"]),
                      **({"bos_token_id": hf_config["bos_token_id"]} if hf_config.get("bos_token_id") is not None
                         else {})}
        found[GENERATION_CONFIG] = (json.dumps(generation, indent=2) + "\n").encode()
    return found


def recorded_tokenizer(meta: dict) -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer the checkpoint records (meta "tokenizer": {path, sha256},
    written by training on a `zerodp prepare` folder): its tokenizer.json, and the tokenizer_config.json
    beside it if there is one. A tokenizer gone or changed since training is said on stderr and left out:
    the weights are still exported."""
    rec = meta.get("tokenizer") or {}
    if not rec.get("path"):
        return {}
    path = Path(rec["path"])
    if not path.is_file():
        print(f"zerodp: tokenizer {path} (recorded by the checkpoint) not found; the export has no tokenizer.json",
              file=sys.stderr)
        return {}
    data = path.read_bytes()
    if rec.get("sha256") and hashlib.sha256(data).hexdigest() != rec["sha256"]:
        print(f"zerodp: tokenizer {path} changed since training (sha256 differs); the export has no tokenizer.json",
              file=sys.stderr)
        return {}
    found = {TOKENIZER_FILES[0]: data}
    config = path.parent / TOKENIZER_FILES[1]
    if config.is_file():
        found[TOKENIZER_FILES[1]] = config.read_bytes()
    return found


def tokenizer_files(source) -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer an open checkpoint comes with: the files it carries in its own
    folder (`carried_tokenizer`), else the one its metadata records (`recorded_tokenizer`). What every
    conversion writes beside the weights, so that no conversion drops the tokenizer or chat template."""
    return carried_tokenizer(source) or recorded_tokenizer(source.meta)


def carried_tokenizer(source) -> dict[str, bytes]:
    """The tokenizer files (TOKENIZER_FILES) in the checkpoint's own folder: a zerodp checkpoint's that its
    manifest lists (checked with it), an export's whose sha256 its metadata records (one changed since is
    said on stderr and left out), or those of a Hugging Face model folder (a config.json beside the weights)."""
    path = Path(source.path)
    if source.format == "zerodp":
        listed = source.meta.get("files") or {}
        return {n: (path / n).read_bytes() for n in TOKENIZER_FILES if n in listed and (path / n).is_file()}
    if source.format != "safetensors":
        return {}
    folder = path.parent
    recorded = json.loads((source.meta.get("metadata") or {}).get("zerodp.tokenizer_files") or "{}")
    found = {}
    for name in TOKENIZER_FILES:
        f = folder / name
        if not f.is_file() or not (name in recorded or (not recorded and "hf_config" in source.meta)):
            continue
        data = f.read_bytes()
        if name in recorded and hashlib.sha256(data).hexdigest() != recorded[name]:
            print(f"zerodp: {f} changed since it was exported (sha256 differs); the output has no {name}",
                  file=sys.stderr)
            continue
        found[name] = data
    return found
