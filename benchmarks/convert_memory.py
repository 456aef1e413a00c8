"""Does `zerodp convert` stream when the source is a DeepSpeed ZeRO checkpoint or a DCP folder?

Writes, with plain programs on 2 gloo processes (no zerodp code but `skip_unused_ops`, which keeps DeepSpeed
from building its inference-only shm op on the CPU), a model much larger than the output shard size: (a) a
DeepSpeed ZeRO-2 checkpoint (`deepspeed.initialize`, fp32, AdamW, 2 steps) and
(b) a torch.distributed.checkpoint folder (`fully_shard` + `get_state_dict` + `dcp.save`, model and
optimizer). Then runs `zerodp convert` on each, to safetensors shards and to a zerodp checkpoint, in a
child process that records its peak RSS growth after its imports (as tests/distributed/test_convert_memory.py
does: reset VmHWM through /proc/self/clear_refs once torch and zerodp are loaded, read it at the end).
The parent also samples the child's RssAnon (heap) and RssFile (mapped file pages) every ~2 ms, so a
peak made of memory-mapped checkpoint pages can be told from one made of materialised tensors.

    python benchmarks/convert_memory.py                          # ~59M params (~225 MiB fp32), 10MB shards
    python benchmarks/convert_memory.py --params 60e6 --shard 10MB --width 2048 --keep

The model is a stack of nn.Linear(width, width): the largest tensor is width*width fp32. The bound
printed is the docs' claim, largest output shard (--shard) + largest tensor; `ok` allows 16 MiB of
allocator slack on top, as the test does. Each conversion runs --repeats times with glibc's default
malloc (its peak varies run to run by whole tensors: freed tensors can stay on the heap) and once with
MALLOC_MMAP_THRESHOLD_ fixed at 1 MiB (deterministic: what the reader and writer really hold).
Checkpoints and outputs are deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
SLACK_MIB = 16
# A fixed mmap threshold stops glibc raising it to the size of the tensors freed, which otherwise keeps
# freed 16 MiB tensors on the heap and varies the peak run to run by multiples of a tensor.
FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=60e6, help="approximate parameter count (fp32)")
    p.add_argument("--width", type=int, default=2048, help="Linear width: the largest tensor is width^2 fp32")
    p.add_argument("--shard", default="10MB", help="--max-shard-size for the safetensors target")
    p.add_argument("--sources", default="deepspeed,dcp", help="comma list of deepspeed, dcp")
    p.add_argument("--targets", default="safetensors,zerodp", help="comma list of safetensors, zerodp")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a new temp folder)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each conversion with glibc's default malloc")
    p.add_argument("--keep", action="store_true", help="keep checkpoints and outputs")
    p.add_argument("--write", choices=("deepspeed", "dcp"), help=argparse.SUPPRESS)  # internal: one writer rank
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the writers: plain DeepSpeed / plain FSDP2, one process per rank -------------------------------

def build_model(params: float, width: int):
    import torch
    from torch import nn

    n_layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)])


def _batch(width: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + int(os.environ["RANK"]))
    return torch.randn(4, width, generator=g)


def write_deepspeed(out: str, params: float, width: int, steps: int = 2) -> None:
    import deepspeed
    import torch

    from zerodp.strategies.deepspeed_ops import skip_unused_ops

    skip_unused_ops()  # DeepSpeed's inference-only shm op: not built on the CPU (the checkpoint is the same)
    torch.distributed.init_process_group("gloo")
    model = build_model(params, width)
    cfg = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e7, "allgather_bucket_size": 2e7},
        "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(steps):
        loss = engine(_batch(width, step)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def write_dcp(out: str, params: float, width: int, steps: int = 2) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group("gloo")
    model = build_model(params, width)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        model(_batch(width, step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def launch_writer(kind: str, out: str, args, nproc: int = 2, timeout: float = 600) -> float:
    """Re-run this script as `nproc` writer ranks (as torchrun would set them up); seconds taken."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_dir = os.path.dirname(out)
    t0 = time.time()
    procs, logs = [], []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=ROOT, DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS="1")
        log = open(os.path.join(log_dir, f"write-{kind}-rank{rank}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "--write", kind, "--out", out,
               "--params", str(args.params), "--width", str(args.width)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            text = open(os.path.join(log_dir, f"write-{kind}-rank{rank}.log")).read()
            sys.exit(f"{kind} writer rank {rank} exited with {p.returncode}:\n{text[-4000:]}")
    return time.time() - t0


# ---- the measurement: one `zerodp convert` per child process -------------------------------------

CHILD = """
import os, sys, torch, safetensors, tqdm, torch.distributed.checkpoint
from zerodp.cli.commands import main
def status(*keys):
    got = {l.split(None, 1)[0]: int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(keys)}
    return [got[k + ":"] for k in keys]
before = status("VmRSS", "RssAnon", "RssFile")
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
open(os.environ["CONVBENCH_MARK"], "w").close()  # tells the parent to start sampling
rc = main(sys.argv[1:])
print("RSS", *before, *status("VmHWM"))
sys.exit(rc)
"""


def _status(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {line.split(None, 1)[0][:-1]: int(line.split()[1]) for line in f
                    if line.startswith(("RssAnon", "RssFile"))}
    except (OSError, ValueError, IndexError):
        return None


def measure(argv: list[str], work: str, extra_env: dict | None = None) -> dict:
    """Peak RSS growth of a child running `zerodp ARGV`, after its imports: VmHWM, which the child resets
    once imported, and the peaks of RssAnon and RssFile sampled from here every ~2 ms (a thread in the
    child to sample them would itself raise its RSS by 50-100 MiB, so the sampling stays outside)."""
    mark = os.path.join(work, "child-ready")
    if os.path.exists(mark):
        os.remove(mark)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CONVBENCH_MARK=mark,
               **(extra_env or {}))
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-c", CHILD, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    peak = {"RssAnon": 0, "RssFile": 0}
    while p.poll() is None:
        if os.path.exists(mark):
            s = _status(p.pid)
            if s:
                for k in peak:
                    peak[k] = max(peak[k], s.get(k, 0))
        time.sleep(0.002)
    out, err = p.communicate()
    secs = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"zerodp {' '.join(argv)} failed ({p.returncode}):\n{err[-4000:]}")
    rss, anon0, file0, hwm = (int(x) / 1024 for x in out.split("RSS ")[-1].split())
    return {"growth": hwm - rss, "anon": peak["RssAnon"] / 1024 - anon0, "file": peak["RssFile"] / 1024 - file0,
            "secs": secs}


def source_stats(path: str) -> dict:
    sys.path.insert(0, ROOT)
    from zerodp.convert import open_checkpoint
    from zerodp.convert.source import MOMENTS

    with open_checkpoint(path) as src:
        names = src.param_names()
        infos = {n: src.info(n) for n in names}
        params = sum(i.nbytes for i in infos.values())
        moments = sum(4 * infos[n].numel for n in names for k in MOMENTS if src.has(n, k))
        largest = max(i.nbytes for i in infos.values())
        fmt = src.format
    disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return {"format": fmt, "params": params, "moments": moments, "largest": largest, "disk": disk,
            "n": len(names)}


def output_stats(dst: str) -> tuple[int, int]:
    files = [os.path.join(dst, f) for f in os.listdir(dst) if f.endswith(".safetensors")]
    return len(files), max(os.path.getsize(f) for f in files)


def main() -> None:
    args = parse_args()
    if args.write:
        (write_deepspeed if args.write == "deepspeed" else write_dcp)(args.out, args.params, args.width)
        return
    sys.path.insert(0, ROOT)
    from zerodp.convert import parse_size

    t_start = time.time()
    shard = parse_size(args.shard)
    made_workdir = args.workdir is None
    work = tempfile.mkdtemp(prefix="convbench-") if made_workdir else os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    sources = [s for s in args.sources.split(",") if s]
    targets = [t for t in args.targets.split(",") if t]
    rows, commands, notes = [], [], []
    try:
        for kind in sources:
            src = os.path.join(work, f"src-{kind}")
            shutil.rmtree(src, ignore_errors=True)
            secs = launch_writer(kind, src, args)
            st = source_stats(src)
            notes.append(f"{kind}: {st['n']} tensors, {st['params'] / MiB:.0f} MiB weights + {st['moments'] / MiB:.0f} "
                         f"MiB Adam moments, {st['disk'] / MiB:.0f} MiB on disk; written in {secs:.0f}s")
            for target in targets:
                dst = os.path.join(work, f"out-{kind}-{target}")
                shutil.rmtree(dst, ignore_errors=True)
                argv = ["convert", src, dst, "--to", target, "--no-progress"]
                if target == "safetensors":
                    argv[5:5] = ["--max-shard-size", args.shard]  # zerodp refuses it for --to zerodp
                commands.append("zerodp " + " ".join(argv))
                total = st["params"] + (st["moments"] if target == "zerodp" else 0)
                bound = (shard + st["largest"]) / MiB
                for malloc, extra, reps in (("default", {}, args.repeats), ("thr=1MiB", FIXED_MALLOC, 1)):
                    runs = []
                    for _ in range(reps):
                        shutil.rmtree(dst, ignore_errors=True)
                        runs.append(measure(argv, work, extra))
                    n_files, biggest = output_stats(dst)
                    worst = max(runs, key=lambda m: m["growth"])
                    growth = sorted(round(m["growth"]) for m in runs)
                    rows.append([kind, target, f"{total / MiB:.0f}", f"{st['largest'] / MiB:.1f}",
                                 f"{shard / 1e6:g}MB" if target == "safetensors" else "-", n_files,
                                 f"{biggest / MiB:.0f}", malloc,
                                 "/".join(map(str, growth)), f"{worst['anon']:.0f}", f"{worst['file']:.0f}",
                                 f"{bound:.0f}", "yes" if worst["growth"] < bound + SLACK_MIB else "NO",
                                 "yes" if worst["anon"] < bound + SLACK_MIB else "NO",
                                 f"{sum(m['secs'] for m in runs) / len(runs):.0f}"])
                if not args.keep:
                    shutil.rmtree(dst, ignore_errors=True)
            if not args.keep:
                shutil.rmtree(src, ignore_errors=True)
    finally:
        if not args.keep:
            if made_workdir:
                shutil.rmtree(work, ignore_errors=True)
            else:
                for d in os.listdir(work):
                    if d.startswith(("src-", "out-")):
                        shutil.rmtree(os.path.join(work, d), ignore_errors=True)

    print(f"\ncommand: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"model: {round(args.params / (args.width ** 2 + args.width))} x nn.Linear({args.width}, {args.width}), "
          f"fp32; written by 2 gloo processes")
    for n in notes:
        print(n)
    print("\n".join(["conversions:"] + [f"  {c}" for c in commands]))
    hdr = ["source", "target", "converted", "largest", "shard", "files", "max file", "malloc", "peak RSS+",
           "anon+", "file+", "bound", "ok", "anon ok", "secs"]
    print(f"\nsizes in MiB. peak RSS+ = VmHWM growth after imports, each run (ascending); anon+ / file+ = sampled "
          f"peak growth of RssAnon / RssFile in the worst run; bound = shard + largest tensor; ok = worst peak "
          f"RSS+ < bound + {SLACK_MIB} MiB slack (as tests/distributed/test_convert_memory.py); "
          f"anon ok = the same for anon+. "
          f"malloc thr=1MiB: MALLOC_MMAP_THRESHOLD_=1048576 (freed tensors go back to the OS at once).")
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    for r in [hdr] + rows:
        print("  ".join(str(x).ljust(w) if i < 2 or i == 7 else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(r, widths))))
    print(f"\ntotal {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
