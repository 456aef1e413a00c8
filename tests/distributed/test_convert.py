"""zerodp convert / inspect: round trips, sharding, safety (no pickled code runs), integrity, the CLI,
and a converted checkpoint that zerodp's own trainer resumes from."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.support.harness import run_distributed
from zerodp.checkpoint import store as checkpoint
from zerodp.cli.commands import main
from zerodp.convert import open_checkpoint, parse_size, write_safetensors, write_zerodp
from zerodp.errors import CheckpointError


def hf_model(path, n_layer=3):
    torch.manual_seed(0)
    t = {"transformer.wte.weight": torch.randn(50, 8), "transformer.wpe.weight": torch.randn(16, 8)}
    for i in range(n_layer):
        t[f"transformer.h.{i}.attn.c_attn.weight"] = torch.randn(24, 8)
        t[f"transformer.h.{i}.attn.c_attn.bias"] = torch.randn(24)
        t[f"transformer.h.{i}.mlp.c_fc.weight"] = torch.randn(32, 8)
    save_file(t, path, metadata={"origin": "test"})
    return t


def read_all(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as s:  # the official reader accepts what we wrote
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def test_safetensors_zerodp_safetensors_round_trip_is_bit_exact(tmp_path):
    ref = hf_model(tmp_path / "in.safetensors")
    src = open_checkpoint(tmp_path / "in.safetensors")
    assert src.format == "safetensors" and src.kinds() == ("param",)
    ckpt = write_zerodp(src, tmp_path / "z", step=7, progress=False)
    assert checkpoint.verify(ckpt) is None  # zerodp's own reader accepts it
    meta = checkpoint.read_meta(ckpt)
    assert meta["strategy"] == "single" and meta["world_size"] == 1 and meta["step"] == 7
    assert meta["params"]["transformer.wte.weight"] == {"shape": [50, 8], "dtype": "float32"}
    assert json.loads((ckpt / "optim.json").read_text()) == {"step": {}, "extra": {}}
    single = write_safetensors(open_checkpoint(ckpt), tmp_path / "one", progress=False)
    assert [p.name for p in single] == ["model.safetensors"]
    back = load_file(single[0])
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
    with safe_open(single[0], "pt") as f:
        md = f.metadata()
    assert md["format"] == "pt" and json.loads(md["zerodp.source"])["step"] == 7
    # Sharded output (HF names + index) holds exactly the single file's tensors.
    shards = write_safetensors(open_checkpoint(ckpt), tmp_path / "sharded", max_shard_size=parse_size("2KB"),
                               progress=False)
    names = sorted(p.name for p in shards)
    assert names[-1] == "model.safetensors.index.json"
    assert names[0] == f"model-00001-of-{len(shards) - 1:05d}.safetensors"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in ref.values())
    assert set(index["weight_map"]) == set(ref)
    sharded = read_all(tmp_path / "sharded")
    assert sharded.keys() == back.keys() and all(torch.equal(sharded[k], back[k]) for k in back)
    # ... and reads back through the index like any source.
    again = open_checkpoint(tmp_path / "sharded")
    assert again.meta["shards"] == len(shards) - 1
    assert all(torch.equal(again.get(k), ref[k]) for k in ref)


def test_dtype_cast_and_tied_weights_written_once(tmp_path):
    t = {"wte.weight": torch.randn(10, 4), "ln.weight": torch.randn(4)}
    save_file(t, tmp_path / "m.safetensors", metadata={"zerodp.tied": json.dumps({"head.weight": "wte.weight"})})
    src = open_checkpoint(tmp_path / "m.safetensors")
    assert src.tied() == {"head.weight": "wte.weight"}
    out = write_safetensors(src, tmp_path / "bf16", dtype="bf16", progress=False)
    got = load_file(out[0])
    assert set(got) == {"wte.weight", "ln.weight"} and got["wte.weight"].dtype == torch.bfloat16
    assert torch.equal(got["wte.weight"], t["wte.weight"].bfloat16())


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "x": Evil()}},
               tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt asks to load the global "
                                              r"posix\.system, which is not on zerodp's allowlist"):
        open_checkpoint(tmp_path / "ds")
    assert not marker.exists()
    # The same through the CLI: one line, exit 2, still nothing ran.
    assert main(["inspect", str(tmp_path / "ds")]) == 1
    assert main(["convert", str(tmp_path / "ds"), str(tmp_path / "out")]) == 2
    assert not marker.exists()


def test_malicious_dcp_metadata_is_refused_and_nothing_runs(tmp_path):
    """torch.distributed.checkpoint unpickles `.metadata` with plain pickle; zerodp does not."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(3)}, checkpoint_id=folder, no_dist=True)
    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata asks to load the global posix.system, which is not on "
                                              r"zerodp's allowlist"):
        open_checkpoint(folder)
    assert main(["inspect", str(folder)]) == 1
    assert not marker.exists()


