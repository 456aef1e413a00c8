"""Conversion of checkpoints written by plain DeepSpeed and plain FSDP2 programs (not by zerodp),
checked against the engines' own consolidation tools and their live optimizer state."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.harness import ROOT, run_distributed
from zerodp.checkpoint.store import sha256_file
from zerodp.convert import open_checkpoint, write_safetensors, write_zerodp
from zerodp.convert.hf import SafetensorsSource

BLOCK = 64  # bytes per hashed block in the per-block tests: the tiny models' tensors are a few hundred
CONFIGS = [[1, False], [1, True], [2, False], [2, True], [3, False], [3, True]]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    live = run_distributed("tests.support.convert_support:deepspeed_write_all", 2,
                           {"root": str(root), "configs": CONFIGS})[0]
    return root, live


@pytest.mark.parametrize("stage, bf16", CONFIGS)
def test_deepspeed_weights_match_zero_to_fp32_and_moments_match_live_state(ds_run, stage, bf16):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, live = ds_run
    key = f"s{stage}_{int(bf16)}"
    src = open_checkpoint(root / key)
    assert src.format == "deepspeed" and src.meta["zero_stage"] == stage and src.meta["world_size"] == 2
    assert src.meta["dtype"] == ("bf16" if bf16 else "fp32") and src.meta["step"] == 3
    assert src.tied() == {"head.weight": "wte.weight"}  # shared_params (ZeRO-1/2) or shared storage (ZeRO-3)
    ref = get_fp32_state_dict_from_zero_checkpoint(str(root / key))
    names = src.param_names()
    assert set(names) == set(ref) - {"head.weight"}
    for n in names:
        assert torch.equal(src.get(n), ref[n]), n
        assert torch.equal(src.get(n), live[key][n]), n
        assert torch.equal(src.get(n, "exp_avg"), live[key][n + "/exp_avg"]), n
        assert torch.equal(src.get(n, "exp_avg_sq"), live[key][n + "/exp_avg_sq"]), n
        assert src.step(n) == 3.0


def test_deepspeed_read_needs_no_deepspeed_import(ds_run):
    root, _ = ds_run
    code = ("import sys; from zerodp.convert import open_checkpoint; s = open_checkpoint(sys.argv[1]); "
            "[s.get(n, k) for n in s.param_names() for k in ('param', 'exp_avg', 'exp_avg_sq')]; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(root / "s3_1")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_deepspeed_to_zerodp_to_safetensors(ds_run, tmp_path):
    root, live = ds_run
    src = open_checkpoint(root / "s2_1")
    ckpt = write_zerodp(src, tmp_path / "step_00000003", progress=False)
    back = open_checkpoint(ckpt, verify_deep=True)
    assert back.format == "zerodp" and back.meta["strategy"] == "single" and back.meta["step"] == 3
    assert back.tied() == {"head.weight": "wte.weight"}
    assert back.meta["converted_from"]["strategy"] == "zero2"
    for n in src.param_names():
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(back.get(n, kind), live["s2_1"][n if kind == "param" else f"{n}/{kind}"])
        assert back.step(n) == 3.0
    out = write_safetensors(back, tmp_path / "hf", dtype="bf16", progress=False)
    st = SafetensorsSource(out[0])
    assert "head.weight" not in st.param_names() and st.tied() == {"head.weight": "wte.weight"}
    assert torch.equal(st.get("wte.weight"), live["s2_1"]["wte.weight"].bfloat16())
    assert json.loads(st.meta["metadata"]["zerodp.source"])["format"] == "zerodp"


def test_deepspeed_files_nested_in_a_zerodp_checkpoint(ds_run, tmp_path):
    # zerodp's ZeRO strategy keeps DeepSpeed's files in a sub-folder of its step_ folder.
    root, live = ds_run
    step = tmp_path / "checkpoints" / "step_00000003"
    shutil.copytree(root / "s3_0" / "global_step3", step / "deepspeed")
    (step / "trainer.json").write_text('{"step": 3}')
    files = {str(p.relative_to(step)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(step.rglob("*")) if p.is_file()}
    meta = {"format_version": 1, "strategy": "zero3", "world_size": 2, "step": 3, "config": {}, "params": {},
            "tied": {"head.weight": "wte.weight"}, "files": files}
    (step / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "checkpoints" / "latest").write_text("step_00000003\n")
    src = open_checkpoint(tmp_path)  # an out_dir: its checkpoints/latest
    assert src.format == "zerodp" and src.layout == "deepspeed" and src.path == step
    assert torch.equal(src.get("proj.weight", "exp_avg_sq"), live["s3_0"]["proj.weight/exp_avg_sq"])


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp") / "ckpt"
    run_distributed("tests.support.convert_support:fsdp_write", 2, {"out": str(out)})
    return out


def test_dcp_matches_dcp_to_torch_save(dcp_dir, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dir, tmp_path / "ref.pt")
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    src = open_checkpoint(dcp_dir)
    assert src.format == "dcp" and src.meta["step"] == 2
    assert src.tied() == {"head.weight": "wte.weight"}  # plain FSDP saves the tie under both names
    assert set(src.param_names()) == set(ref["model"]) - {"head.weight"}
    for n in src.param_names():
        assert torch.equal(src.get(n), ref["model"][n]), n
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(src.get(n, kind), ref["optim"]["state"][n][kind]), n
        assert src.step(n) == float(ref["optim"]["state"][n]["step"])
    ckpt = open_checkpoint(write_zerodp(src, tmp_path / "z", progress=False))
    assert torch.equal(ckpt.get("body.weight", "exp_avg"), ref["optim"]["state"]["body.weight"]["exp_avg"])


def test_truncated_dcp_and_deepspeed_files_are_named(ds_run, dcp_dir, tmp_path):
    from zerodp.errors import CheckpointError

    bad = tmp_path / "dcp"
    shutil.copytree(dcp_dir, bad)
    data = bad / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp has 1000 bytes but \.metadata points up to byte"):
        open_checkpoint(bad)
    root, _ = ds_run
    ds = tmp_path / "ds"
    shutil.copytree(root / "s1_0", ds)
    f = ds / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt is truncated or corrupted"):
        src = open_checkpoint(ds)
        src.get("wte.weight")


@pytest.mark.parametrize("key", [f"s{stage}_{int(bf16)}" for stage, bf16 in CONFIGS] + ["dcp"])
def test_stored_tensors_are_located_in_their_files_and_copied_from_there(ds_run, dcp_dir, tmp_path, monkeypatch, key):
    """Every weight and moment of a DeepSpeed or DCP folder is found in its files as stored
    (`locate`); those bytes are `get`'s tensor; and a conversion that keeps the dtype copies them file
    to file without reading one tensor, the same bytes as through the read-and-write fallback."""
    from safetensors.torch import load_file

    from zerodp.convert import source as source_module

    src = open_checkpoint(dcp_dir if key == "dcp" else ds_run[0] / key)
    trained = [n for n in src.param_names() if src.has(n, "exp_avg")]
    assert len(trained) >= 3
    for n in trained:
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            where = src.locate(n, kind)
            assert where is not None, (n, kind)
            data = b"".join(open(p, "rb").read()[at:at + k] for p, at, k in where.ranges)
            want = src.get(n, kind)
            assert len(data) == want.numel() * want.element_size(), (n, kind)
            got = torch.frombuffer(bytearray(data), dtype=want.dtype).view(want.shape)
            assert torch.equal(got, want), (n, kind)
    if key != "dcp":
        assert max(len(src.locate(n).ranges) for n in trained) == 2  # some parameter is cut over the 2 ranks
    reads, get_many = [], type(src).get_many
    monkeypatch.setattr(type(src), "get_many", lambda self, requests: reads.extend(requests) or
                        get_many(self, requests))
    copied = write_safetensors(src, tmp_path / "copied", progress=False)[0]
    assert not [n for n, _ in reads if n in trained]  # no weight was read into memory
    out = load_file(copied)
    assert all(torch.equal(out[n], src.get(n)) for n in trained)
    monkeypatch.setattr(source_module, "_KERNEL_COPY", [False])
    fallback = write_safetensors(src, tmp_path / "fallback", progress=False)[0]
    assert copied.read_bytes() == fallback.read_bytes()


def _zerodp_step_around(files_dir, step, block):
    """A zerodp step folder holding a copy of `files_dir` (DeepSpeed's or DCP's files), its manifest with
    per-block sha256 of `block` bytes."""
    from zerodp.checkpoint.manifest import file_record

    shutil.copytree(files_dir, step / "inner")
    (step / "trainer.json").write_text('{"step": 3}')
    files = {str(p.relative_to(step)): file_record(p, block) for p in sorted(step.rglob("*")) if p.is_file()}
    assert any("blocks" in r for r in files.values())
    meta = {"format_version": 1, "strategy": "zero1", "world_size": 2, "step": 3, "config": {}, "params": {},
            "tied": {"head.weight": "wte.weight"}, "files": files}
    (step / "meta.json").write_text(json.dumps(meta))
    return step


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("key", ["s1_0", "s3_1", "dcp"])
def test_a_weights_only_conversion_checks_the_blocks_it_reads(ds_run, dcp_dir, tmp_path, key):
    """Per-block sha256 in the manifest: a conversion to safetensors hashes the blocks holding weights
    (and the files' metadata) and leaves out those wholly inside the optimizer moments (and DeepSpeed's
    module copy of the weights). A byte flipped in a moment then changes nothing it writes and is not
    reported (it is by zerodp's own resume check and by --to zerodp); one flipped in a weight is."""
    from safetensors.torch import load_file

    from zerodp.checkpoint import manifest
    from zerodp.errors import CheckpointError

    files_dir = dcp_dir if key == "dcp" else ds_run[0] / key / "global_step3"
    step = _zerodp_step_around(files_dir, tmp_path / "step_00000003", BLOCK)
    total = sum(p.stat().st_size for p in step.rglob("*") if p.is_file() and p.name != "meta.json")

    src = open_checkpoint(step, verify_deep=True, hash_beside_reads=True)
    want = {n: src.get(n) for n in src.param_names()}
    write_safetensors(src, tmp_path / "clean", progress=False)
    trained = [n for n in src.param_names() if src.has(n, "exp_avg")]
    moments = [r for n in trained for k in ("exp_avg", "exp_avg_sq") for r in src.locate(n, k).ranges]
    # every block wholly inside a moment is left out: at most the two partial blocks at its ends are hashed
    bound = total - sum(n for _, _, n in moments) + 2 * BLOCK * len(moments)
    assert src._check.hashed_bytes <= bound < total, (src._check.hashed_bytes, bound, total)
    moment = max(trained, key=lambda n: src.info(n).numel)
    path, at, n = src.locate(moment, "exp_avg_sq").ranges[0]
    _flip(path, at + n // 2)
    src = open_checkpoint(step, verify_deep=True, hash_beside_reads=True)
    out = load_file(write_safetensors(src, tmp_path / "moment-flipped", progress=False)[0])
    assert all(torch.equal(out[k], want[k]) for k in out)
    assert "fails its sha256 check" in manifest.verify(step)
    with pytest.raises(CheckpointError, match=r"fails its sha256 check \(corrupted in bytes"):
        write_zerodp(open_checkpoint(step, verify_deep=True, hash_beside_reads=True), tmp_path / "z", progress=False)

    path, at, n = src.locate(moment, "param").ranges[0]
    _flip(path, at + n // 2)
    with pytest.raises(CheckpointError, match=r"fails its sha256 check \(corrupted in bytes"):
        write_safetensors(open_checkpoint(step, verify_deep=True, hash_beside_reads=True), tmp_path / "w",
                          progress=False)
    assert not (tmp_path / "w").exists()
