"""The ops DeepSpeed compiles at a zero launch (zerodp/strategies/deepspeed_ops.py): only those training uses
(cpu_adam for offload_optimizer; never the CPU accelerator's inference-only deepspeed_shm_comm), built per
environment (not in the ~/.cache/torch_extensions every environment of the user shares), said before the
build, and a missing compiler found at start-up (the launch itself: tests/distributed/test_cli.py)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

from zerodp.errors import UserError
from zerodp.strategies import deepspeed_ops


def test_builds_go_to_this_environment_unless_the_user_chose_a_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(deepspeed_ops.EXTENSIONS_VAR, raising=False)
    root = deepspeed_ops.use_environment_dir()
    if os.access(sys.prefix, os.W_OK):
        assert root.is_relative_to(Path(sys.prefix)), root
    assert os.environ[deepspeed_ops.EXTENSIONS_VAR] == str(root)
    monkeypatch.setenv(deepspeed_ops.EXTENSIONS_VAR, str(tmp_path))
    assert deepspeed_ops.use_environment_dir() == tmp_path  # the user's choice is kept


def test_the_build_is_said_once_and_checked_for_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv(deepspeed_ops.EXTENSIONS_VAR, str(tmp_path))
    assert deepspeed_ops.jit_ops(offload_optimizer=False) == []
    assert deepspeed_ops.build_line(False) is None
    assert deepspeed_ops.jit_ops(offload_optimizer=True) == ["cpu_adam"]
    assert deepspeed_ops.build_line(True) == (
        f"DeepSpeed compiles its C++ op cpu_adam (once for this environment; a minute or so) into {tmp_path}")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    deepspeed_ops.check("zero2", offload_optimizer=False)  # nothing to build: no compiler needed
    with pytest.raises(UserError, match=r"strategy.name=zero2 with strategy.offload_optimizer=true: DeepSpeed "
                                        r"compiles its C\+\+ op cpu_adam at the first launch and there is no C\+\+ "
                                        r"compiler \(CXX=.*no-such-g\+\+ is not found\)"):
        deepspeed_ops.check("zero2", offload_optimizer=True)
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert deepspeed_ops.build_line(True) is None  # built: loaded as it is, no compiler needed
    deepspeed_ops.check("zero2", offload_optimizer=True)


def test_deepspeed_builds_no_shared_memory_op_for_training(monkeypatch, tmp_path):
    """DeepSpeed's own builder of the op (called by its TorchBackend at init_distributed) returns without
    building once skip_unused_ops has run: nothing is compiled into an empty extensions folder."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv(deepspeed_ops.EXTENSIONS_VAR, str(tmp_path))
    import deepspeed.ops
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # the package exports torch under that name

    # as DeepSpeed's probe finds it on Linux (and put back after the test: the table lives for the process)
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, deepspeed_ops.SHM_COMM, True)
    deepspeed_ops.skip_unused_ops()
    assert ds_comm.build_shm_op() is None
    assert list(tmp_path.iterdir()) == []
