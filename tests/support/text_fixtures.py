"""Test data without downloads: a small BPE tokenizer trained on the Python standard library's sources
(the built-in corpus) and JSONL / Parquet / text-folder inputs written from the same sources."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

EOT = "<|endoftext|>"


def stdlib_files(n: int, max_bytes: int = 40_000) -> list[Path]:
    """n standard-library sources of at most max_bytes each, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(root.glob("*.py")) if 0 < f.stat().st_size <= max_bytes]
    return files[:n]


def stdlib_texts(n: int, max_bytes: int = 40_000) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files(n, max_bytes)]


def train_bpe(path: Path, vocab_size: int = 512, n_files: int = 40, special=(EOT,)) -> Path:
    """Train a byte-level BPE tokenizer on n_files stdlib sources and save it as tokenizer.json at path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_texts(n_files), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def write_jsonl(path: Path, texts: list[str], field: str = "text", **extra) -> Path:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, field: t, **extra}) + "\n")
    return path


def write_parquet(path: Path, texts: list[str], column: str = "text", row_group_size: int = 7) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(texts))), column: texts})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_text_folder(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (folder / f"doc{i:03d}.txt").write_text(t, encoding="utf-8")
    return folder
