"""The worker process the checks launch (zerodp.trainer.loop.train, observed), its launch, and what the
checks share: the Setup (GPUs or a CPU stand-in, the world, the temporary folder) and the run shapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "benchmarks" / "gpu_checks.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

COMMON = ["data.max_bytes=1000000", "data.prefetch=0", "train.eval_every=0", "train.progress=false",
          "train.deterministic=true", "optim.warmup_steps=2", "checkpoint.keep_last=2"]
# GPT-2 124M's shape: its states (2 GB at 16 bytes a parameter) and activations dwarf the allocator's noise.
GPT2 = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.vocab_size=50304",
        "model.block_size=1024", "train.micro_batch_size=4", "train.global_batch_size=4", "train.sample_tokens=0"]
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64", "model.vocab_size=256",
        "train.micro_batch_size=2", "train.max_steps=8", "train.precision=fp32",
        "train.sample_tokens=0", "optim.lr=1e-3", "optim.min_lr=1e-4", "checkpoint.every=2"]
LLAMA = ["model.arch=llama", "model.n_head=4", "model.n_kv_head=2", "model.intermediate_size=128"]
SYNC_MARK = "synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.cpp's warn_or_error_on_sync


@dataclass
class Setup:
    """Where the checks run: `gpus` CUDA devices, or (device cpu) 2 CPU processes standing in for them."""

    gpus: int
    tmp: Path
    device: str = "cuda"
    cache: dict = field(default_factory=dict)
    """Runs several groups compare with (the single-process references), by name."""

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def world(self) -> int:
        """Every visible GPU (2 CPU processes in the CPU mode)."""
        return 2 if self.cpu else self.gpus

    def tiny(self, world: int | None = None) -> list[str]:
        """TINY with a global batch of one micro batch of 2 per rank at `world` (default: self.world)."""
        return [*COMMON, *TINY, f"train.global_batch_size={2 * (world or self.world)}",
                f"train.device={self.device}"]

    def env(self) -> dict:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if self.cpu:
            env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
        return env


def run_spec(overrides: list[str], out: Path, steps: int, fresh: bool = True, **extra) -> dict:
    return {"overrides": [*overrides, f"train.out_dir={out}", f"train.max_steps={steps}"], "fresh": fresh, **extra}


def launch(setup: Setup, runs: list[dict], world: int, timeout: float = 300, env: dict | None = None) -> list[dict]:
    """The worker on `world` ranks (torchrun when world > 1), with `env` added to its environment; per run
    its results (or {'error': ...} for a run that raised), or RuntimeError with the log's last lines when
    the worker did not finish."""
    import torch

    stamp = time.monotonic_ns()
    spec, out = setup.tmp / f"spec{stamp}.json", setup.tmp / f"out{stamp}.pt"
    spec.write_text(json.dumps({"runs": runs}))
    me = [str(ENTRY), "--worker", str(spec), str(out)]
    cmd = [sys.executable, *me] if world == 1 else [TORCHRUN, "--standalone", f"--nproc-per-node={world}", *me]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env={**setup.env(), **(env or {})}, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result within {timeout:.0f} s") from None
    if r.returncode != 0 or not out.exists():
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"exit {r.returncode}: " + " | ".join(tail))
    return torch.load(out, weights_only=True)


class SyncCounter:
    """Host syncs by optimizer step: with torch.cuda.set_sync_debug_mode('warn') every synchronizing CUDA
    operation warns (TORCH_WARN, each time, not once); each warning is counted against the step in
    progress (numbered by zerodp.trainer.loop.train_step, as tests/distributed/test_loop.py does), with
    the first place (file:line) each step synced at."""

    def __init__(self, cuda: bool):
        self.cuda, self.step = cuda, 0
        self.counts: dict[int, int] = {}
        self.where: dict[int, str] = {}

    def __enter__(self):
        import zerodp.trainer.loop as zt

        self._real_step, self._real_show = zt.train_step, warnings.showwarning
        self._filters = warnings.filters[:]
        warnings.filterwarnings("always", message=f".*{SYNC_MARK}")

        def numbered_step(*args, **kwargs):
            self.step += 1
            if self.step == 1 and self.cuda:
                import torch

                torch.cuda.set_sync_debug_mode("warn")  # from the first step: start-up syncs are not counted
            return self._real_step(*args, **kwargs)

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_MARK in str(message) and self.step:
                self.counts[self.step] = self.counts.get(self.step, 0) + 1
                self.where.setdefault(self.step, f"{Path(filename).name}:{lineno}")
                return
            self._real_show(message, category, filename, lineno, file, line)

        zt.train_step, warnings.showwarning = numbered_step, show
        return self

    def __exit__(self, *exc):
        import zerodp.trainer.loop as zt

        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("default")
        zt.train_step, warnings.showwarning = self._real_step, self._real_show
        warnings.filters[:] = self._filters


def worker(spec_path: str, out_path: str) -> None:
    """Run each of spec's runs with zerodp.trainer.loop.train in one process group; rank 0 writes per run the
    losses, metrics.jsonl's records, (weights), (host syncs by step), the run's summary figures, the
    seconds each checkpoint save held the loop, by step, and on CUDA the allocator's peaks: after
    strategy.setup, before the end-of-run sample (training and the final save), and over the sample.
    A run that raises is recorded as {'error': its last line} and the next one runs. Each run's folder is
    deleted when the run ends (its checkpoints are GBs at the 1B shape), unless the run says `keep`."""
    import torch

    import zerodp.trainer.loop as zt
    from zerodp.config import load_config
    from zerodp.distributed.process_group import shutdown

    spec = json.loads(Path(spec_path).read_text())
    cuda = torch.cuda.is_available()
    peak = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    peaks: dict = {}
    real_make, real_sample = zt.make_strategy, zt.sample

    def make_strategy(name):
        strategy = real_make(name)
        real_setup = strategy.setup

        def setup(*args, **kwargs):
            real_setup(*args, **kwargs)
            peaks["setup"] = peak()

        strategy.setup = setup
        return strategy

    def sample(*args, **kwargs):
        peaks["train"] = peak()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        text = real_sample(*args, **kwargs)
        peaks["sample"] = peak()
        return text

    from zerodp.checkpoint.checkpointer import Checkpointer

    saves: dict = {}
    real_save = Checkpointer.save

    def timed_save(self, step, trainer_state):
        t0 = time.perf_counter()
        try:
            return real_save(self, step, trainer_state)
        finally:
            saves[step] = time.perf_counter() - t0

    Checkpointer.save = timed_save
    zt.make_strategy, zt.sample = make_strategy, sample
    results = []
    for run in spec["runs"]:
        peaks.clear()
        saves.clear()
        if cuda:  # what an earlier run of this process left allocated is counted apart (`before`)
            import gc

            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        cfg = load_config(str(ROOT / "configs/tiny.yaml"), run["overrides"])
        counter = SyncCounter(cuda)
        try:
            if run.get("count_syncs"):
                with counter:
                    s = zt.train(cfg, fresh=run["fresh"])
            else:
                s = zt.train(cfg, fresh=run["fresh"], return_weights=run.get("weights", False))
        except Exception as e:  # the next run still runs; the check reports this one's error
            results.append({"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or ['?'])[-1][:200]}"})
            _remove(cfg.train.out_dir, run, together=False)
            continue
        peaks.setdefault("train", peak())
        metrics = Path(cfg.train.out_dir) / "metrics.jsonl"
        results.append({"losses": [s["losses"][k] for k in sorted(s["losses"])], "peaks": dict(peaks),
                        "weights": {n: t.cpu() for n, t in s.get("weights", {}).items()},
                        "records": [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists()
                        else [], "syncs": counter.counts, "sync_where": counter.where, "run": s.get("run", {}),
                        "saves": dict(saves), "allocated_before": before,
                        "checkpoint_bytes": _bytes(Path(cfg.train.out_dir) / "checkpoints"),
                        **device_props(cuda)})
        _remove(cfg.train.out_dir, run)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        torch.save(results, out_path)
    shutdown()


def _bytes(folder: Path) -> int:
    """The bytes of the files under `folder` (0 when there is none)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def _remove(out_dir: str, run: dict, together: bool = True) -> None:
    """The run's folder, once every rank is done with it (`together`: a barrier first; not after a run
    that failed, perhaps on one rank only), rank 0 deleting, unless the run says `keep`."""
    import torch.distributed as dist

    if run.get("keep"):
        return
    if together and dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(out_dir, ignore_errors=True)


def device_props(cuda: bool) -> dict:
    import torch

    if not cuda:
        return {"device_memory": 0, "device_name": "cpu"}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device_memory": props.total_memory, "device_name": props.name}


def failed(run: dict) -> str | None:
    """A run's error line, or None when it ran."""
    return run.get("error")
