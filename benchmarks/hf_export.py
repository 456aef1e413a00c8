"""Export a ~1B-parameter llama to Hugging Face: seconds and peak memory of the whole `zerodp convert`.

The model is described, not built: its parameter names and shapes come from zerodp's model on the
meta device, and a zerodp checkpoint (fp32 weights, the canonical layout, meta.json with the model
config) is written tensor by tensor with random values, so writing it never holds more than one tensor
either. Then the user's command runs as a child process, timed from outside, its peak RSS read from
the kernel (`/usr/bin/time`-style, via os.wait4):

    zerodp convert CKPT OUT --to hf --dtype bf16 --max-shard-size 2GB

and, for scale, the time to copy the checkpoint's bytes (`cp`) and to read them once (`cat > /dev/null`).

    python benchmarks/hf_export.py                                # Llama-3.2-1B's shape, 1.24B params
    python benchmarks/hf_export.py --layers 4 --keep --workdir /data/scratch
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16, help="Llama-3.2-1B: 16")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--untied", action="store_true", help="a separate output head (Llama-3.2-1B ties it)")
    p.add_argument("--to", default="hf", help="convert target: hf (default), safetensors or zerodp")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--shard", default="2GB")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true")
    return p.parse_args(argv)


def write_checkpoint(args, ckpt: Path) -> int:
    """A zerodp checkpoint of random fp32 weights, written one tensor at a time; returns the params."""
    import torch

    from zerodp.config import load_config
    from zerodp.convert.source import CheckpointSource, TensorInfo
    from zerodp.convert.writers import write_zerodp
    from zerodp.models import build_model

    cfg = load_config(None, [
        "model.arch=llama", f"model.n_layer={args.layers}", f"model.n_embd={args.width}",
        f"model.n_head={args.heads}", f"model.n_kv_head={args.kv_heads}", f"model.intermediate_size={args.ffn}",
        f"model.vocab_size={args.vocab}", "model.block_size=2048", "model.rope_theta=500000.0",
        f"model.tie_embeddings={'false' if args.untied else 'true'}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    class RandomWeights(CheckpointSource):
        format = "random"
        path = ckpt.with_name("random-weights")  # nothing on disk
        meta = {"config": cfg.to_dict(), "tied": model.tied_weights(), "step": 0}

        def param_names(self):
            return list(shapes)

        def info(self, name):
            return TensorInfo(shapes[name], torch.float32)

        def get(self, name, kind="param"):
            return torch.randn(shapes[name]) * 0.02

        def files(self):
            return []  # nothing on disk is read

    write_zerodp(RandomWeights(), ckpt, progress=False)
    return sum(int(torch.Size(s).numel()) for s in shapes.values())


def run(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a child process, measured by the kernel."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zerodp-hf-export-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, out, copy = work / "ckpt", work / "out", work / "copy"
    try:
        t0 = time.perf_counter()
        params = write_checkpoint(args, ckpt)
        size = sum(p.stat().st_size for p in ckpt.iterdir())
        print(f"checkpoint: {params / 1e9:.2f}B parameters, {size / 1e9:.2f} GB fp32 on disk, "
              f"written in {time.perf_counter() - t0:.1f}s ({ckpt})")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "zerodp", "convert", str(ckpt), str(out), "--to", args.to,
               "--max-shard-size", args.shard, "--no-progress"]
        if args.dtype:
            cmd += ["--dtype", args.dtype]
        subprocess.run(["sync"])
        seconds, rss = run(cmd, env)
        written = sum(p.stat().st_size for p in out.iterdir())
        files = sorted(p.name for p in out.iterdir())
        print(f"zerodp convert --to {args.to} --dtype {args.dtype} --max-shard-size {args.shard}: {seconds:.1f}s, "
              f"peak RSS {rss / 2**20:.0f} MiB, wrote {written / 1e9:.2f} GB in {len(files)} files "
              f"({written / 1e6 / seconds:.0f} MB/s of output)")
        copy_s, _ = run(["cp", "-r", str(ckpt), str(copy)])
        read_s, _ = run(["sh", "-c", f"cat {ckpt}/* > /dev/null"])
        print(f"for scale: cp -r of the checkpoint {copy_s:.1f}s, reading it once (page cache) {read_s:.1f}s")
        if (out / "config.json").is_file():
            print("config.json:", json.dumps(json.loads((out / "config.json").read_text()), sort_keys=True)[:400])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
