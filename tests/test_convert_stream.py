"""The read-ahead behind every conversion (zerodp.convert.stream): tensors come out in the writer's order,
equal to reading them directly, within the window; an out-of-order request is read directly; a read
error reaches the writer's thread."""

from __future__ import annotations

import pytest
import torch

from zerodp.convert import open_checkpoint
from zerodp.convert.source import TensorInfo, write_safetensors_file
from zerodp.convert.stream import read_ahead
from zerodp.errors import CheckpointError


def model_file(path, n=12, numel=1000):
    names = [f"w{i}" for i in range(n)]
    infos = {k: TensorInfo((numel,), torch.float32) for k in names}
    write_safetensors_file(path, names, infos, lambda k: torch.full((numel,), float(k[1:])), {})
    return names


def test_tensors_come_in_order_within_the_window(tmp_path):
    names = model_file(tmp_path / "m.safetensors")
    with open_checkpoint(tmp_path / "m.safetensors") as src:
        order = [(n, "param") for n in reversed(names)]
        with read_ahead(src, order, window=9000) as ahead:  # two tensors of 4000 bytes in flight at most
            assert torch.equal(ahead.get("w3"), torch.full((1000,), 3.0))  # out of order: read directly
            for n, _ in order:
                peak = ahead.in_flight
                assert peak <= 9000, peak
                assert torch.equal(ahead.get(n), src.get(n))
            assert ahead.next == len(order) and ahead.in_flight == 0


def test_a_read_error_reaches_the_writer(tmp_path):
    names = model_file(tmp_path / "m.safetensors")
    with open_checkpoint(tmp_path / "m.safetensors") as src:
        path = tmp_path / "m.safetensors"
        path.write_bytes(path.read_bytes()[:-6000])  # cut after it was opened: the last tensors are gone
        with read_ahead(src, [(n, "param") for n in names], window=9000) as ahead:  # a tensor per batch
            got = [ahead.get(n) for n in names[:10]]
            assert all(torch.equal(t, torch.full((1000,), float(i))) for i, t in enumerate(got))
            with pytest.raises(CheckpointError, match="truncated"):
                ahead.get(names[10])
