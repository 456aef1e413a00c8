"""How fast does `zerodp convert` run, against copying the same bytes and against torch's own DCP tool?

Builds, with `zerodp train` on 2 CPU processes (one step, a checkpoint at the end), checkpoints of one
~300M-parameter GPT (20 layers, width 1024, vocabulary 50304: 1.21 GB of fp32 weights) under zero1,
zero2, zero3 (DeepSpeed files) and fsdp (a DCP folder), then from the fsdp one a zerodp canonical
checkpoint (`--to zerodp`) and a Hugging Face folder (`--to hf`). Each source is converted to
safetensors shards (`--max-shard-size 500MB`) and to `--to hf`, each as the whole command a user runs,
timed from outside with the child's peak RSS and CPU time (os.wait4). Beside each: `cp -r` of the source folder on
the same disk (page cache warm for both), alone and followed by `sync` (convert fsyncs its output before
publishing it), and for the DCP folder torch's
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save`.

    python benchmarks/convert_speed.py                       # builds in a temp folder (~4 GB x 6), deletes it
    python benchmarks/convert_speed.py --workdir /tmp/cs --keep
    python benchmarks/convert_speed.py --workdir /tmp/cs --zerodp-root /path/to/older/checkout   # before/after
    python benchmarks/convert_speed.py --tiny                # seconds: the same steps on a 2-layer model

Figures vary with what else runs on the machine; run it on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.n_layer=20", "model.n_embd=1024", "model.n_head=16", "model.vocab_size=50304", "model.block_size=128"]
TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.vocab_size=512", "model.block_size=32"]
STRATEGIES = ("zero1", "zero2", "zero3", "fsdp")


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path = ROOT) -> tuple[float, float, float]:
    """(seconds, peak RSS MB, CPU seconds) via os.wait4 on the child (its own high-water mark and
    user + system time: on a shared machine the CPU time moves less than the wall-clock time)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    _, status, usage = os.wait4(p.pid, 0)
    seconds = time.perf_counter() - t0
    err = p.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{err[-2000:]}")
    return seconds, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def build(work: Path, model: list[str]) -> dict[str, Path]:
    """{source name: path}; reuses what an earlier --keep run left in `work`."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    sources = {}
    for s in STRATEGIES:
        out = work / s
        if not (out / "checkpoints" / "latest").is_file():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29613",
                   "-m", "zerodp", "train", "configs/tiny.yaml", *model, f"strategy.name={s}", "train.max_steps=1",
                   "checkpoint.every=1", "train.global_batch_size=2", "train.micro_batch_size=1",
                   "train.sample_tokens=0", "train.eval_every=0", "train.progress=false", f"train.out_dir={out}"]
            seconds, _, _ = run_measured(cmd, env)
            print(f"built {s} checkpoint in {seconds:.0f}s", file=sys.stderr)
        step = (out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip())
        sources[s if s != "fsdp" else "fsdp (DCP)"] = step
    for name, to in (("zerodp canonical", "zerodp"), ("HF safetensors", "hf")):
        dst = work / to
        if not dst.exists():
            run_measured([sys.executable, "-m", "zerodp", "convert", str(sources["fsdp (DCP)"]), str(dst), "--to", to,
                          "--no-progress"], env)
        sources[name] = dst
    return sources


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def copy_seconds(src: Path, work: Path) -> tuple[float, float]:
    """(cp -r, cp -r then sync) of `src` on the same disk, page cache warm: `zerodp convert` fsyncs its
    output before it renames it into place, plain cp does not."""
    dst = work / "cp-copy"
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)  # warms the page cache as a conversion would
    shutil.rmtree(dst)
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    seconds = time.perf_counter() - t0
    os.sync()
    synced = time.perf_counter() - t0
    shutil.rmtree(dst)
    return seconds, synced


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="where checkpoints are built (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints (reused by a later run)")
    p.add_argument("--zerodp-root", default=str(ROOT), help="the checkout whose zerodp converts (before/after)")
    p.add_argument("--max-memory", default=None, help="passed to zerodp convert --max-memory")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model: checks the script in seconds")
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sources = build(work, TINY if args.tiny else MODEL)
        zerodp_root = Path(args.zerodp_root).resolve()  # run there: `python -m` puts the cwd first on sys.path
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(zerodp_root))
        extra = ["--max-memory", args.max_memory] if args.max_memory else []
        rows = []
        for name, src in sources.items():
            cp, cp_sync = copy_seconds(src, work)
            size = folder_bytes(src)
            for to in ("safetensors", "hf"):
                dst = work / f"out-{to}"
                shutil.rmtree(dst, ignore_errors=True)
                cmd = [sys.executable, "-m", "zerodp", "convert", str(src), str(dst), "--to", to,
                       "--max-shard-size", "500MB", "--no-progress", *extra]
                seconds, rss, cpu = run_measured(cmd, env, zerodp_root)
                written = folder_bytes(dst)
                shutil.rmtree(dst)
                rows.append((name, to, seconds, cpu, written / 1e6 / seconds, rss, size / 1e9, cp, cp_sync))
            if name == "fsdp (DCP)":
                dcp_dir = next(d.parent for d in src.rglob(".metadata"))
                out = work / "dcp_to_torch_save.pt"
                code = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                        "dcp_to_torch_save(sys.argv[1], sys.argv[2])")
                seconds, rss, cpu = run_measured([sys.executable, "-c", code, str(dcp_dir), str(out)], env,
                                                 zerodp_root)
                written = out.stat().st_size
                out.unlink()
                rows.append((name, "torch dcp_to_torch_save", seconds, cpu, written / 1e6 / seconds, rss, size / 1e9,
                             cp, cp_sync))
        print(f"\nzerodp from {args.zerodp_root}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
        print("| source | to | seconds | CPU s | MB/s written | peak RSS MB | source GB | cp -r s | cp -r + sync s | "
              "vs cp | vs cp+sync |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, to, seconds, cpu, rate, rss, gb, cp, cp_sync in rows:
            print(f"| {name} | {to} | {seconds:.1f} | {cpu:.1f} | {rate:.0f} | {rss:.0f} | {gb:.2f} | {cp:.1f} | "
                  f"{cp_sync:.1f} | {seconds / cp:.1f}x | {seconds / cp_sync:.1f}x |")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
