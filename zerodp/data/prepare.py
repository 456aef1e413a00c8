"""`zerodp prepare`: documents (text, JSONL, Parquet) -> DIR/train.bin, DIR/val.bin, their .idx, DIR/meta.json.

    zerodp prepare corpus/ more.jsonl.gz shard-0.parquet --tokenizer path/to/hf_model --out data/mine

What it promises:
- train.bin and val.bin are nanoGPT's layout (what zerodp.data.batches reads from a .bin): a flat array of
  token ids, uint16 when every id of the tokenizer fits (vocabulary <= 65536), else uint32. Each
  document is the tokenizer's own encoding of its text (`Tokenizer.encode(text).ids`, the
  post-processor's special tokens included unless `special_tokens=False`) followed by the separator
  (the tokenizer's end-of-text token unless `eot` names another, or none), in input order: inputs as
  given, a folder's files sorted by path, a JSONL file's lines, a Parquet file's rows.
- Beside each, train.idx and val.idx: the document index, the int64 offset of each document's first
  token in its .bin (raw, little-endian; meta.json's splits.<split>.index says file and dtype): what
  document masking and `zerodp data batch` read (zerodp.data.samples).
- Document i (counted over all inputs) goes to val iff `val_mask(seed, i)`: a hash of (seed, i) below
  val_fraction. A document longer than the val split needs (more UTF-8 bytes than val_fraction of the
  input files' bytes: one text file, say) is split by tokens instead: its last val_fraction of tokens go
  to val, the rest to train, each part followed by the separator. Both rules are the same however the
  work is batched.
- Bounded memory: a reader thread parses about `batch_bytes` of text at a time, an encoder thread
  encodes the batch before with `encode_batch_fast` (Rust, every core, without the GIL) and the
  calling thread appends the one before that to the two files. At most QUEUE_DEPTH + 4 batches exist
  at once; a single document larger than a batch is held whole.
- Nothing partial: the output is written into a hidden sibling folder that becomes DIR only when
  complete (zerodp.checkpoint.safe_output). A non-empty DIR is replaced only with `overwrite` and only if it is
  an earlier prepare (meta.json says so); a bad input anywhere leaves DIR as it was.
No torch import: a prepare on a CPU box loads only tokenizers, numpy and (for Parquet) pyarrow.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Iterator

import numpy as np

from zerodp import __version__
from zerodp.checkpoint.safe_output import check_output, staged
from zerodp.config.sources import FORMAT, META, prepared_meta  # noqa: F401  (the folder's format: the config reads it too)
from zerodp.data.sources import Source, _documents, find_sources, sources_meta
from zerodp.data.tokenizer import Tok, load_tokenizer
from zerodp.errors import UserError

FORMAT_VERSION, SPLITS = 2, ("train", "val")
# Text per encode_batch call: ~100 web documents, enough to keep the cores busy, while the library's
# Encoding objects for it (~200 bytes a token, ~4 bytes of text a token: ~50x the text) stay small.
BATCH_BYTES = 1 << 18
QUEUE_DEPTH = 2  # batches parsed ahead of the encoder
ALIVE = 2  # batches of Encoding objects at once: one being encoded, one being read into numpy


@dataclass
class PrepareOptions:
    inputs: list[str]
    """Text files, folders of them (one document per file; also .jsonl/.parquet files inside), JSONL
    files (one document per line, optionally .gz/.zst), Parquet files, or 'builtin' (the Python
    standard library's *.py files, zerodp.data.batches's built-in corpus)."""
    tokenizer: str
    """A tokenizer.json file, or a folder holding one (a Hugging Face model folder)."""
    out: str
    """Output folder: train.bin, val.bin, meta.json."""
    field: str = "text"
    """The JSONL field / Parquet column holding each document's text."""
    val_fraction: float = 0.01
    """Share of the input for val.bin, in [0, 1): of the documents (chosen by hash), and of the tokens of
    each document longer than that share of the input bytes."""
    seed: int = 0
    """Chooses which documents go to val.bin."""
    eot: str | None = None
    """The separator appended to every document: a token of the tokenizer; None: its end-of-text token;
    'none': no separator."""
    special_tokens: bool = True
    """Let the tokenizer's post-processor add its special tokens (a BOS, say), as `encode` does."""
    overwrite: bool = False
    """Replace `out` if it holds an earlier prepare."""
    progress: bool = True
    """A progress bar on stderr (on a terminal only) with MB/s and tokens."""
    batch_bytes: int = BATCH_BYTES
    """Text per encode_batch call; memory, never the output, depends on it."""
    chat: bool = False
    """Rows are conversations rendered by the chat template, with a loss mask (zerodp.data.prepare_chat)."""
    chat_template: str | None = None
    """A Jinja file (or a tokenizer_config.json) in place of the tokenizer's own chat template."""
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    train_on: str = "assistant"
    """The mask's targets: 'assistant' (every assistant turn), 'last' (the last one), 'all' (every token)."""
    max_len: int | None = None
    """A conversation of more tokens is dropped or truncated (too_long); None: no limit."""
    too_long: str = "drop"
    preference: bool = False
    """Rows are preference pairs (prompt, chosen, rejected) for DPO (zerodp.data.prepare_preference)."""


