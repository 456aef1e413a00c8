"""`zerodp prepare`'s tokenizer: a Hugging Face tokenizer.json (a file, or a model folder holding one),
its end-of-text separator, and what meta.json records about it. No torch."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerodp.errors import UserError

# Tried in this order when neither --eot nor a tokenizer_config.json beside the tokenizer names one.
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|end|>")


@dataclass
class Tok:
    """A loaded tokenizer and what meta.json records about it."""
    tokenizer: object  # tokenizers.Tokenizer
    path: Path  # the tokenizer.json file
    sha256: str
    vocab_size: int  # largest id + 1, added tokens included
    eot_id: int | None
    eot_token: str | None

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)


def load_tokenizer(given: str, eot: str | None = None) -> Tok:
    """The tokenizer at `given` (a tokenizer.json or a folder holding one) and its separator: `eot`, or
    the folder's tokenizer_config.json eos_token, or the first of EOT_CANDIDATES it knows."""
    from tokenizers import Tokenizer

    p = Path(given)
    if not p.exists():
        raise UserError(f"tokenizer {given} not found; give a tokenizer.json file or a Hugging Face model folder "
                        f"holding one")
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise UserError(f"{p} holds no tokenizer.json; a folder with only vocab.json/merges.txt or tokenizer.model "
                        f"needs one: transformers' AutoTokenizer.from_pretrained(folder).save_pretrained(folder) "
                        f"writes it")
    data = file.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception for JSON and schema errors alike
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{file} is not a tokenizer the tokenizers library can read ({why}); give the "
                        f"tokenizer.json of a Hugging Face tokenizer") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        raise UserError(f"{file} has an empty vocabulary; give a trained tokenizer")
    eot_token = _eot_token(tok, file, eot)
    return Tok(tok, file, hashlib.sha256(data).hexdigest(), max(vocab.values()) + 1,
               None if eot_token is None else tok.token_to_id(eot_token), eot_token)


def _eot_token(tok, file: Path, eot: str | None) -> str | None:
    if eot == "none":
        return None
    if eot is not None:
        if tok.token_to_id(eot) is None:
            raise UserError(f"--eot {eot!r} is not a token of {file}; name one of its tokens, or --eot none for "
                            f"no separator")
        return eot
    config = file.with_name("tokenizer_config.json")
    if config.is_file():
        try:
            named = json.loads(config.read_text()).get("eos_token")
        except (ValueError, AttributeError):
            named = None
        named = named.get("content") if isinstance(named, dict) else named
        if isinstance(named, str) and tok.token_to_id(named) is not None:
            return named
    found = next((t for t in EOT_CANDIDATES if tok.token_to_id(t) is not None), None)
    if found is None:
        raise UserError(f"{file} has no end-of-text token (none of {', '.join(EOT_CANDIDATES)}); name the "
                        f"separator with --eot TOKEN, or --eot none for no separator")
    return found

