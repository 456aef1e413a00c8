"""Streaming: converting a model much larger than the read-ahead window (--max-memory) keeps peak memory
near that window plus the tensor being written (and its cast copy). Peak RSS of the converting process is
the child's own VmHWM, reset after its imports."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.support.harness import ROOT
from zerodp.convert.source import TensorInfo, write_safetensors_file

MB = 1 << 20
WINDOW = 16 * MB  # --max-memory: a tenth of the model


def make_model(path, n_tensors=36, numel=MB, big=2 * MB):
    """~152 MB of fp32: 36 tensors of 4 MB and one of 8 MB, generated one at a time."""
    names = [f"layer.{i}.weight" for i in range(n_tensors)] + ["big.weight"]
    infos = {n: TensorInfo((numel,), torch.float32) for n in names[:-1]}
    infos["big.weight"] = TensorInfo((big,), torch.float32)

    def fetch(n):
        g = torch.Generator().manual_seed(hash(n) % 1000)
        return torch.randn(infos[n].shape, generator=g)

    write_safetensors_file(path, names, infos, fetch, {})
    return sum(i.nbytes for i in infos.values()), max(i.nbytes for i in infos.values())


def peak_rss_mb(*args) -> tuple[float, float]:
    """(RSS after imports, peak RSS during the conversion) of a child running `zerodp convert ARGS`.

    The imports alone peak higher than a small conversion, so the child resets its high-water mark
    (/proc/self/clear_refs) once torch and zerodp are loaded, then reads VmHWM at the end."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    before, peak = p.stdout.split("RSS ")[-1].split()
    return int(before) / 1024, int(peak) / 1024


CHILD = """
import sys, torch, safetensors, tqdm, torch.distributed.checkpoint
import zerodp.convert.cli  # loaded before the baseline, as the readers and writers it uses
from zerodp.cli.commands import main
def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
rc = main(sys.argv[1:])
print("RSS", before, status("VmHWM:"))
sys.exit(rc)
"""


def test_peak_memory_stays_near_the_window_plus_one_tensor(tmp_path):
    src = tmp_path / "big.safetensors"
    total, largest = make_model(src)
    runs = {
        "safetensors -> 10MB shards": ["convert", src, tmp_path / "out", "--max-shard-size", "10MB"],
        "safetensors -> bf16 shards": ["convert", src, tmp_path / "o16", "--max-shard-size", "10MB", "--dtype", "bf16"],
        "safetensors -> zerodp": ["convert", src, tmp_path / "z", "--to", "zerodp"],
        "zerodp -> 10MB shards": ["convert", tmp_path / "z", tmp_path / "back", "--max-shard-size", "10MB"],
    }
    growth = {}
    for what, argv in runs.items():
        before, peak = peak_rss_mb(*argv, "--no-progress", "--max-memory", f"{WINDOW}B")
        growth[what] = peak - before
    n_shards = len(list((tmp_path / "out").glob("model-*.safetensors")))
    print(f"\nmodel {total / MB:.0f} MiB ({largest / MB:.0f} MiB largest tensor), {n_shards} output shards; "
          f"peak RSS growth during conversion: " + ", ".join(f"{k} +{v:.0f} MiB" for k, v in growth.items()))
    assert n_shards >= 15
    bound = (WINDOW + 2 * largest) / MB + 16  # the window + one tensor and its cast copy + allocator slack
    for what, grew in growth.items():
        assert grew < bound, (what, grew, bound)
