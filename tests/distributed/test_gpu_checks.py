"""benchmarks/gpu_checks.py: on a machine without a GPU it says so and exits 0; its verdicts (one line a
check, exit 1 on any failure) are pure functions, checked here. The checks themselves need GPUs."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.gpu_checks import GIB, Result, exit_code, same_losses, summary, within
from tests.support.harness import ROOT, base_env


def test_without_a_gpu_it_says_so_and_exits_0():
    r = subprocess.run([sys.executable, "benchmarks/gpu_checks.py"], cwd=ROOT, env=base_env(1),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["gpu_checks: no usable GPU on this machine (CUDA_VISIBLE_DEVICES, a CPU "
                                     "build of torch or no driver): nothing to check"], r.stdout


def test_one_line_per_check_and_exit_1_on_any_failure():
    passed, failed = Result("resume fsdp bf16", True, "2 losses bit-identical"), Result("memory zero3", False, "x")
    assert passed.line() == "PASS resume fsdp bf16: 2 losses bit-identical"
    assert failed.line() == "FAIL memory zero3: x"
    assert exit_code([passed, passed]) == 0
    assert exit_code([passed, failed, passed]) == 1
    assert exit_code([]) == 1, "no check ran: not a pass"
    assert summary([passed, failed, passed]) == "gpu_checks: 2 passed, 1 failed"


def test_losses_compare_bit_for_bit_or_within_a_tolerance():
    assert same_losses("c", [1.0, 2.0], [1.0, 2.0]).line() == "PASS c: 2 losses bit-identical"
    off = same_losses("c", [1.0, 2.0 + 1e-7], [1.0, 2.0])
    assert not off.ok and off.detail.startswith("loss 1 is 2.0000001, expected 2.0"), off.detail
    assert same_losses("c", [1.0, 2.0 + 1e-7], [1.0, 2.0], 1e-4).ok
    assert not same_losses("c", [1.0, 2.1], [1.0, 2.0], 1e-4).ok
    assert not same_losses("c", [float("nan")], [float("nan")], 1e-4).ok, "NaN never matches"
    short = same_losses("c", [1.0], [1.0, 2.0])
    assert not short.ok and short.detail == "1 losses against 2"


def test_memory_figures_pass_only_within_their_limits():
    ok = within("memory fsdp bf16", [("after setup", 1 * GIB, 2 * GIB), ("sample", 2 * GIB, 2 * GIB)])
    assert ok.line() == "PASS memory fsdp bf16: after setup 1.00 GiB <= 2.00 GiB; sample 2.00 GiB <= 2.00 GiB"
    over = within("memory zero3 bf16", [("after setup", 1 * GIB, 2 * GIB), ("training", 3 * GIB, 2.5 * GIB)])
    assert not over.ok and over.detail.endswith("training 3.00 GiB > 2.50 GiB")
