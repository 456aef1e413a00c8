"""Run a function on N real processes (gloo on CPU) and collect what each rank returns.

    results = run_distributed("tests.support.workers:train_and_report", world_size=2, kwargs={...})
    results = run_distributed(..., device="cuda")      # a GPU test (@pytest.mark.gpu(n)): one GPU a rank

The tests run on the CPU on any machine, a GPU machine included: `pin_cpu` (called by tests/conftest.py for
the pytest process, and by `base_env` for every process a test starts) hides CUDA, so train.device=auto,
DeepSpeed and the planner all see a machine without GPUs. The GPU tests hand the machine's own
CUDA_VISIBLE_DEVICES back to the processes they start (`gpu_env`).

Each rank is a `python` process with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set the way
torchrun or the deepspeed launcher sets them; the process group is initialised by zerodp's own
`init_distributed` before the function runs. The function's return value (tensors, numbers, lists,
dicts) is saved per rank and loaded back with `torch.load(weights_only=True)`.

Starting a rank costs seconds (python, torch, DeepSpeed, the rendezvous), so the ranks of a CPU world
are kept between calls: a `World` of that size runs one call after another in the same process group,
and puts each process back as it found it in between (environment, working directory, torch's seed and
global flags, signal handlers, logging handlers, warning filters, dynamo's caches). A world that failed
is thrown away; one that has served `World.CALLS` calls is replaced. A call that patches a library or a
zerodp module, measures its own process's memory, or kills or hangs a rank passes `fresh=True`, and
runs on ranks started for it alone (as do GPU calls and `allow_missing` ones).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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
                    allow_missing: bool = False, device: str = "cpu", fresh: bool = False) -> list:
    """Run `target` ("module:function") on `world_size` processes; return each rank's result.

    device="cuda" (GPU tests only) gives each rank the GPU LOCAL_RANK and an nccl group beside gloo.
    With allow_missing, a rank that exited without a result (a test that kills it) gives None.
    fresh=True starts the ranks for this call alone (see the module's docstring for when it must)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cpu" and not allow_missing and not fresh:
        try:
            return World.get(world_size).call(target, kwargs, timeout)
        except _RendezvousFlake:
            return World.get(world_size).call(target, kwargs, timeout)
    try:
        return _run_once(target, world_size, kwargs, timeout, allow_missing, device)
    except RuntimeError as e:
        if not any(flake in str(e) for flake in _RENDEZVOUS_FLAKES):
            raise
        return _run_once(target, world_size, kwargs, timeout, allow_missing, device)


class _RendezvousFlake(RuntimeError):
    pass


def _environ_of(world_size: int) -> dict:
    """What a world's ranks would be started with now, less the port (each world has its own)."""
    env = base_env(world_size, port=1)
    env.pop("MASTER_PORT")
    # Set in this process by others, not by a test: pytest names each test's every phase here, importing
    # DeepSpeed sets PYTORCH_NVML_BASED_CUDA_CHECK=1 (as it does in every rank that imports it), and torch's
    # inductor writes its default cache folder here the first time it looks it up (the folder a rank
    # computes for itself). Compared, each would start every world anew at every test.
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if env.get("TORCHINDUCTOR_CACHE_DIR") == os.path.abspath(default_cache_dir()):
        env.pop("TORCHINDUCTOR_CACHE_DIR")
    return env


class World:
    """`world_size` ranks that run calls one after another in one process group (`--serve`).

    A call is one JSON line on each rank's stdin; each rank answers with `rankR-N.pt` (its result) or
    `rankR-N.err` (its traceback) in the world's folder, and its output goes to `rankR.log` there."""

    CALLS = 16  # calls a world serves before it is replaced (gloo subgroups and heap accumulate)
    _alive: dict[int, World] = {}

    @classmethod
    def get(cls, world_size: int) -> World:
        """The world of this size, started anew if the environment a test set differs from its own."""
        world = cls._alive.get(world_size)
        if (world is None or world.calls >= cls.CALLS or world.environ != _environ_of(world_size)
                or any(p.poll() is not None for p in world.procs)):
            if world is not None:
                world.close()
            world = cls._alive[world_size] = World(world_size)
        return world

    def __init__(self, world_size: int):
        self.world_size, self.calls = world_size, 0
        self.environ = _environ_of(world_size)
        self.dir = Path(tempfile.mkdtemp(prefix="zerodp-test-world-"))
        env = base_env(world_size)
        self.logs = [open(self.dir / f"rank{r}.log", "wb") for r in range(world_size)]
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "tests.support.harness", "--serve", str(self.dir)],
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=self.logs[r], stderr=subprocess.STDOUT)
            for r in range(world_size)]

    def _output(self, rank: int, since: int) -> str:
        data = (self.dir / f"rank{rank}.log").read_bytes()[since:]
        return data.decode(errors="replace")[-6000:]

    def call(self, target: str, kwargs: dict | None, timeout: float) -> list:
        n, self.calls = self.calls, self.calls + 1
        since = [(self.dir / f"rank{r}.log").stat().st_size for r in range(self.world_size)]
        line = (json.dumps({"n": n, "target": target, "kwargs": kwargs or {}}) + "\n").encode()
        try:
            for p in self.procs:
                p.stdin.write(line)
                p.stdin.flush()
        except BrokenPipeError:
            pass  # a rank is gone: reported below
        results = [self.dir / f"rank{r}-{n}.pt" for r in range(self.world_size)]
        deadline = time.monotonic() + timeout
        while not all(f.exists() for f in results):
            failed = next((r for r in range(self.world_size)
                           if (self.dir / f"rank{r}-{n}.err").exists() or self.procs[r].poll() is not None), None)
            if failed is not None or time.monotonic() > deadline:
                if failed is not None:
                    self.procs[failed].wait(timeout=20)  # its traceback is all in its log
                output = "" if failed is None else self._output(failed, since[failed])
                self.close(kill=True)
                World._alive.pop(self.world_size, None)
                if failed is None:
                    raise subprocess.TimeoutExpired(target, timeout)
                if any(flake in output for flake in _RENDEZVOUS_FLAKES) and n == 0:
                    raise _RendezvousFlake(output)
                raise RuntimeError(f"rank {failed} exited with 1:\n{output}")
            time.sleep(0.02)
        out = [torch.load(f, weights_only=True) for f in results]
        for f in results:
            f.unlink()
        return out

    def close(self, kill: bool = False) -> None:
        """End the ranks: after their last call, or at once (`kill`: a failed world, whose other ranks
        may wait inside a collective for the one that failed)."""
        for p in self.procs:
            if kill:
                p.kill()
            try:
                p.stdin.close()  # end of input: the rank leaves after its last call
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self.logs:
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@atexit.register
def _close_worlds() -> None:
    for world in list(World._alive.values()):
        world.close()
    World._alive.clear()


