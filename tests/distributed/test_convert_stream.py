"""The read-ahead behind every conversion (zerodp.convert.stream): tensors come out in the writer's order,
equal to reading them directly, within the window; an out-of-order request is read directly; a read
error reaches the writer's thread."""

from __future__ import annotations

import hashlib
import os

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


def manifest_folder(path, sizes=(3_000_000, 2_000_000, 10)):
    """A folder whose meta.json lists its files' sizes and sha256, as a zerodp checkpoint's does."""
    import hashlib
    import json
    import os

    path.mkdir()
    files = {}
    for i, n in enumerate(sizes):
        data = os.urandom(n)
        (path / f"f{i}.bin").write_bytes(data)
        files[f"f{i}.bin"] = {"bytes": n, "sha256": hashlib.sha256(data).hexdigest()}
    (path / "meta.json").write_text(json.dumps({"files": files}))
    return path


def test_background_hashing_passes_an_intact_folder_and_names_a_corrupted_file(tmp_path):
    from zerodp.checkpoint.manifest import BackgroundVerify

    ok = manifest_folder(tmp_path / "ok")
    assert BackgroundVerify(ok).result() is None
    bad = manifest_folder(tmp_path / "bad")
    with open(bad / "f1.bin", "r+b") as f:  # one byte flipped: same size, another hash
        f.seek(1234)
        byte = f.read(1)
        f.seek(1234)
        f.write(bytes([byte[0] ^ 1]))
    assert BackgroundVerify(bad, threads=2).result() == f"{bad / 'f1.bin'} fails its sha256 check (corrupted)"
    (bad / "f2.bin").write_bytes(b"short")  # sizes are checked at once, before any hashing
    assert "f2.bin has 5 bytes" in BackgroundVerify(bad).problem


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_background_hashing_stopped_or_failed_never_passes(tmp_path, monkeypatch):
    from zerodp.checkpoint import manifest

    folder = manifest_folder(tmp_path / "c")

    def endless(path, stop=None, start=0, length=None):  # hashes until told to stop
        stop.wait()
        return ""
    monkeypatch.setattr(manifest, "sha256_file", endless)
    check = manifest.BackgroundVerify(folder)
    check.cancel()
    assert "stopped before it finished" in check.result()

    def broken(path, stop=None, start=0, length=None):
        raise MemoryError  # a hashing thread that dies without a verdict
    monkeypatch.setattr(manifest, "sha256_file", broken)
    assert "did not finish" in manifest.BackgroundVerify(folder).result()


