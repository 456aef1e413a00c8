"""Process-group set-up from the launcher's environment, and small collective helpers.

Works under the deepspeed launcher, torchrun (including elastic restarts), Slurm (srun sets SLURM_*),
and as one plain process. gloo on CPU, nccl on CUDA (with gloo beside it for CPU tensors).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerodp.errors import UserError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    host: str
    hosts: list[str]
    """Every rank's host name, by rank."""

    @property
    def local_world_size(self) -> int:
        """Ranks on this rank's node (from the host names: launchers disagree on the variable)."""
        return self.hosts.count(self.host)


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if os.environ.get(n) not in (None, ""):
            return int(os.environ[n])
    return default


# Where each launcher puts rank, world size and local rank: torchrun and the deepspeed launcher (RANK...),
# srun (SLURM_*), mpirun / DeepSpeed's openmpi runner (OMPI_COMM_WORLD_*).
RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def init_distributed(device_pref: str = "auto", timeout_s: int = 600) -> DistEnv:
    """Initialise (or reuse) the default process group; a world of one when no launcher set one up."""
    rank = _env_int(*RANK_VARS, default=0)
    world = _env_int(*WORLD_VARS, default=1)
    local_rank = _env_int(*LOCAL_RANK_VARS, default=0)
    if world > 1 and "MASTER_ADDR" not in os.environ and not dist.is_initialized():
        raise UserError(
            f"this process is rank {rank} of {world} but MASTER_ADDR is not set, so the ranks cannot find each "
            f"other; export MASTER_ADDR (the first node's address) and MASTER_PORT, e.g. under Slurm "
            f"MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1) MASTER_PORT=29500")
    use_cuda = torch.cuda.is_available() and device_pref in ("auto", "cuda")
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is visible; set train.device=auto or cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        os.environ.setdefault("MASTER_PORT", "29500")
        if world == 1 and "MASTER_ADDR" not in os.environ:  # one plain process: an in-memory store is enough
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            store = _elastic_store(rank, world, timeout)
            if store is None:
                dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
            else:
                dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    host = socket.gethostname()
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, host, hosts)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # ranks of one node share its cores: no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    return env


def _elastic_store(rank: int, world: int, timeout: datetime.timedelta):
    """Under torchrun restarts, a store namespaced by the restart count.

    torchrun hands restarted workers the agent's TCPStore; a plain env:// init would read the previous
    attempt's keys and fail to connect ("Gloo connectFullMesh failed"). Prefixing by
    TORCHELASTIC_RESTART_COUNT gives every attempt a clean namespace."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=not use_agent and rank == 0, timeout=timeout,
    )
    return dist.PrefixStore(f"zerodp/restart{restart}/", base)


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (same length everywhere), on every rank. Uses the CPU (gloo) path."""
    t = torch.tensor(values, dtype=torch.float64)
    world = dist.get_world_size()
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def broadcast_object(obj, src: int = 0):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Tear the process groups down while the interpreter is still whole.

    A gloo worker thread that finishes its last collective drops the tensors it held, which takes the
    GIL; if that happens while Python is finalising, the thread is cancelled inside C++ and the process
    aborts ("terminate called without an active exception") after a successful run. Collecting the
    model first (its reference cycles hold the groups) lets destroy_process_group join those threads
    now. Call it only after success: with a dead peer, teardown itself could block."""
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
