"""The sampler at scale: a synthetic prepared folder of --gb GB of uint16 tokens (documents of random length,
their index beside), then the time and memory to open it, build an epoch's permutation and find the
global batch of step 1 and of step 10^6 (a resume), and to read that batch's rows with document ids.

    python benchmarks/data_index.py              # 0.2 GB: seconds
    python benchmarks/data_index.py --gb 10      # 10 GB (needs the disk): target under 30 s and 1 GB RSS

Prints one line per figure; no assertion (docs/data.md gives the numbers measured).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHUNK = 1 << 24  # tokens written at a time


def rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_parts() -> str:
    """Resident memory now, in its two kinds (Linux /proc/self/status): anonymous (what the process
    allocated: the permutation, the batch) and file-backed (token-file pages mapped in while reading rows,
    page cache the kernel reclaims under pressure)."""
    kinds = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            kinds[key] = int(value.split()[0]) / 1024
    return f"anonymous {kinds.get('RssAnon', 0):,.0f} MiB, file-backed {kinds.get('RssFile', 0):,.0f} MiB"


def write_folder(folder: Path, gb: float, mean_doc: int, seed: int = 0) -> tuple[int, int]:
    """train.bin of gb * 1e9 bytes, train.idx of documents of mean length `mean_doc`, a small val split,
    meta.json; returns (tokens, documents)."""
    folder.mkdir(parents=True, exist_ok=True)
    n, rng, docs = int(gb * 1e9) // 2, np.random.default_rng(seed), 0
    with open(folder / "train.bin", "wb") as bin_, open(folder / "train.idx", "wb") as idx:
        at = 0
        while at < n:
            size = min(CHUNK, n - at)
            ((np.arange(at, at + size, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(50_000)).astype(
                np.uint16).tofile(bin_)
            lengths = rng.integers(1, 2 * mean_doc, size=size // mean_doc * 2 + 16)
            starts = at + np.concatenate([[0], np.cumsum(lengths)])
            starts = starts[starts < at + size]
            starts.astype(np.int64).tofile(idx)
            docs += len(starts)
            at += size
    (np.arange(100_000) % 50_000).astype(np.uint16).tofile(folder / "val.bin")
    np.arange(0, 100_000, 1000, dtype=np.int64).tofile(folder / "val.idx")
    index = {"dtype": "int64", "of": "each document's first token"}
    meta = {"format": "zerodp-prepare", "format_version": 2, "vocab_size": 50_000, "dtype": "uint16",
            "tokenizer": {"path": None, "sha256": None}, "eot_id": None, "documents": docs + 100,
            "splits": {"train": {"file": "train.bin", "documents": docs, "tokens": n,
                                 "index": {"file": "train.idx", **index}},
                       "val": {"file": "val.bin", "documents": 100, "tokens": 100_000,
                               "index": {"file": "val.idx", **index}}}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return n, docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=0.2, help="size of train.bin in GB (default 0.2)")
    p.add_argument("--block", type=int, default=1024, help="model.block_size (default 1024)")
    p.add_argument("--batch", type=int, default=512, help="train.global_batch_size (default 512)")
    p.add_argument("--mean-doc", type=int, default=1000, help="mean document length in tokens (default 1000)")
    p.add_argument("--dir", default=None, help="where to write the folder (default a temporary one, removed)")
    p.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)  # the child that writes the folder
    args = p.parse_args()
    if args.write_only:
        tokens, docs = write_folder(Path(args.dir) / "data", args.gb, args.mean_doc)
        print(json.dumps([tokens, docs]))
        return
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="zerodp-data-index-"))
    try:
        t0 = time.perf_counter()  # written by a child process: its memory is not this one's peak
        import subprocess

        child = subprocess.run([sys.executable, __file__, "--write-only", "--gb", str(args.gb), "--mean-doc",
                                str(args.mean_doc), "--dir", str(root)], capture_output=True, text=True, check=True)
        tokens, docs = json.loads(child.stdout)
        print(f"wrote {args.gb:g} GB: {tokens:,} tokens, {docs:,} documents in {time.perf_counter() - t0:.1f} s "
              f"(setup, not the sampler's time)")
        from zerodp.config import load_config
        from zerodp.data.batches import TokenBatches, load_tokens

        before = rss_mib()

        cfg = load_config(None, [f"data.source={root / 'data'}", f"model.block_size={args.block}",
                                 f"train.global_batch_size={args.batch}", f"train.micro_batch_size={args.batch}",
                                 "model.vocab_size=50000"])
        t0 = time.perf_counter()
        data = TokenBatches(load_tokens(cfg), cfg, "train", document_masking=True)
        data.locate(0, args.batch)  # builds epoch 0's permutation
        built = time.perf_counter() - t0
        print(f"build: open, index and epoch 0's permutation of {data.samples_per_epoch()[0]:,} samples: {built:.2f} s")
        for step in (1, 10**6):
            t0 = time.perf_counter()
            data.locate(step, args.batch)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            data.locate(step + 1, args.batch)
            after = time.perf_counter() - t0
            t0 = time.perf_counter()
            batch = data.rows(data.offsets(step, args.batch))
            read = time.perf_counter() - t0
            epoch = step * args.batch // data.samples_per_epoch()[0]
            print(f"step {step:,} (epoch {epoch:,}): find its batch {first * 1e3:.2f} ms (its epoch's permutation "
                  f"included), the next step's {after * 1e3:.3f} ms; read its {args.batch} rows with doc_ids "
                  f"{read * 1e3:.1f} ms {tuple(batch[2].shape)}")
        resumed = TokenBatches(load_tokens(cfg), cfg, "train", document_masking=True)
        t0 = time.perf_counter()
        resumed.locate(10**6, args.batch)
        print(f"resume at step 1,000,000 in a new process's sampler: {(time.perf_counter() - t0) * 1e3:.1f} ms")
        print(f"peak RSS {rss_mib():,.0f} MiB ({before:,.0f} MiB before the sampler: Python, numpy, torch); now "
              f"{rss_parts()}")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
