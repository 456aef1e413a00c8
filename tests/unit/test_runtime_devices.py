"""The runtime's choices from what a launcher and the machine show: the CUDA device of a rank, the
threads of a rank, and the line for a GPU that torch cannot use (pure functions; no process group)."""

from __future__ import annotations

import pytest

from zerodp.distributed.devices import TORCHRUN_OMP_DEFAULT, cuda_index, thread_count, unusable_gpu, user_threads
from zerodp.errors import UserError


@pytest.mark.parametrize("local_rank, count, local_world, expected", [
    (3, 8, 8, 3),      # torchrun / the deepspeed launcher: every rank sees the node's GPUs
    (1, 8, 2, 1),      # fewer ranks than GPUs
    (5, 1, 8, 0),      # srun --gpus-per-task=1, Kubernetes: each rank sees its own GPU, index 0
    (0, 1, None, 0),
    (1, 4, None, 1),   # the launcher does not say how many ranks share the node
])
def test_cuda_index(local_rank, count, local_world, expected):
    assert cuda_index(local_rank, count, local_world) == expected


@pytest.mark.parametrize("local_rank, count, local_world", [(2, 2, 4), (0, 2, 4), (4, 4, None)])
def test_cuda_index_refuses_ranks_that_would_share_a_gpu(local_rank, count, local_world, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(UserError, match=rf"sees {count} GPUs \(CUDA_VISIBLE_DEVICES=0,1\).*--nproc-per-node {count}"):
        cuda_index(local_rank, count, local_world)


def test_thread_count_shares_cores_only_between_ranks_that_share_them():
    node = list(range(32))
    assert thread_count(node, [node] * 8) == 4             # torchrun's workers inherit one mask
    assert thread_count(node, [node] * 3) == 10
    bound = [list(range(4 * i, 4 * i + 4)) for i in range(8)]  # srun bound each rank to 4 cores of its own
    assert thread_count(bound[2], bound) == 4
    assert thread_count([0], [[0]] * 4) == 1               # never 0


@pytest.mark.parametrize("environ, chosen", [
    ({}, False),
    ({"OMP_NUM_THREADS": "6"}, True),
    # torchrun's own default for several ranks a node (torch/distributed/run.py), told by zerodp's launcher
    ({"OMP_NUM_THREADS": "1", TORCHRUN_OMP_DEFAULT: "0"}, False),
    ({"OMP_NUM_THREADS": "1", TORCHRUN_OMP_DEFAULT: "1"}, True),
    # plain torchrun: a 1 with several local ranks is taken for its default
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"}, False),
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1"}, True),
    ({"OMP_NUM_THREADS": "1"}, True),  # the deepspeed launcher sets none; --bind_cores_to_rank sets the cores
])
def test_user_threads(environ, chosen):
    assert user_threads(environ) is chosen


SMI = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |
"""


def test_unusable_gpu_names_the_versions_and_the_fix():
    newer = unusable_gpu(SMI, "2.13.0+cu128", "12.8")
    assert newer.startswith("train.device=auto: nvidia-smi shows a GPU (driver 550.54.15, CUDA 12.4 or older) but "
                            "torch 2.13.0+cu128 cannot use it: it is built for CUDA 12.8, newer than the driver "
                            "supports (12.4); update the NVIDIA driver"), newer
    assert newer.endswith("or set train.device=cpu to train on the CPU") and "\n" not in newer
    cpu = unusable_gpu(SMI, "2.13.0+cpu", None)
    assert "a CPU-only build" in cpu and "download.pytorch.org/whl/cu124" in cpu, cpu
    same = unusable_gpu(SMI, "2.13.0+cu124", "12.4")
    assert "/dev/nvidia*" in same, same


@pytest.mark.parametrize("smi", [None, "", "NVIDIA-SMI has failed because it couldn't communicate with the driver"])
def test_no_line_without_a_working_gpu(smi):
    assert unusable_gpu(smi, "2.13.0+cpu", None) is None


def test_cpu_quota_read_from_cgroup_v2_and_v1(tmp_path):
    from zerodp.distributed.devices import cpu_quota

    v2, v1, free = tmp_path / "v2", tmp_path / "v1", tmp_path / "free"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")  # docker --cpus=1.5
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    free.mkdir()
    (free / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(str(v2)) == 1.5 and cpu_quota(str(v1)) == 2.0
    assert cpu_quota(str(free)) is None and cpu_quota(str(tmp_path / "none")) is None


def test_single_process_commands_size_their_threads_to_their_cpus(monkeypatch):
    """Issue 38 item 19: `zerodp eval` and `generate` size torch's threads as a training rank does: the CPUs
    they may use over the local processes, never more; OMP_NUM_THREADS set by the user wins."""
    import os

    import torch

    from zerodp.distributed.devices import affinity, cpu_quota, size_threads

    quota = cpu_quota()
    mine = min(len(affinity()), max(1, int(quota))) if quota else len(affinity())
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(64)  # what torch may pick on a big host where this process has fewer CPUs
        assert size_threads({}) == mine == torch.get_num_threads()
        assert size_threads({}, local_processes=len(affinity()) * 2) == 1  # never below one
        torch.set_num_threads(64)
        assert size_threads({"OMP_NUM_THREADS": "3"}) is None and torch.get_num_threads() == 64
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # taskset -c 0
        assert size_threads({}) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
