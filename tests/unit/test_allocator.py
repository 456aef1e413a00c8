"""The CUDA allocator's default (zerodp.cli.allocator): expandable segments unless the user chose a
setting under any of the names torch reads, set by the command's entry before torch is imported."""

from __future__ import annotations

import os

from zerodp.cli.allocator import DEFAULT, USERS, default_allocator


def test_set_only_where_the_user_set_nothing():
    env = {"PATH": "/bin"}
    assert default_allocator(env) == DEFAULT and env == {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": DEFAULT}
    assert default_allocator(env) is None and env["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT  # idempotent
    for name in USERS:
        for value in ("max_split_size_mb:128", ""):  # an empty value is a choice too
            mine = {name: value}
            assert default_allocator(mine) is None and mine == {name: value}


def test_the_command_sets_it_at_its_start(monkeypatch, capsys):
    from zerodp.cli.commands import main

    for name in USERS:
        monkeypatch.delenv(name, raising=False)
    assert main(["config"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert main(["config"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"
    capsys.readouterr()
