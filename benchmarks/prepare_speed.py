"""How fast is `zerodp prepare` next to the tokenizers library alone, and does its memory stay flat?

Builds, in a temporary folder and from nothing but the Python standard library's own sources (no
download), a JSONL corpus of --mb megabytes (every stdlib .py file up to --max-doc-kb one document,
repeated until the size is reached) and trains a byte-level BPE tokenizer of --vocab tokens on its
first --train-mb.
Then times, each as a whole command from outside (wall time, and peak RSS from os.wait4 of the child):

  prepare       python -m zerodp prepare corpus.jsonl --tokenizer tok.json --out OUT --no-progress
  encode_batch  a plain script: read the same JSONL line by line, json.loads, and call the library's
                Tokenizer.encode_batch on batches of prepare's size (zerodp.data.prepare.BATCH_BYTES); no output
  fast          the same with encode_batch_fast (the same ids without offsets, what prepare calls)

Runs alternate (prepare, encode_batch, fast) --repeats times and the best wall time of each counts: on
a shared machine the slowest runs measure the neighbours; CPU seconds are printed too. Prints MB/s of
each, prepare's ratio to encode_batch (target >= 0.9) and prepare's peak RSS against the input size.
Then the corpus grows to --rss-mb and prepare runs once more (target: input >= 10x peak RSS, and the
same peak as on the small corpus: memory does not grow with the input).

    python benchmarks/prepare_speed.py                                 # 200 MB, then 1.5 GB; vocab 8192
    python benchmarks/prepare_speed.py --mb 50 --repeats 1 --rss-mb 0  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MB = 1_000_000

BASELINE = r"""
import json, sys
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
encode = tok.encode_batch_fast if sys.argv[3] == "fast" else tok.encode_batch
batch, chars = [], 0
with open(sys.argv[2], "rb") as f:
    for line in f:
        text = json.loads(line)["text"]
        batch.append(text)
        chars += len(text)
        if chars >= int(sys.argv[4]):
            encode(batch)
            batch, chars = [], 0
if batch:
    encode(batch)
"""


def build_corpus(path: Path, mb: float, max_doc_kb: float) -> int:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [json.dumps({"text": f.read_text(encoding="utf-8", errors="replace")}) + "\n"
            for f in sorted(stdlib.rglob("*.py"))
            if "site-packages" not in f.parts and 0 < f.stat().st_size <= max_doc_kb * 1000]
    size = 0
    with open(path, "w", encoding="utf-8") as out:
        while size < mb * MB:
            for d in docs:
                out.write(d)
                size += len(d.encode())
                if size >= mb * MB:
                    break
    return path.stat().st_size


def train_tokenizer(corpus: Path, path: Path, vocab: int, train_mb: float) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        n = 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                n += len(line)
                yield json.loads(line)["text"]
                if n >= train_mb * MB:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    tok.save(str(path))


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (bytes) of `cmd` run as a child."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed: {p.stderr.read().decode()}")
    p.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024  # ru_maxrss: KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200, help="corpus size in MB (default 200)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--train-mb", type=float, default=4, help="MB of the corpus the tokenizer is trained on")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-doc-kb", type=float, default=100,
                    help="leave out stdlib files larger than this (default 100 KB, web-document sizes): the "
                         "peak RSS grows with the largest document, which the tokenizer encodes whole")
    ap.add_argument("--rss-mb", type=float, default=1500,
                    help="then grow the corpus to this size and run prepare alone once more: its peak RSS against "
                         "the first run's shows whether memory grows with the input (0: skip)")
    ap.add_argument("--dir", default=None, help="work folder (default: a new temporary one, deleted at the end)")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="zerodp-prepare-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpus, tok, out = work / "corpus.jsonl", work / "tokenizer.json", work / "out"
        build_corpus(corpus, args.mb, args.max_doc_kb)
        size = corpus.stat().st_size
        if not tok.exists():
            t0 = time.time()
            train_tokenizer(corpus, tok, args.vocab, args.train_mb)
            print(f"tokenizer: BPE, vocab {args.vocab}, trained on {args.train_mb:g} MB in {time.time() - t0:.0f}s")
        script = work / "baseline.py"
        script.write_text(BASELINE)
        py = sys.executable
        from zerodp.data.prepare import BATCH_BYTES

        cmds = {
            "prepare": [py, "-m", "zerodp", "prepare", str(corpus), "--tokenizer", str(tok), "--out", str(out),
                        "--no-progress", "--overwrite"],
            "encode_batch": [py, str(script), str(tok), str(corpus), "plain", str(BATCH_BYTES)],
            "fast": [py, str(script), str(tok), str(corpus), "fast", str(BATCH_BYTES)],
        }
        best, peak = {k: float("inf") for k in cmds}, {k: 0 for k in cmds}
        print(f"corpus: {size / MB:,.1f} MB of JSONL ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}); "
              f"{args.repeats} rounds")
        for r in range(args.repeats):
            for name, cmd in cmds.items():
                wall, cpu, rss = timed(cmd)
                print(f"  round {r + 1} {name:13s} {wall:7.1f}s  {size / MB / wall:6.2f} MB/s  CPU {cpu:6.1f}s  "
                      f"peak RSS {rss / MB:6.0f} MB", flush=True)
                best[name], peak[name] = min(best[name], wall), max(peak[name], rss)
        meta = json.loads((out / "meta.json").read_text())
        mbs = {k: size / MB / w for k, w in best.items()}
        rss = peak["prepare"]
        print(f"\nzerodp prepare {mbs['prepare']:.2f} MB/s, tokenizers encode_batch {mbs['encode_batch']:.2f} MB/s, "
              f"encode_batch_fast {mbs['fast']:.2f} MB/s")
        print(f"ratio prepare / encode_batch = {mbs['prepare'] / mbs['encode_batch']:.2f} (target >= 0.9); "
              f"prepare / encode_batch_fast = {mbs['prepare'] / mbs['fast']:.2f}")
        print(f"prepare peak RSS {rss / MB:.0f} MB for {size / MB:,.0f} MB of input: input = "
              f"{size / rss:.1f} x peak RSS (target >= 10); {meta['tokens']:,} tokens, {meta['documents']:,} documents")
        if args.rss_mb > size / MB:
            build_corpus(corpus, args.rss_mb, args.max_doc_kb)
            big = corpus.stat().st_size
            wall, cpu, big_rss = timed(cmds["prepare"])
            meta = json.loads((out / "meta.json").read_text())
            print(f"prepare on {big / MB:,.0f} MB: {wall:.0f}s ({big / MB / wall:.2f} MB/s), peak RSS "
                  f"{big_rss / MB:.0f} MB: input = {big / big_rss:.1f} x peak RSS (target >= 10); "
                  f"{meta['tokens']:,} tokens")
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