def test_pickle_protocol_tricks_are_refused(tmp_path):
    from zerodp.convert.safeload import safe_torch_load

    for i, payload in enumerate([(eval, ("print('hi')",)), (shutil.rmtree, (str(tmp_path),))]):
        class Obj:
            def __reduce__(self, p=payload):
                return p

        f = tmp_path / f"bad{i}.pt"
        torch.save({"w": torch.ones(2), "o": Obj()}, f)
        with pytest.raises(CheckpointError, match=rf"bad{i}\.pt asks to load the global (eval|shutil\.rmtree), which"):
            safe_torch_load(f)
    assert tmp_path.exists()


def test_truncated_and_corrupted_files_are_named(tmp_path, capsys):
    hf_model(tmp_path / "in.safetensors")
    ckpt = write_zerodp(open_checkpoint(tmp_path / "in.safetensors"), tmp_path / "z", progress=False)
    sharded = tmp_path / "sharded"
    write_safetensors(open_checkpoint(ckpt), sharded, max_shard_size=2000, progress=False)
    # A truncated shard: its header no longer matches the file size.
    shard = sorted(sharded.glob("model-00002-of-*.safetensors"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-16])
    with pytest.raises(CheckpointError, match=rf"{shard.name} has {size - 16} bytes but its "
                                              rf"header describes {size} \(truncated or overwritten\)"):
        open_checkpoint(sharded)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name} is missing"):
        open_checkpoint(sharded)
    # A flipped byte in a zerodp checkpoint: same size, caught by the manifest's sha256.
    model = ckpt / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0x10
    model.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"z/model\.safetensors fails its sha256 check \(corrupted\)"):
        open_checkpoint(ckpt, verify_deep=True)
    # `zerodp convert` hashes beside its reads: the damage is named, exit 2, and nothing is published
    # (neither a new DST nor the staging folder). (--to hf needs a model config this checkpoint lacks.)
    for to in ("safetensors", "zerodp"):
        dst = tmp_path / f"from-damaged-{to}"
        assert main(["convert", str(ckpt), str(dst), "--to", to, "--no-progress"]) == 2
        assert "model.safetensors fails its sha256 check (corrupted)" in capsys.readouterr().err, to
        assert not dst.exists() and not list(tmp_path.glob(f".from-damaged-{to}*"))
    # A truncated torch pickle (zip) is refused with its name.
    pt = tmp_path / "t.pt"
    torch.save({"a": torch.ones(1000)}, pt)
    pt.write_bytes(pt.read_bytes()[:3000])
    from zerodp.convert.safeload import safe_torch_load

    with pytest.raises(CheckpointError, match=r"t\.pt is truncated or corrupted"):
        safe_torch_load(pt)


def one_line_error(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zerodp: error: "), err
    assert match in err, err


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    hf_model(tmp_path / "in.safetensors")
    src = str(tmp_path / "in.safetensors")
    one_line_error(capsys, ["convert", str(tmp_path / "nope"), str(tmp_path / "o")],
                   f"zerodp: error: {tmp_path / 'nope'} does not exist; pass a checkpoint folder or .safetensors file")
    (tmp_path / "empty").mkdir()
    one_line_error(capsys, ["convert", str(tmp_path / "empty"), str(tmp_path / "o")],
                   "is not a checkpoint zerodp recognises: no meta.json or checkpoints/latest (zerodp)")
    (tmp_path / "x.bin").write_bytes(b"junk")
    one_line_error(capsys, ["inspect", str(tmp_path / "nope")], "does not exist")
    one_line_error(capsys, ["convert", str(tmp_path / "x.bin"), str(tmp_path / "o")], "is not a format zerodp reads")
    one_line_error(capsys, ["convert", src, str(tmp_path / "o"), "--dtype", "fp8"],
                   "--dtype fp8 is not supported; use fp32, bf16 or fp16")
    one_line_error(capsys, ["convert", src, str(tmp_path / "o"), "--max-shard-size", "lots"],
                   "--max-shard-size 'lots' is not a size; write it like 5GB, 500MB or 10MiB")
    one_line_error(capsys, ["convert", src, str(tmp_path / "o"), "--to", "gguf"],
                   "--to gguf is not a target; use --to safetensors or --to zerodp")
    assert main(["convert", src, str(tmp_path / "o"), "--no-progress"]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["convert", src, str(tmp_path / "o")],
                   "already exists and is not empty; choose a new folder or pass --overwrite")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("10MiB") == 10 * 2**20 and parse_size("123") == 123


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ):
    """A real zerodp checkpoint (strategy single, step 2) and the uninterrupted 4-step run's losses."""
    from tests.conftest import TINY

    out = tmp_path_factory.mktemp("train")
    over = TINY + ["strategy.name=single", "train.max_steps=4"]
    straight, split = run_distributed("tests.support.workers:train_runs", 1, {"runs": [
        {"overrides": over + [f"train.out_dir={out / 'straight'}"]},
        {"overrides": over + [f"train.out_dir={out / 'split'}", "train.max_steps=2", "checkpoint.every=2"]},
    ]})[0]
    return out, straight, split


