"""`zerodp verify` on 2 processes (the launcher's: both runs train in one process group), on the tiny
configs of both families (configs/tiny.yaml, configs/llama-tiny.yaml at the suite's tiny shapes): ddp
against zero1, zero2, zero3 and fsdp follows one trajectory (exit 0); another seed or another lr does
not (exit 1), and the line names the first step that differs: step 1 for a seed (other weights, other
batches), step 2 for an lr (the first loss is taken before the first update). World 2 against 1
(`--nproc 2 --against nproc=1`: verify launches each run itself, under torchrun for 2) passes for
both families: 4 process starts each, 10 to 30 s on 2 shared cores. Dropout on throughout: the gpt2
runs with model.dropout=0.1, and the llama at world 2 against 1 is the shipped LoRA recipe,
configs/sft-llama-lora.yaml (its adapters' dropout 0.05), at the tiny shapes: zerodp.models.dropout
keys each mask by the global row, so neither the world size nor the strategy changes which units drop.
The temporary runs are removed, but with --keep (llama against fsdp), which keeps both and says where."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from tests.support.harness import run_distributed
from zerodp.cli.commands import main

SMALL = [o for o in TINY if not o.startswith("train.global_batch_size")] + ["train.global_batch_size=4"]
CONFIGS = {"gpt2": "configs/tiny.yaml", "llama": "configs/llama-tiny.yaml"}
DROPOUT = {"gpt2": ["model.dropout=0.1"], "llama": []}  # keyed dropout: the same masks under every layout
# the shipped LoRA recipe (adapter dropout 0.05, document masking) at the suite's tiny shapes, fp32, on the
# built-in corpus: no Hugging Face folder, no prepared data
SFT_LORA = ("configs/sft-llama-lora.yaml", ["model.hf_config=", "model.init_from=", "model.arch=llama",
                                             "train.precision=fp32", "data.source=builtin"])
STRATEGIES = ["zero1", "zero2", "zero3", "fsdp"]
CHANGES = {**{f"{family} {name}": (family, f"strategy.name={name}") for family in CONFIGS for name in STRATEGIES},
           "gpt2 seed": ("gpt2", "train.seed=7"), "gpt2 lr": ("gpt2", "optim.lr=5e-3")}
KEEP = "llama fsdp"


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verify")
    calls = [[CONFIGS[family], *SMALL, *DROPOUT[family], "strategy.name=ddp",
              f"train.out_dir={tmp / case.replace(' ', '-') / 'run'}",
              "--against", change, "--steps", "3", *(["--keep"] if case == KEEP else [])]
             for case, (family, change) in CHANGES.items()]
    results = run_distributed("tests.support.verify_workers:verify", 2, {"calls": calls})
    return tmp, dict(zip(CHANGES, results[0])), dict(zip(CHANGES, results[1]))


@pytest.mark.parametrize("case", [c for c in CHANGES if c.split()[1] in STRATEGIES])
def test_ddp_against_every_sharding_strategy_passes(verified, case):
    tmp, rank0, rank1 = verified
    got = rank0[case]
    assert got["code"] == 0 and rank1[case]["code"] == 0, got["stdout"]
    assert "PASS: 3 steps and" in got["stdout"], got["stdout"]
    assert "fp32: the equivalence suite's 1e-5" in got["stdout"]
    # the two trainings' own lines are not the command's: only verify's (before: both runs' whole logs)
    assert [line.split(" steps ")[0] for line in got["stderr"].splitlines()] == [
        "zerodp verify: training 3", "zerodp verify: training 3"], got["stderr"]
    left = list((tmp / case.replace(" ", "-")).iterdir())
    if case != KEEP:
        assert left == [], "verify left its runs behind"
        return
    [kept] = left
    assert f"both runs kept in {kept} (a: as written, b: against)" in got["stdout"], got["stdout"]
    assert all((kept / run / "checkpoints" / "latest").is_file() for run in "ab"), sorted(kept.rglob("*"))
    assert "zerodp: strategy ddp on 2 process(es)" in (kept / "a.log").read_text()  # kept with the runs


@pytest.mark.parametrize("case, first", [("gpt2 seed", 1), ("gpt2 lr", 2)])
def test_a_real_change_fails_naming_the_first_step(verified, case, first):
    _, rank0, rank1 = verified
    got = rank0[case]
    assert got["code"] == 1 and rank1[case]["code"] == 1, got["stdout"]
    assert f"FAIL: the first differing step is {first} " in got["stdout"], got["stdout"]
    assert "tensors differ, most: " in got["stdout"], got["stdout"]


@pytest.mark.parametrize("case", ["gpt2 dropout", "llama sft-lora"])
def test_world_2_against_1_passes(case, tmp_path, capsys):
    config, extra = (CONFIGS["gpt2"], DROPOUT["gpt2"]) if case == "gpt2 dropout" else SFT_LORA
    code = main(["verify", config, *SMALL, *extra, "strategy.name=ddp", f"train.out_dir={tmp_path / 'run'}",
                 "--nproc", "2", "--against", "nproc=1", "--steps", "3"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "training 3 steps as written on 2 process(es)" in out.err and "on 1 process(es)" in out.err, out.err
    assert "PASS: 3 steps and" in out.out, out.out
    assert list(tmp_path.iterdir()) == [], "verify left its runs behind"
