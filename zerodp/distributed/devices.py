"""How many GPUs one launch on this machine may use: the single count behind `make quickstart` and
`launchers/local.sh`.

    python -m zerodp.distributed.devices count            # prints an integer; 0 when no GPU is usable
    python -m zerodp.distributed.devices count --max 2    # at most 2 (what `make quickstart` starts)

The count is torch.cuda.device_count(), because CUDA applies CUDA_VISIBLE_DEVICES itself (indices,
GPU-... and MIG-... UUIDs; the list ends at the first entry that names no device) and enumerates a MIG
instance as the device a process can use. `nvidia-smi -L` is not used: it ignores CUDA_VISIBLE_DEVICES
and lists a MIG-enabled GPU and each of its instances on lines of their own.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from zerodp.errors import OneLineParser, UserError

# Values of CUDA_VISIBLE_DEVICES that hide every GPU: answered without importing torch (seconds).
_HIDES_ALL = ("", "-1", "NoDevFiles")


def usable_gpus(device_count: int, visible: str | None, max_gpus: int | None = None) -> int:
    """GPUs a launch may use: `device_count` (what CUDA enumerates, CUDA_VISIBLE_DEVICES applied),
    or 0 when `visible` (CUDA_VISIBLE_DEVICES, None when unset) hides them all; at most `max_gpus`."""
    if hides_all(visible):
        return 0
    count = max(0, device_count)
    return count if max_gpus is None else min(count, max_gpus)


def hides_all(visible: str | None) -> bool:
    return visible is not None and visible.strip() in _HIDES_ALL


def count_gpus(max_gpus: int | None = None, environ: Mapping[str, str] = os.environ) -> int:
    """usable_gpus of this process: 0 with a CPU build of torch or without a working driver."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if hides_all(visible):
        return 0
    import torch  # after the check above: a CPU-only launch need not wait for it

    return usable_gpus(torch.cuda.device_count(), visible, max_gpus)


def cuda_index(local_rank: int, device_count: int, local_world_size: int | None) -> int:
    """The CUDA device a rank uses, of the `device_count` this process sees (CUDA_VISIBLE_DEVICES applied).

    torchrun and the deepspeed launcher show every rank of a node all of its GPUs: rank LOCAL_RANK takes
    device LOCAL_RANK. A scheduler that binds each task to its own GPU (`srun --gpus-per-task=1`, a
    Kubernetes pod with one `nvidia.com/gpu`) shows each rank one device, index 0, whatever its local
    rank. Anything else would put two ranks of the node on one GPU (NCCL refuses: "Duplicate GPU
    detected") or name a device that does not exist: refused. `local_world_size` None: not known."""
    if device_count == 1:
        return 0
    if local_rank < device_count and (local_world_size is None or local_world_size <= device_count):
        return local_rank
    ranks = f"{local_world_size} ranks on this node" if local_world_size else f"local rank {local_rank}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise UserError(f"local rank {local_rank}: {ranks} but this process sees {device_count} GPUs{shown}, so ranks "
                    f"would share a GPU; start at most {device_count} ranks per node (--nproc-per-node "
                    f"{device_count}), or have the scheduler show each rank its own single GPU "
                    f"(srun --gpus-per-task=1)")