def test_inspect_reports_a_zerodp_checkpoint(trained, capsys):
    out, _, _ = trained
    assert main(["inspect", str(out / "split")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"path:        {out / 'split' / 'checkpoints' / 'step_00000002'}"
    assert lines[1:6] == ["format:      zerodp (safetensors layout)", "strategy:    single", "world size:  1",
                          "step:        2", "parameters:  34,688 in 28 tensors"]
    assert lines[6:9] == ["dtypes:      float32 (28)", "tied:        lm_head.weight -> transformer.wte.weight",
                          "optimizer:   exp_avg, exp_avg_sq, step"]
    assert lines[9].startswith("files:       ") and lines[10] == "integrity:   ok: every file present and intact"


def test_inspect_reports_damage(trained, tmp_path, capsys):
    out, _, _ = trained
    ckpt = tmp_path / "step_00000002"
    shutil.copytree(out / "split" / "checkpoints" / "step_00000002", ckpt)
    f = ckpt / "optim.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))
    assert main(["inspect", str(ckpt)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"integrity:   DAMAGED: {f} fails its sha256 check (corrupted)"


def test_converted_checkpoint_resumes_in_zerodp(trained, tmp_path):
    from tests.conftest import TINY

    out, straight, split = trained
    src = open_checkpoint(out / "split")  # an out_dir: follows checkpoints/latest
    assert src.format == "zerodp" and src.step() == 2.0 and src.meta["strategy"] == "single"
    dst = tmp_path / "run" / "checkpoints" / "step_00000002"
    write_zerodp(src, dst, progress=False)
    (dst.parent / "latest").write_text("step_00000002\n")
    orig = out / "split" / "checkpoints" / "step_00000002"
    assert load_file(dst / "model.safetensors").keys() == load_file(orig / "model.safetensors").keys()
    assert (dst / "optim.safetensors").read_bytes() != b""
    a, b = load_file(dst / "optim.safetensors"), load_file(orig / "optim.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((dst / "optim.json").read_text())["step"] == json.loads((orig / "optim.json").read_text())["step"]
    resumed = run_distributed("tests.support.workers:train_runs", 1, {"runs": [{
        "overrides": TINY + ["strategy.name=single", "train.max_steps=4", f"train.out_dir={tmp_path / 'run'}"],
        "fresh": False}]})[0][0]
    assert split["losses"] + resumed["losses"] == straight["losses"]  # bit-identical continuation


def test_a_small_conversion_says_its_size_in_a_unit_that_shows_it(tmp_path, capsys):
    """40,000 bytes of tensors are "39.1 KiB", not "0 MB" (and a bare count of bytes below 1 KiB is bytes)."""
    from zerodp.convert.cli import binary_size

    save_file({"w": torch.zeros(100, 100)}, str(tmp_path / "in.safetensors"))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "in.safetensors"), str(tmp_path / "o"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    written = sum(f.stat().st_size for f in (tmp_path / "o").rglob("*") if f.is_file())
    assert f"(1 tensor) to 1 file in {tmp_path / 'o'} ({binary_size(written)} in " in out, out
    assert binary_size(written).endswith(" KiB") and re.search(r" in [0-9.]+s, [0-9.,]+ (B|KiB|MiB)/s\)$", out.strip())
    assert [binary_size(n) for n in (812, 40_080, 5 * 2**20 + 1, 1.5 * 2**30, 2000 * 2**40)] == \
        ["812 B", "39.1 KiB", "5 MiB", "1.5 GiB", "2,000 TiB"]


def test_a_prepare_folder_is_training_data_not_a_damaged_checkpoint(tmp_path, capsys):
    """`zerodp convert`/`inspect` of a `zerodp prepare` output (the folder or a file in it) say what it is and
    what to do in one line, exit 2, where they called it an incomplete checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|endoftext|>": 1, **{f"w{i}": i + 2 for i in range(50)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w2 w3 w4")
    data = tmp_path / "data"
    assert main(["prepare", str(tmp_path / "a.txt"), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out",
                 str(data), "--val-fraction", "0", "--no-progress"]) == 0
    capsys.readouterr()
    said = "is training data, not a checkpoint: "
    for argv in (["inspect", str(data)], ["convert", str(data), str(tmp_path / "o")],
                 ["convert", str(data / "meta.json"), str(tmp_path / "o")], ["inspect", str(data / "train.bin")]):
        one_line_error(capsys, argv, f"zerodp: error: {argv[1]} {said}")
    one_line_error(capsys, ["inspect", str(data)], f"a `zerodp prepare` folder (5 tokens in train.bin and val.bin); "
                                                   f"train on it with data.source={data}, and give zerodp inspect a "
                                                   f"run's checkpoint")
    assert not (tmp_path / "o").exists()
