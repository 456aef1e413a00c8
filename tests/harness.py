"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

    results = run_distributed("tests.workers:train_and_report", world_size=2, kwargs={...})

Each rank is a fresh `python` process with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set the
way torchrun or the deepspeed launcher sets them; the process group is initialised by zerodp's own
`init_distributed` before the function runs. The function's return value (tensors, numbers, lists,
dicts) is saved per rank and loaded back with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(world_size: int, port: int | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), WORLD_SIZE=str(world_size),
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
        ZERODP_CACHE=env.get("ZERODP_CACHE", str(Path(tempfile.gettempdir()) / "zerodp-test-cache")),
    )
    return env


# Failures of the loopback rendezvous itself (a port taken between choosing and binding it), not of
# the code under test: such a launch is retried once on another port.
_RENDEZVOUS_FLAKES = ("Address already in use", "EADDRINUSE", "connectFullMesh")


def run_distributed(target: str, world_size: int, kwargs: dict | None = None, timeout: float = 600,
                    allow_missing: bool = False) -> list:
    """Run `target` ("module:function") on `world_size` processes; return each rank's result.

    With allow_missing, a rank that exited without a result (a test that kills it) gives None."""
    try:
        return _run_once(target, world_size, kwargs, timeout, allow_missing)
    except RuntimeError as e:
        if not any(flake in str(e) for flake in _RENDEZVOUS_FLAKES):
            raise
        return _run_once(target, world_size, kwargs, timeout, allow_missing)


def _run_once(target: str, world_size: int, kwargs: dict | None, timeout: float, allow_missing: bool) -> list:
    env = base_env(world_size)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world_size):
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            cmd = [sys.executable, "-m", "tests.harness", target, json.dumps(kwargs or {}), tmp]
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

    from zerodp.dist import init_distributed, shutdown

    target, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    env = init_distributed("cpu")
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