def thread_count(own_cpus: Sequence[int], node_cpu_sets: Sequence[Sequence[int]]) -> int:
    """Intra-op threads for a rank that may run on `own_cpus` (its affinity mask), beside the ranks of its
    node whose masks are `node_cpu_sets` (this rank's included): its cores over the ranks sharing them.

    Ranks that torchrun or the deepspeed launcher start inherit one mask (the node's cores, or what Slurm
    gave the agent's task): each gets an equal part. Ranks a scheduler bound to cores of their own
    (srun with --cpus-per-task per rank) share nothing: each uses its whole mask."""
    own = set(own_cpus)
    sharing = sum(1 for cpus in node_cpu_sets if own & set(cpus))
    return max(1, len(own) // max(1, sharing))


TORCHRUN_OMP_DEFAULT = "ZERODP_OMP_NUM_THREADS_FROM_USER"
"""Set by zerodp.distributed.launcher before torchrun starts: "1" when OMP_NUM_THREADS came from the user,
"0" when torchrun will set its own default (1 for several processes per node)."""


def user_threads(environ: Mapping[str, str]) -> bool:
    """Whether the user chose OMP_NUM_THREADS. torchrun sets OMP_NUM_THREADS=1 itself for several
    processes per node (torch/distributed/run.py); zerodp's launcher says which it was, and under plain
    torchrun a 1 with several local ranks is taken for torchrun's default."""
    if "OMP_NUM_THREADS" not in environ:
        return False
    said = environ.get(TORCHRUN_OMP_DEFAULT)
    if said in ("0", "1"):
        return said == "1"
    torchrun_default = (environ.get("TORCHELASTIC_RUN_ID") is not None and environ["OMP_NUM_THREADS"] == "1"
                        and int(environ.get("LOCAL_WORLD_SIZE") or 1) > 1)
    return not torchrun_default


def affinity() -> list[int]:
    """The CPUs this process may run on (Slurm's and taskset's binding applied), else every core."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time this process's cgroup may use (a container's --cpus: cgroup v2 cpu.max,
    v1 cpu.cfs_quota_us over cpu.cfs_period_us), or None without a limit. The affinity mask does not
    show it: a container limited to 2 CPUs of a 64-core host sees 64 there."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            words = open(os.path.join(root, quota_file)).read().split()
            if period_file is not None:
                words.append(open(os.path.join(root, period_file)).read().strip())
        except (OSError, ValueError):
            continue
        if len(words) == 2 and words[0].lstrip("-").isdigit() and words[1].isdigit() and int(words[0]) > 0:
            return int(words[0]) / int(words[1])
        return None  # "max" or -1: no limit
    return None


def size_threads(environ: Mapping[str, str] = os.environ, local_processes: int | None = None) -> int | None:
    """Set torch's intra-op threads to the CPUs this process may use (its affinity mask, within its
    cgroup's quota) over the local processes of its launch (LOCAL_WORLD_SIZE, else 1), never more;
    return the count, or None where the user chose OMP_NUM_THREADS. For commands without a launch's
    process group (zerodp eval, generate); a training rank does the same in init_distributed. More
    threads than CPUs only contend: `zerodp eval` took 28.1 s where one thread took 7.2 s."""
    if user_threads(environ):
        return None
    import torch

    local = local_processes or int(environ.get("LOCAL_WORLD_SIZE") or 1)
    cpus = affinity()
    count = thread_count(cpus, [cpus] * local)
    quota = cpu_quota()
    if quota is not None:
        count = min(count, max(1, int(quota // local)))
    torch.set_num_threads(count)
    return count


def nvidia_smi() -> str | None:
    """The output of `nvidia-smi` (its header names the driver and the newest CUDA it supports), or None
    where it is not installed or fails (no driver, no GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def unusable_gpu(smi: str | None, torch_version: str, torch_cuda: str | None) -> str | None:
    """For train.device=auto where torch.cuda.is_available() is False: the one-line error when `smi`
    (nvidia-smi's output, None when it did not run) shows that the machine has a working NVIDIA
    driver, saying why torch cannot use it (`torch_cuda`: torch.version.cuda, None for a CPU-only
    build) and how to fix it; None where there is no GPU to miss."""
    driver = re.search(r"Driver Version:\s*([\d.]+)", smi or "")
    if driver is None:  # nvidia-smi prints its header only when it reached the driver
        return None
    supported = re.search(r"CUDA Version:\s*([\d.]+)", smi)
    has = f"driver {driver.group(1)}" + (
        f", CUDA {supported.group(1)} or older" if supported else "")
    found = f"train.device=auto: nvidia-smi shows a GPU ({has}) but torch {torch_version} cannot use it: "
    cpu = "or set train.device=cpu to train on the CPU"
    if torch_cuda is None:
        wheel = f"cu{supported.group(1).replace('.', '')}" if supported else "cuXYZ"
        return (found + f"it is a CPU-only build; install a CUDA build of torch (e.g. pip install torch "
                        f"--index-url https://download.pytorch.org/whl/{wheel}, or an older cu index), " + cpu)
    if supported and _version(torch_cuda) > _version(supported.group(1)):
        return (found + f"it is built for CUDA {torch_cuda}, newer than the driver supports "
                        f"({supported.group(1)}); update the NVIDIA driver, or install a torch build for CUDA "
                        f"{supported.group(1)} or older, " + cpu)
    return (found + f"it is built for CUDA {torch_cuda} and torch.cuda.is_available() is False; check that this "
                    f"process may open the GPUs (/dev/nvidia*, a container's --gpus), " + cpu)


class _Parser(OneLineParser):
    def error_line(self, message: str) -> str:
        return f"{self.prog}: error: {message}; see '{self.prog} --help'"


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of GPUs, 1 or more, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m zerodp.distributed.devices", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    count = sub.add_parser("count", help="print how many GPUs a launch here may use (0 when none)")
    count.add_argument("--max", type=_positive, default=None, metavar="N", help="print at most N")
    args = parser.parse_args(argv)
    print(count_gpus(args.max))
    return 0


if __name__ == "__main__":
    sys.exit(main())
