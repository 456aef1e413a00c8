"""What the fine-tuning tests build locally (no download): a small BPE tokenizer with ChatML's special
tokens and a ChatML template in its tokenizer_config.json, a tiny Hugging Face Llama folder beside it
(the `model.init_from` of configs/sft-llama.yaml), and conversations whose answer is a fixed function of
the question."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.support.text_fixtures import EOT, train_bpe

SPECIAL = (EOT, "<|im_start|>", "<|im_end|>")
END_OF_TURN = "<|im_end|>"
CHATML = ("{% for message in messages %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "star", "rain"]


def reverse_rows(n: int, seed: int = 0) -> list[dict]:
    """n conversations: the user gives 3 to 5 words, the assistant answers them in reverse order."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(3, 5))
        rows.append({"prompt": "reverse: " + " ".join(words), "response": " ".join(reversed(words))})
    return rows


def llama_folder(folder: Path, seed: int = 0) -> Path:
    """A Hugging Face Llama folder: tokenizer.json (a byte-level BPE of 400 ids with ChatML's special
    tokens), tokenizer_config.json with the ChatML template, and a 2-layer Llama of width 32 (GQA, untied
    head) saved by transformers with max_position_embeddings 64."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_bpe(folder / "tokenizer.json", vocab_size=400, n_files=10, special=SPECIAL)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": END_OF_TURN}))
    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
