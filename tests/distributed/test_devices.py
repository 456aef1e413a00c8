"""Devices (issue 12.1): the tests run on the CPU on any machine; GPU tests are marked gpu(n) and skipped
without n GPUs; `make quickstart`, launchers/local.sh and the overhead benchmark count GPUs one way
(zerodp.distributed.devices: CUDA_VISIBLE_DEVICES and MIG instances as CUDA counts them)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import (
    MACHINE_GPUS,
    ROOT,
    base_env,
    gpu_env,
    gpu_skip_reason,
    machine_gpus,
    pin_cpu,
    run_distributed,
)
from zerodp.distributed.devices import usable_gpus

# -- counting ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device_count, visible, max_gpus, expected", [
    (4, None, None, 4),          # CUDA_VISIBLE_DEVICES unset: every GPU CUDA enumerates
    (4, None, 2, 2),             # make quickstart: at most 2
    (1, None, 2, 1),             # one GPU: 1 process
    (0, None, 2, 0),             # no GPU, or a CPU build of torch
    (2, "0,1", 2, 2),
    (1, "3", 2, 1),              # CUDA applied the list: device_count is already 1
    (1, "MIG-4a1c2e3f-0000-5b6c-8d9e-0123456789ab", 2, 1),  # a MIG instance is one device
    (4, "", 2, 0),               # an empty list hides them all...
    (4, " ", None, 0),
    (4, "-1", None, 0),          # ...and so do -1 and Slurm's NoDevFiles
    (4, "NoDevFiles", None, 0),
    (-1, None, None, 0),
])
def test_usable_gpus(device_count, visible, max_gpus, expected):
    assert usable_gpus(device_count, visible, max_gpus) == expected


def devices(*args, env=None):
    return subprocess.run([sys.executable, "-m", "zerodp.distributed.devices", *args], cwd=ROOT, capture_output=True,
                          text=True, env=env or base_env(1), timeout=120)


def test_count_here_is_the_cpu_default():
    """On this pinned machine (and any without GPUs) the count is 0, which the launchers read as: 2 CPU processes."""
    for args in (["count"], ["count", "--max", "2"]):
        r = devices(*args)
        assert (r.returncode, r.stdout, r.stderr) == (0, "0\n", "")


def test_hidden_gpus_are_counted_without_importing_torch():
    code = ("import sys; from zerodp.distributed.devices import count_gpus; "
            "assert count_gpus(2, {'CUDA_VISIBLE_DEVICES': ''}) == 0; assert 'torch' not in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.stdout == "ok\n", r.stderr


@pytest.mark.parametrize("args, pattern", [
    (["count", "--max", "0"], r"argument --max: expected a whole number of GPUs, 1 or more, got '0'"),
    (["count", "--max", "two"], r"argument --max: expected a whole number of GPUs, 1 or more, got 'two'"),
    (["cnt"], r"invalid choice: 'cnt' \(choose from '?count'?\)"),
    ([], r"the following arguments are required: command"),
])
def test_count_bad_input_is_one_line_exit_2(args, pattern):
    r = devices(*args)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and re.search(pattern, r.stderr), r.stderr


# -- the tests are pinned to the CPU ---------------------------------------------------------------------------

def report_device() -> dict:
    """Run on each rank by run_distributed: what train.device=auto would get there."""
    import torch

    from zerodp.distributed.process_group import init_distributed

    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
            "cuda": torch.cuda.is_available(), "device": str(init_distributed("auto").device)}


def test_tests_and_their_processes_see_no_gpu():
    """The pin reaches the pytest process and every rank: train.device=auto resolves to the CPU there, so a
    GPU machine runs the CPU tests as this one does (before, auto chose cuda:LOCAL_RANK beside a gloo-only
    group: "Expected all tensors to be on the same device", "invalid device ordinal" from 3 ranks on)."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["DS_ACCELERATOR"] == "cpu"
    for rank in run_distributed("tests.distributed.test_devices:report_device", world_size=2):
        assert rank == {"visible": "", "ds_accelerator": "cpu", "cuda": False, "device": "cpu"}


def test_gpu_env_gives_the_machine_its_gpus_back():
    for machine, expected in ((None, None), ("0,1", "0,1"), ("MIG-x", "MIG-x"), ("", "")):
        env = {"DS_ACCELERATOR": "mps", "PATH": "/bin"} | ({} if machine is None else {"CUDA_VISIBLE_DEVICES": machine})
        pin_cpu(env)
        pin_cpu(env)  # twice (conftest, then base_env): the machine's value is kept
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
        assert env[MACHINE_GPUS] == ("all" if machine is None else machine)
        back = gpu_env(env)
        assert back.get("CUDA_VISIBLE_DEVICES") == expected and "DS_ACCELERATOR" not in back
        assert back["PATH"] == "/bin"