def test_the_command_checks_its_destination_and_starts_hashing_before_importing_torch():
    import subprocess
    import sys

    from tests.support.harness import ROOT

    code = ("import sys, zerodp.convert.cli, zerodp.convert.destination, zerodp.checkpoint.manifest; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_pages_given_back_are_the_file_mappings_only_and_read_again_unchanged(tmp_path):
    """DeepSpeed rank files are read through mmap; each piece's pages are given back once copied
    (madvise), without re-opening the file. Memory not mapped from the file is never touched."""
    from zerodp.convert.mapped import drop_pages, file_mappings

    def resident_kb(path) -> int:  # this process's resident memory mapped from `path`
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            if "-" in line.split()[0]:
                inside = line.rstrip().endswith(str(path.resolve()))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
        return total

    want = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    torch.save({"flat": want}, tmp_path / "rank.pt")
    flat = torch.load(tmp_path / "rank.pt", mmap=True, weights_only=True)["flat"]
    mapped = file_mappings(tmp_path / "rank.pt")
    assert mapped and float(flat.sum()) == float(want.sum())  # every page read
    assert resident_kb(tmp_path / "rank.pt") > 15_000
    assert drop_pages(flat.narrow(0, 1000, (4 << 20) - 2000), mapped)
    assert resident_kb(tmp_path / "rank.pt") < 64  # the edge pages at most
    assert torch.equal(flat, want)  # pages read again from the file, as they were
    anonymous = torch.ones(4 << 20)
    assert not drop_pages(anonymous, mapped) and bool((anonymous == 1).all())


def test_a_finished_output_file_is_flushed_to_disk_in_the_background(tmp_path, monkeypatch):
    import os

    from zerodp.convert import source

    synced, real = [], os.fsync
    monkeypatch.setattr(source.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    (tmp_path / "done.safetensors").write_bytes(b"x" * 100)
    source.flush_soon(tmp_path / "done.safetensors").join()
    source.flush_soon(tmp_path / "gone.safetensors").join()  # removed meanwhile: left to the final fsync
    assert synced == [str((tmp_path / "done.safetensors").resolve())]


def test_hf_layout_is_made_in_the_reading_thread_and_an_hf_source_is_not_transposed_twice(tmp_path, monkeypatch):
    import dataclasses
    import threading

    from safetensors.torch import load_file, save_file

    from zerodp.config import ModelConfig
    from zerodp.convert import stream, write_hf
    from zerodp.models.arch import arch_of

    cfg = ModelConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=64, block_size=16)
    torch.manual_seed(0)
    weights = {n: torch.randn(s) for n, s in arch_of(cfg).param_shapes().items()}
    save_file(weights, tmp_path / "model.safetensors", metadata={"zerodp.layout": "zerodp"})
    where, real = set(), stream.ReadAhead.__init__

    def watched(self, *args, **kwargs):  # where each tensor is prepared, and whether it leaves contiguous
        real(self, *args, **kwargs)
        prepare = self.prepare

        def noted(i, t):
            out = prepare(i, t)
            where.add((threading.current_thread().name, out.is_contiguous()))
            return out
        self.prepare = noted
    monkeypatch.setattr(stream.ReadAhead, "__init__", watched)
    write_hf(open_checkpoint(tmp_path / "model.safetensors"), tmp_path / "hf", model=dataclasses.asdict(cfg),
             progress=False)
    assert where == {("zerodp-read-ahead", True)}  # the writer writes its memory as it is, no copy
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(hf["transformer.h.0.attn.c_attn.weight"], weights["transformer.h.0.attn.c_attn.weight"].t())
    write_hf(open_checkpoint(tmp_path / "hf"), tmp_path / "again", progress=False, dtype="bf16")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == hf.keys() and all(torch.equal(again[k], hf[k].bfloat16()) for k in hf)



@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_chunks_are_read_straight_into_place_and_other_layouts_through_dcp_load(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from zerodp.convert.dcp_ckpt import DcpSource

    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "h": torch.randn(16, 8).bfloat16(), "step": torch.tensor(3.0),
             "wt": torch.randn(32, 48).t()}  # a transposed view: saved with its strides
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    src = DcpSource(tmp_path / "dcp")
    fallback, real = [], DcpSource._dcp_load
    monkeypatch.setattr(DcpSource, "_dcp_load", lambda self, out: fallback.extend(out) or real(self, out))
    got = dict(zip(state, src._load_many(list(state))))
    assert fallback == ["wt"]
    assert all(torch.equal(got[k], state[k]) and got[k].dtype == state[k].dtype for k in state)
    data = next((tmp_path / "dcp").glob("*.distcp"))
    os.truncate(data, 1000)  # inside the first chunk
    with pytest.raises(CheckpointError, match="truncated"):
        src._load_many(["w", "h"])


def test_a_file_record_has_the_sha256_of_the_file_and_of_each_block(tmp_path):
    from zerodp.checkpoint.manifest import _inside, file_record

    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    rec = file_record(tmp_path / "f", block=4096)
    assert rec["bytes"] == 10_000 and rec["sha256"] == hashlib.sha256(data).hexdigest()
    assert rec["block_bytes"] == 4096 and rec["blocks"] == [hashlib.sha256(data[i:i + 4096]).hexdigest()
                                                            for i in (0, 4096, 8192)]
    assert "blocks" not in file_record(tmp_path / "f", block=10_000)  # one block: the file's own hash
    assert _inside(100, 200, [(150, 100), (0, 150)]) and not _inside(100, 200, [(0, 150), (151, 100)])
