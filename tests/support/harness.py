"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

    results = run_distributed("tests.support.workers:train_and_report", world_size=2, kwargs={...})
    results = run_distributed(..., device="cuda")      # a GPU test (@pytest.mark.gpu(n)): one GPU a rank

The tests run on the CPU on any machine, a GPU machine included: `pin_cpu` (called by tests/conftest.py for
the pytest process, and by `base_env` for every process a test starts) hides CUDA, so train.device=auto,
DeepSpeed and the planner all see a machine without GPUs. The GPU tests hand the machine's own
CUDA_VISIBLE_DEVICES back to the processes they start (`gpu_env`).

Each rank is a fresh `python` process with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set the
way torchrun or the deepspeed launcher sets them; the process group is initialised by zerodp's own
`init_distributed` before the function runs. The function's return value (tensors, numbers, lists,
dicts) is saved per rank and loaded back with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The machine's CUDA_VISIBLE_DEVICES from before pin_cpu hid the GPUs ("all" when it was unset).
MACHINE_GPUS = "ZERODP_TEST_MACHINE_CUDA_VISIBLE_DEVICES"


def pin_cpu(environ: MutableMapping[str, str]) -> None:
    """Make `environ` (a process's, or one to start a process with) a machine without GPUs.

    An empty CUDA_VISIBLE_DEVICES is the one setting that torch.cuda, DeepSpeed's accelerator, the
    planner's device_memory and every launcher all honour; train.device=cpu would reach only configs.
    Call it before CUDA is first used in that process. Idempotent: the machine's own value is kept once."""
    environ.setdefault(MACHINE_GPUS, environ.get("CUDA_VISIBLE_DEVICES", "all"))
    environ["CUDA_VISIBLE_DEVICES"] = ""
    environ["DS_ACCELERATOR"] = "cpu"


def gpu_env(environ: MutableMapping[str, str]) -> dict:
    """A copy of a pinned `environ` that sees the machine's GPUs again, for a GPU test's processes."""
    env = dict(environ)
    machine = env.get(MACHINE_GPUS, env.get("CUDA_VISIBLE_DEVICES", "all"))
    if machine == "all":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = machine
    env.pop("DS_ACCELERATOR", None)  # DeepSpeed detects CUDA itself
    return env


@functools.cache
def machine_gpus() -> int:
    """GPUs the GPU tests may use: zerodp.distributed.devices' count in a process that sees the machine's GPUs
    (this one must not touch CUDA). 0 at once with a CPU build of torch."""
    if torch.version.cuda is None and torch.version.hip is None:
        return 0
    r = subprocess.run([sys.executable, "-m", "zerodp.distributed.devices", "count"], env=gpu_env(os.environ), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    return int(r.stdout) if r.returncode == 0 else 0


def gpu_skip_reason(needed: int) -> str | None:
    """Why a test marked gpu(needed) cannot run here, or None when it can."""
    have = machine_gpus()
    return None if have >= needed else f"needs {needed} GPU(s); this machine offers {have} to the tests"


def base_env(world_size: int, port: int | None = None) -> dict:
    """The environment of a test's process: CPU only (pin_cpu), one rank of a `world_size` loopback world."""
    env = dict(os.environ)
    pin_cpu(env)
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
        ZERODP_CACHE=env.get("ZERODP_CACHE", str(Path(tempfile.gettempdir()) / "zerodp-test-cache")),
    )
    return env


# Failures of the loopback rendezvous itself (a port taken between choosing and binding it), not of
# the code under test: such a launch is retried once on another port.
_RENDEZVOUS_FLAKES = ("Address already in use", "EADDRINUSE", "connectFullMesh")


def run_distributed(target: str, world_size: int, kwargs: dict | None = None, timeout: float = 600,
                    allow_missing: bool = False, device: str = "cpu") -> list:
    """Run `target` ("module:function") on `world_size` processes; return each rank's result.

    device="cuda" (GPU tests only) gives each rank the GPU LOCAL_RANK and an nccl group beside gloo.
    With allow_missing, a rank that exited without a result (a test that kills it) gives None."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    try:
        return _run_once(target, world_size, kwargs, timeout, allow_missing, device)
    except RuntimeError as e:
        if not any(flake in str(e) for flake in _RENDEZVOUS_FLAKES):
            raise
        return _run_once(target, world_size, kwargs, timeout, allow_missing, device)


def _run_once(target: str, world_size: int, kwargs: dict | None, timeout: float, allow_missing: bool,
              device: str) -> list:
    env = base_env(world_size) if device == "cpu" else gpu_env(base_env(world_size))
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world_size):
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            cmd = [sys.executable, "-m", "tests.support.harness", target, json.dumps(kwargs or {}), tmp, device]
            procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            outputs.append(out.decode(errors="replace"))
        for rank, p in enumerate(procs):
            if p.returncode != 0 and not allow_missing:
                raise RuntimeError(f"rank {rank} exited with {p.returncode}:\n{outputs[rank][-6000:]}")
        files = [Path(tmp) / f"rank{r}.pt" for r in range(world_size)]
        if not allow_missing:
            return [torch.load(f, weights_only=True) for f in files]
        return [torch.load(f, weights_only=True) if f.exists() else None for f in files]


def _worker_main() -> None:
    import importlib

    from zerodp.distributed.process_group import init_distributed, shutdown

    target, kwargs, out, device = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    env = init_distributed(device)
    module, fn = target.split(":")
    result = getattr(importlib.import_module(module), fn)(**kwargs)
    torch.save(result, out / f"rank{env.rank}.pt")
    import torch.distributed as dist

    if isinstance(result, dict) and result.get("no_barrier"):
        os._exit(0)  # its peer is gone: no collective can complete
    dist.barrier()
    del result
    shutdown()


if __name__ == "__main__":
    _worker_main()
