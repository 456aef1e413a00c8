"""Process-group set-up from the launcher's environment, and small collective helpers.

Works under the deepspeed launcher, torchrun (including elastic restarts), Slurm (srun sets SLURM_*),
and as one plain process. gloo on CPU, nccl on CUDA (with gloo beside it for CPU tensors).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerodp.distributed import devices
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
# Ranks on this node: torchrun (LOCAL_WORLD_SIZE), the deepspeed launcher (LOCAL_SIZE), mpirun. srun sets
# none of these for every layout, so under it the node count says it instead.
LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")
NODE_COUNT_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")


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
    if not dist.is_initialized():
        check_gloo_network(os.environ, socket.gethostname())
    use_cuda = torch.cuda.is_available() and device_pref in ("auto", "cuda")
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is visible; set train.device=auto or cpu")
    if device_pref == "auto" and not use_cuda and not devices.hides_all(os.environ.get("CUDA_VISIBLE_DEVICES")):
        if problem := devices.unusable_gpu(devices.nvidia_smi(), torch.__version__, torch.version.cuda):
            raise UserError(problem)  # a GPU machine would otherwise train on its CPU, 10-100x slower
    if use_cuda:
        index = devices.cuda_index(local_rank, torch.cuda.device_count(), _first_int(os.environ, LOCAL_WORLD_VARS))
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
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
    host, cpus = socket.gethostname(), devices.affinity()
    placed = [None] * dist.get_world_size()
    dist.all_gather_object(placed, (host, cpus))
    hosts = [h for h, _ in placed]
    env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, host, hosts)
    if not devices.user_threads(os.environ):
        # On every device: a GPU run's host work (the CPU optimizer of offload, gloo, the prefetch thread)
        # runs on these threads. Ranks sharing cores share them out: no oversubscription, no lone core.
        count = devices.thread_count(cpus, [c for h, c in placed if h == host])
        quota = devices.cpu_quota()  # a container's CPU limit, shared by its ranks
        torch.set_num_threads(min(count, max(1, int(quota // hosts.count(host)))) if quota else count)
    return env


def world_timeout() -> datetime.timedelta:
    """The default process group's timeout (strategy.timeout_s, set by init_distributed): what every
    subgroup zerodp makes is given too. torch gives a subgroup made without one its backend's default
    instead (30 minutes for gloo, NCCL's own for nccl: torch/distributed/distributed_c10d.py,
    `_new_group_with_tag` and `_get_default_timeout`), not the default group's."""
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def new_group(ranks: list[int]):
    """dist.new_group with the default group's timeout (collective: every rank makes every group)."""
    return dist.new_group(ranks, timeout=world_timeout())


def mesh_options(device_type: str, timeout_s: float):
    """Backend options carrying `timeout_s`, for `init_device_mesh(backend_override=...)`: the only way a
    timeout reaches a device mesh's subgroups (torch/distributed/device_mesh.py,
    `_init_one_process_group`: `timeout = pg_options._timeout`, passed to new_group / split_group). NCCL
    insists on its own Options class; gloo reads only the timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's default for a group made without options
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options("gloo", timeout)


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for n in names:
        if env.get(n) not in (None, ""):
            return int(env[n])
    return None


def spans_several_nodes(env: Mapping[str, str]) -> bool:
    """Whether the launcher's variables say this run's ranks are on more than one node.

    Known before the process group exists (DistEnv.hosts comes later, over gloo itself). False when the
    launcher does not say: a check that rests on it must never stop a run on one node."""
    world = _first_int(env, WORLD_VARS)
    if world is None or world <= 1:
        return False
    local = _first_int(env, LOCAL_WORLD_VARS)
    if local is not None:
        return world > local
    nodes = _first_int(env, NODE_COUNT_VARS)
    return nodes is not None and nodes > 1


def resolve_host(name: str) -> list[str]:
    """The addresses `name` resolves to, in getaddrinfo's order (gloo binds the first); [] if none."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return [info[4][0] for info in infos]


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def check_gloo_network(env: Mapping[str, str], hostname: str,
                       resolve: Callable[[str], list[str]] = resolve_host) -> None:
    """Raise UserError, before any connection is tried, when gloo could not connect this node's ranks.

    gloo carries the host-name exchange, the per-step metrics all-gather and checkpoint agreement (and
    every collective on CPU). Unless GLOO_SOCKET_IFNAME names an interface, it binds to the address this
    node's host name resolves to, or to 127.0.0.1 when the name does not resolve, and tells the other
    ranks to connect there. A name mapped to 127.0.1.1 (the Debian/Ubuntu default in /etc/hosts) is
    unreachable from any other node: the run would stop at its first collective with "Gloo
    connectFullMesh failed". Runs on one node, and runs whose MASTER_ADDR is 127.x.x.x, ::1 or localhost
    (every "node" is then this machine), are never stopped."""
    names = [n for n in env.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        present = _interfaces()
        missing = [n for n in names if present and n not in present]
        if missing:  # gloo's own error is a C++ traceback: "Unable to find address for: eth9"
            raise UserError(
                f"GLOO_SOCKET_IFNAME={env['GLOO_SOCKET_IFNAME']} names no network interface on {hostname} "
                f"({', '.join(missing)}; it has {', '.join(present)}); export GLOO_SOCKET_IFNAME with the "
                f"interface of this node that reaches the other nodes (see `ip -br addr`)")
        return
    if not spans_several_nodes(env):
        return
    addresses = resolve(hostname)
    if addresses and not _is_loopback(addresses[0]):
        return
    master = env.get("MASTER_ADDR", "")
    if _loopback_literal(master):  # not a name: the first node's name resolves to loopback there too
        return
    found = (f"resolves to {addresses[0]}, a loopback address," if addresses
             else "does not resolve, so gloo falls back to 127.0.0.1,")
    raise UserError(
        f"this run spans several nodes but host name {hostname!r} {found} which the other nodes cannot "
        f"reach (gloo would fail with \"connectFullMesh failed\"); export GLOO_SOCKET_IFNAME={_suggest(master)} "
        f"(the interface that reaches MASTER_ADDR={master or '?'}) and NCCL_SOCKET_IFNAME likewise on every "
        f"node before launching (the scripts in launchers/ forward both), or map {hostname} to its network address "
        f"in /etc/hosts")


def _loopback_literal(address: str) -> bool:
    try:
        return address == "localhost" or _is_loopback(address)
    except ValueError:
        return False


def _interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _suggest(master: str) -> str:
    """The interface to name: the one this node routes MASTER_ADDR through, else `<interface>` and the
    candidates. Looks only at the local routing table (a UDP connect sends nothing)."""
    others = [n for n in _interfaces() if n != "lo"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))
            local = s.getsockname()[0]
        import fcntl
        import struct

        for name in others:  # SIOCGIFADDR: the interface's IPv4 address
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    except (OSError, UnicodeError, ImportError):  # no route, a name that does not resolve, not Linux
        pass
    return f"<interface> (one of: {', '.join(others)})" if others else "<interface>"


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