@dataclass
class _Batch:
    texts: list[str]
    read: int  # bytes of input files behind these documents
    long: list[int]  # the documents (indices into texts) split by tokens


def _batches(sources: list[Source], column: str, batch_bytes: int, long_bytes: float) -> Iterator[_Batch]:
    texts, chars, read, long = [], 0, 0, []
    for src in sources:
        for text, n in _documents(src, column):
            if _longer(text, long_bytes):
                long.append(len(texts))
            texts.append(text)
            chars += len(text)
            read += n
            src.documents += 1
            if chars >= batch_bytes:
                yield _Batch(texts, read, long)
                texts, chars, read, long = [], 0, 0, []
        if src.given and src.documents == 0:
            raise UserError(f"{src.path} holds no documents; give files that hold documents")
    if texts:
        yield _Batch(texts, read, long)


def _longer(text: str, limit: float) -> bool:
    """Whether `text` is more than `limit` bytes of UTF-8; encoded only when its length cannot tell (a
    character is 1 to 4 bytes)."""
    if len(text) > limit or 4 * len(text) <= limit:
        return len(text) > limit
    return len(text.encode("utf-8", errors="surrogatepass")) > limit


def _ahead(items: Iterator, depth: int) -> Iterator:
    """`items`, produced by a background thread up to `depth` ahead; its exceptions raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop, end = threading.Event(), object()

    def put(item) -> bool:  # False once the consumer has left
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in chain(items, [end]):
                if not put(item):
                    return
        except BaseException as e:  # handed to the consumer: a dead stage must not hang it
            put(e)
        finally:
            if hasattr(items, "close"):  # a stage feeding this one stops too
                items.close()

    thread = threading.Thread(target=work, daemon=True, name="zerodp-prepare-stage")
    thread.start()
    try:
        while (item := q.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=30)


def val_mask(seed: int, first: int, n: int, val_fraction: float) -> np.ndarray:
    """Whether documents first..first+n-1 go to val: splitmix64 of (seed, index) as u in [0, 1), below
    val_fraction. A pure function of (seed, index): batching and worker count cannot change it."""
    golden = 0x9E3779B97F4A7C15
    base = np.uint64((seed * golden) % (1 << 64))
    x = base + (np.arange(first, first + n, dtype=np.uint64) + np.uint64(1)) * np.uint64(golden)  # wraps mod 2^64
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < val_fraction


def _split_long(ids: list[list[int]], in_val: np.ndarray, long: list[int],
                val_fraction: float) -> tuple[list[list[int]], np.ndarray, int]:
    """The documents `long` names split by tokens: each becomes its first tokens (train) and its last
    round(val_fraction * tokens) (val); one too short for both parts goes whole where that rounding puts
    it. Returns (ids, in_val) of the parts, the other documents as they were, and the documents split."""
    if not long:
        return ids, in_val, 0
    parts, where, split, long = [], [], 0, set(long)
    for i, (doc, v) in enumerate(zip(ids, in_val.tolist())):
        if i in long:
            n_val = round(val_fraction * len(doc))
            if 0 < n_val < len(doc):
                parts += [doc[:-n_val], doc[-n_val:]]
                where += [False, True]
                split += 1
                continue
            v = n_val > 0
        parts.append(doc)
        where.append(v)
    return parts, np.array(where, dtype=bool), split


def _not_replaceable(folder: Path) -> str | None:
    try:
        if json.loads((folder / META).read_text()).get("format") == FORMAT:
            return None
    except (OSError, ValueError, AttributeError):
        pass
    names = sorted(p.name for p in folder.iterdir())
    return f"holds {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}, which zerodp prepare did not write"


def command_line(opts: PrepareOptions) -> str:
    """The command that makes this output again (what meta.json records)."""
    import shlex

    args = ["zerodp", "prepare", *opts.inputs, "--tokenizer", opts.tokenizer, "--out", opts.out,
            "--field", opts.field, "--val-fraction", repr(opts.val_fraction), "--seed", str(opts.seed)]
    args += ["--eot", opts.eot] if opts.eot is not None else []
    args += [] if opts.special_tokens else ["--no-special-tokens"]
    return shlex.join(args)


def prepare(opts: PrepareOptions) -> dict:
    """Tokenize `opts.inputs` into `opts.out` (see the module docstring); return the meta.json written.
    Every check that needs no encoding (tokenizer, inputs, Parquet columns, output folder) comes first."""
    if opts.preference:
        from zerodp.data.prepare_preference import prepare_preference

        return prepare_preference(opts, _not_replaceable)
    if opts.chat:
        from zerodp.data.prepare_chat import prepare_chat

        return prepare_chat(opts, _not_replaceable)
    if not 0.0 <= opts.val_fraction < 1.0:
        raise UserError(f"--val-fraction {opts.val_fraction} must be in [0, 1); 0 writes an empty val.bin")
    if opts.batch_bytes < 1:
        raise UserError(f"--batch-size must be positive, got {opts.batch_bytes} bytes")
    tok = load_tokenizer(opts.tokenizer, opts.eot)
    sources = find_sources(opts.inputs, opts.field)
    given = [Path(i) for i in opts.inputs if i != "builtin"]  # folders too: DIR must not lie inside one
    check_output(opts.out, [tok.path, *given, *(s.path for s in sources)], opts.overwrite, "zerodp prepare",
                 _not_replaceable)
    t0 = time.time()
    with staged(opts.out) as tmp:
        counts, documents, split = _encode_all(tok, sources, opts, tmp)
        if counts["train"]["documents"] == 0:
            raise UserError(f"all of the input ({plural(documents, 'document')}) fell in the val split "
                            f"(--val-fraction {opts.val_fraction}); lower it or give more documents")
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "zerodp_version": __version__,
            "tokenizer": {"path": str(tok.path.resolve()), "sha256": tok.sha256},
            "vocab_size": tok.vocab_size, "dtype": tok.dtype.name,
            "eot_id": tok.eot_id, "eot_token": tok.eot_token, "special_tokens": opts.special_tokens,
            "field": opts.field, "val_fraction": opts.val_fraction, "seed": opts.seed,
            "splits": {s: {"file": f"{s}.bin", **counts[s],
                           "index": {"file": f"{s}.idx", "dtype": "int64", "of": "each document's first token"}}
                       for s in SPLITS},
            "documents": documents, "split_by_tokens": split,
            "tokens": sum(counts[s]["tokens"] for s in SPLITS),
            **sources_meta(sources),
            "seconds": round(time.time() - t0, 3),
            "command": command_line(opts),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _encode_all(tok: Tok, sources: list[Source], opts: PrepareOptions, out: Path) -> tuple[dict, int, int]:
    """Encode and write both files; return per split {documents, tokens} (a document split by tokens counts
    in both), the documents read and how many of them were split by tokens."""
    from tqdm import tqdm

    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)  # the same ids, no offsets
    counts = {s: {"documents": 0, "tokens": 0} for s in SPLITS}
    first, split = 0, 0  # index of the batch's first document over all inputs; documents split by tokens
    # A document with more bytes than the val split's share of the input would alone overshoot it in val
    # or leave val short in train: split by tokens. Bytes on disk: compressed input makes more such.
    long_bytes = opts.val_fraction * sum(s.size for s in sources) if opts.val_fraction > 0 else float("inf")
    # Three stages, each in its own thread: parse (reader), encode (Rust, every core, the GIL released),
    # and here ids -> numpy -> files, which holds the GIL and so overlaps the next batch's encoding.
    # The library's Encoding objects take ~200 bytes a token (~50x the text): at most two batches of
    # them exist at once, the one being encoded and the one whose ids are being taken here.
    alive = threading.Semaphore(ALIVE)

    def encode_stage(batches):
        for b in batches:
            alive.acquire()
            yield b, encode(b.texts, add_special_tokens=opts.special_tokens)

    batches = _batches(sources, opts.field, opts.batch_bytes, long_bytes)
    encoded = _ahead(encode_stage(_ahead(batches, QUEUE_DEPTH)), 1)
    bar = tqdm(total=sum(s.size for s in sources), unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
               disable=None if opts.progress else True, leave=False, dynamic_ncols=True)
    with open(out / "train.bin", "wb") as train, open(out / "val.bin", "wb") as val, \
            open(out / "train.idx", "wb") as train_idx, open(out / "val.idx", "wb") as val_idx, bar:
        indexes = {"train": train_idx, "val": val_idx}
        try:
            for batch, encodings in encoded:
                ids = [e.ids for e in encodings]
                del encodings
                alive.release()
                n = len(ids)
                ids, in_val, cut = _split_long(ids, val_mask(opts.seed, first, n, opts.val_fraction), batch.long,
                                               opts.val_fraction)
                in_val, lengths = _write(tok, ids, in_val, train, val)
                first, split = first + n, split + cut
                for name, mask in (("train", ~in_val), ("val", in_val)):
                    if mask.any():  # the document index: each document's first token in the split's file
                        np.cumsum(np.concatenate([[counts[name]["tokens"]], lengths[mask][:-1]]),
                                  dtype=np.int64).tofile(indexes[name])
                    counts[name]["documents"] += int(mask.sum())
                    counts[name]["tokens"] += int(lengths[mask].sum())
                bar.update(batch.read)
                bar.set_postfix_str(f"{first:,} docs, {counts['train']['tokens'] + counts['val']['tokens']:,} "
                                    f"tokens", refresh=False)
        finally:
            for _ in range(ALIVE):  # an encoder waiting for a slot wakes, finds the consumer gone and leaves
                alive.release()
    if first == 0:
        raise UserError(f"the inputs hold no documents ({', '.join(opts.inputs)}); give files with text")
    return counts, first, split


def plural(n: int, noun: str) -> str:
    """'1 document', '2,000 documents'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def size_text(n: float) -> str:
    """Bytes in decimal units, as input sizes and rates are said: '812 bytes', '4.7 kB', '1,234.5 MB'."""
    if n < 1000:
        return plural(round(n), "byte")
    return f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:,.1f} MB"


def _write(tok: Tok, ids: list[list[int]], in_val: np.ndarray, train, val) -> tuple[np.ndarray, np.ndarray]:
    """Append each document's ids and the separator to train or val; return (in_val, tokens per document)."""
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.concatenate([np.array(x, dtype=tok.dtype) for x in ids]) if ids else np.zeros(0, tok.dtype)
    if tok.eot_id is not None:  # after each document: before index cumsum(lengths) of flat
        flat = np.insert(flat, np.cumsum(lengths), tok.dtype.type(tok.eot_id))
        lengths += 1
    per_token = np.repeat(in_val, lengths)
    flat[~per_token].tofile(train)
    flat[per_token].tofile(val)
    return in_val, lengths