def _run_once(target: str, world_size: int, kwargs: dict | None, timeout: float, allow_missing: bool,
              device: str) -> list:
    env = base_env(world_size) if device == "cpu" else gpu_env(base_env(world_size))
    with tempfile.TemporaryDirectory() as tmp:
        procs, logs = [], [Path(tmp) / f"rank{rank}.log" for rank in range(world_size)]
        for rank in range(world_size):
            e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            cmd = [sys.executable, "-m", "tests.support.harness", target, json.dumps(kwargs or {}), tmp, device]
            # to a file, not a pipe: a rank whose output filled a pipe not yet read (the others' are read
            # after rank 0 exits) would block in its write while rank 0 waits for it in a collective
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(cmd, env=e, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
        outputs = [log.read_bytes().decode(errors="replace") for log in logs]
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


class _ProcessState:
    """What a call may change in its process and the next call must not see."""

    def __init__(self):
        import logging
        import signal
        import warnings

        self.environ, self.cwd = dict(os.environ), os.getcwd()
        self.seed, self.threads = torch.initial_seed(), torch.get_num_threads()
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
        self.loggers = {name: list(lg.handlers) for name, lg in logging.Logger.manager.loggerDict.items()
                        if isinstance(lg, logging.Logger)}
        self.root_handlers = list(logging.root.handlers)
        self.warnings = list(warnings.filters)

    def restore(self) -> None:
        import gc
        import logging
        import signal
        import warnings

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.manual_seed(self.seed)
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(False)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        for s, handler in self.signals.items():
            signal.signal(s, handler)
        for name, lg in logging.Logger.manager.loggerDict.items():
            if isinstance(lg, logging.Logger):
                lg.handlers[:] = self.loggers.get(name, [])
        logging.root.handlers[:] = self.root_handlers
        warnings.filters[:] = self.warnings
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        gc.collect()


def _serve(folder: Path) -> None:
    """Run the calls that arrive on stdin, one after another, in one process group, until stdin ends."""
    import gc
    import importlib
    import traceback

    import torch.distributed as dist

    from zerodp.distributed.process_group import init_distributed, shutdown

    torch.set_num_threads(1)
    env = init_distributed("cpu")
    state = _ProcessState()
    # The garbage collector leaves out of its scans what start-up and the calls before left alive (torch's,
    # DeepSpeed's and the tests' modules: some 400,000 objects after a few trainings), which every full
    # collection scanned again (DeepSpeed's ZeRO-3 runs one at each engine's setup): about 1 s of a rank's
    # 6 in a call of 25 DPO trainings. Objects still alive then are in use, not garbage.
    gc.freeze()
    for line in sys.stdin:
        call = json.loads(line)
        n = call["n"]
        torch.manual_seed(state.seed)
        try:
            module, fn = call["target"].split(":")
            result = getattr(importlib.import_module(module), fn)(**call["kwargs"])
            torch.save(result, folder / f"rank{env.rank}-{n}.pt.tmp")
            os.replace(folder / f"rank{env.rank}-{n}.pt.tmp", folder / f"rank{env.rank}-{n}.pt")
            del result
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            (folder / f"rank{env.rank}-{n}.err").write_text(traceback.format_exc())
            os._exit(1)  # its peers may be inside a collective: this world is thrown away
        sys.stdout.flush()
        state.restore()
        gc.freeze()
        dist.barrier()
    shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        _serve(Path(sys.argv[2]))
    else:
        _worker_main()