def test_gpu_marker_skips_without_the_gpus():
    have = machine_gpus()
    assert gpu_skip_reason(have) is None
    assert gpu_skip_reason(have + 1) == f"needs {have + 1} GPU(s); this machine offers {have} to the tests"
    r = subprocess.run([sys.executable, "-m", "pytest", "--markers"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert "@pytest.mark.gpu(n): needs n GPUs" in r.stdout


# -- launchers ----------------------------------------------------------------------------------------------

def local_sh(tmp_path, tiny, *overrides, **env_vars):
    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    env.pop("OMP_NUM_THREADS")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update(env_vars)
    over = [*tiny, "train.max_steps=2", f"train.out_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run([str(ROOT / "launchers/local.sh"), str(ROOT / "configs/tiny.yaml"), *over], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def test_local_sh_without_gpus_trains_on_2_cpu_processes(tmp_path, tiny):
    """What `make quickstart` does here: MAX_GPUS=2, no GPU -> 2 CPU processes."""
    r = local_sh(tmp_path, tiny, "strategy.name=ddp", MAX_GPUS="2", NPROC="")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "local.sh: 2 process(es) on the CPU" in r.stdout
    assert "strategy ddp on 2 process(es)" in r.stdout + r.stderr


@pytest.mark.parametrize("env_vars, pattern", [
    ({"NPROC": "two"}, r"^local.sh: error: NPROC=two is not a number of processes"),
    ({"NPROC": "0"}, r"^local.sh: error: NPROC=0 is not a number of processes"),
    ({"MAX_GPUS": "0"}, r"argument --max: expected a whole number of GPUs, 1 or more, got '0'"),
])
def test_local_sh_bad_input_is_one_line_exit_2(tmp_path, tiny, env_vars, pattern):
    r = local_sh(tmp_path, tiny, **env_vars)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and re.search(pattern, r.stderr), r.stderr


def load_benchmark():
    spec = importlib.util.spec_from_file_location("strategy_overhead", ROOT / "benchmarks/strategy_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("device, nproc, gpus, expected", [
    ("auto", None, 0, ("cpu", 2)),
    ("auto", None, 1, ("cuda", 1)),      # before: 2 processes, DeepSpeed on CPU, batches on cuda:0 and cuda:1
    ("auto", None, 8, ("cuda", 2)),
    ("auto", 4, 8, ("cuda", 4)),
    ("cpu", None, 8, ("cpu", 2)),
    ("cpu", 3, 0, ("cpu", 3)),
])
def test_benchmark_placement(device, nproc, gpus, expected):
    assert load_benchmark().placement(device, nproc, gpus) == expected


@pytest.mark.parametrize("device, nproc, gpus, pattern", [
    ("cuda", None, 0, r"--device cuda but no GPU is usable here; pass --device cpu"),
    ("auto", 2, 1, r"--nproc 2 on --device cuda needs 2 GPUs, this machine offers 1; pass --nproc 1"),
])
def test_benchmark_placement_refused(device, nproc, gpus, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_benchmark().placement(device, nproc, gpus)


def test_benchmark_bad_input_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "benchmarks/strategy_overhead.py", "--device", "cuda"], cwd=ROOT,
                       env=base_env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "strategy_overhead.py: error: --device cuda but no GPU is usable here; pass --device cpu"], r.stderr


# -- on GPUs (skipped without them) ------------------------------------------------------------------------

@pytest.mark.gpu(1)
def test_count_on_a_gpu_machine_honours_cuda_visible_devices():
    env = gpu_env(os.environ)
    first = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    assert devices("count", env=env).stdout == f"{machine_gpus()}\n"
    assert devices("count", "--max", "2", env=env).stdout == f"{min(2, machine_gpus())}\n"
    assert devices("count", env=env | {"CUDA_VISIBLE_DEVICES": first}).stdout == "1\n"
    assert devices("count", env=env | {"CUDA_VISIBLE_DEVICES": ""}).stdout == "0\n"


def train_on_gpus(tmp_path, tiny, world_size: int, strategy: str) -> list[list[float]]:
    over = [*tiny, f"strategy.name={strategy}", "train.device=cuda", "train.max_steps=2",
            f"train.out_dir={tmp_path / strategy}"]
    ranks = run_distributed("tests.support.workers:train_runs", world_size, {"runs": [{"overrides": over}]},
                            device="cuda")
    return [r[0]["losses"] for r in ranks]


@pytest.mark.gpu(1)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_one_gpu_trains(tmp_path, tiny, strategy):
    (losses,) = train_on_gpus(tmp_path, tiny, 1, strategy)
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)


@pytest.mark.gpu(2)
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
def test_two_gpus_train_alike(tmp_path, tiny, strategy):
    a, b = train_on_gpus(tmp_path, tiny, 2, strategy)
    assert a == b and len(a) == 2 and all(0 < x < 10 for x in a)
