"""The ops DeepSpeed compiles at a zero launch (zerodp/strategies/deepspeed_ops.py): built per environment
(not in the ~/.cache/torch_extensions every environment of the user shares), said before the build, and
a missing compiler found at start-up (the launch itself: tests/distributed/test_cli.py)."""

from __future__ import annotations

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
    assert deepspeed_ops.jit_ops(offload_optimizer=False) == ["deepspeed_shm_comm"]
    assert deepspeed_ops.build_line(False) == (
        f"DeepSpeed compiles its C++ op deepspeed_shm_comm (once for this environment; a minute or so) into "
        f"{tmp_path}")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(UserError, match=r"strategy.name=zero2: DeepSpeed compiles its C\+\+ op deepspeed_shm_comm "
                                        r"at the first launch and there is no C\+\+ compiler \(CXX=.*no-such-g\+\+ "
                                        r"is not found\)"):
        deepspeed_ops.check("zero2", offload_optimizer=False)
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert deepspeed_ops.build_line(False) is None  # built: loaded as it is, no compiler needed
    deepspeed_ops.check("zero2", offload_optimizer=False)
