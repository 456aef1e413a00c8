"""ZeRO++ under zerodp's zero3 (docs/strategies.md, "ZeRO++"): the generated DeepSpeed keys (pure), every
refusal of a setting that cannot run or help, and one real run of hpZ on 4 processes (gloo, the real
engine), emulating 2 nodes of 2 ranks (LOCAL_WORLD_SIZE=2): it follows the plain single-process AdamW
reference as zero3 does, saves, resumes under hpZ bit for bit and resumes under ddp. qwZ and qgZ need
DeepSpeed's quantizer kernels, which its CPU accelerator lacks: refused here, measured on GPUs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY
from tests.distributed.test_cli import one_line_error
from tests.support.harness import ROOT, base_env, run_distributed
from tests.support.reference import reference_run
from zerodp.config import ConfigError, load_config
from zerodp.errors import UserError
from zerodp.strategies import check_config
from zerodp.strategies.zero import deepspeed_config

WORLD, NODE, STEPS = 4, 2, 6
TOLERANCE = 1e-5
"""hpZ vs the fp32 reference, losses and weights over STEPS steps: the zero3 bound of
tests/distributed/test_equivalence.py. Measured 6.0e-07 (losses) and 5.7e-07 (weights): hpZ changes where a gather
reads from, not the sums."""
QUANTIZED_BAND = 0.05
"""GPU only, a bound chosen, not measured (DeepSpeed's CPU accelerator has no quantizer): max |loss(bf16
qwZ/qgZ) - loss(fp32 reference)| over STEPS steps; zero3's own bf16 gap is 0.0043 (tests/distributed/test_zero.py)."""
# shard everything: the tiny model's tensors are below DeepSpeed's persistence threshold (1e5
# elements), and a persistent parameter stays gathered, so no gather would read the secondary copy
SHARD_ALL = "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0"
BASE = TINY + [f"train.global_batch_size={2 * WORLD}", "optim.lr=1e-3", "optim.min_lr=1e-4", "optim.decay_steps=10"]
HPZ = BASE + ["strategy.name=zero3", f"strategy.hpz_partition_size={NODE}", SHARD_ALL]
LORA = ["model.lora.rank=4"]  # every linear layer of the blocks


def cfg_of(*overrides: str):
    """The tiny config under zero3 (the refusals of zero1/2 are asked of deepspeed_config's stage)."""
    return load_config(None, TINY + ["train.global_batch_size=8", "strategy.name=zero3", *overrides])


# ---------------------------------------------------------------------------------------------------
# The generated config and the refusals (no processes)
# ---------------------------------------------------------------------------------------------------


def test_generated_config_has_the_zeropp_keys():
    z = deepspeed_config(cfg_of("strategy.name=zero3"), 3, 1, 4)["zero_optimization"]
    assert (z["zero_hpz_partition_size"], z["zero_quantized_weights"],
            z["zero_quantized_gradients"]) == (1, False, False)
    cfg = cfg_of("strategy.name=zero3", "strategy.hpz_partition_size=8", "strategy.quantized_weights=true",
                 "strategy.quantized_gradients=true")
    z = deepspeed_config(cfg, 3, 1, 32, ranks_per_node=8)["zero_optimization"]
    assert (z["zero_hpz_partition_size"], z["zero_quantized_weights"], z["zero_quantized_gradients"]) == (8, True, True)
    z = deepspeed_config(cfg_of("strategy.name=zero3", "strategy.hpz_partition_size=0"),
                         3, 1, 32, 8)["zero_optimization"]
    assert z["zero_hpz_partition_size"] == 8  # 0: the ranks of one node
    # a strategy.deepspeed key equal to zerodp's value is accepted, as for every owned key
    cfg = cfg_of("strategy.name=zero3", "strategy.hpz_partition_size=2",
                 "strategy.deepspeed.zero_optimization.zero_hpz_partition_size=2")
    assert deepspeed_config(cfg, 3, 1, 4, 2)["zero_optimization"]["zero_hpz_partition_size"] == 2


ONE_NODE = r"hpZ needs more than one node: {}, and on one node every rank already gathers over the fast link; " \
           r"remove strategy\.hpz_partition_size \(or set it to 1\), or set it to the ranks per node of a " \
           r"multi-node run"


@pytest.mark.parametrize("overrides, stage, world, node, match", [
    (["strategy.hpz_partition_size=2"], 2, 4, 2,
     r"^strategy\.hpz_partition_size=2: ZeRO\+\+ is DeepSpeed ZeRO-3's, not zero2's; set strategy\.name=zero3 or "
     r"remove the setting$"),
    (["strategy.quantized_weights=true", "strategy.quantized_gradients=true"], 1, 4, 2,
     r"^strategy\.quantized_weights=true, strategy\.quantized_gradients=true: ZeRO\+\+ is DeepSpeed ZeRO-3's, not "
     r"zero1's; set strategy\.name=zero3 or remove the settings$"),
    (["strategy.hpz_partition_size=3"], 3, 8, 4,
     r"^strategy\.hpz_partition_size=3 does not divide the world size 8; set it to the ranks per node \(a divisor "
     r"of 8\), or 0 for the launcher's LOCAL_WORLD_SIZE$"),
    (["strategy.hpz_partition_size=4"], 3, 4, None,
     "^strategy\\.hpz_partition_size=4: " + ONE_NODE.format("its group of 4 ranks is the whole world") + "$"),
    (["strategy.hpz_partition_size=2"], 3, 4, 4,
     "^strategy\\.hpz_partition_size=2: " + ONE_NODE.format("all 4 ranks are on one node") + "$"),
    (["strategy.hpz_partition_size=0"], 3, 8, 8,
     "^strategy\\.hpz_partition_size=0: " + ONE_NODE.format("all 8 ranks are on one node") + "$"),
    (["strategy.hpz_partition_size=2"], 3, 1, None,
     "^strategy\\.hpz_partition_size=2: " + ONE_NODE.format("this run has one rank") + "$"),
    (["strategy.hpz_partition_size=0"], 3, 16, None,
     r"^strategy\.hpz_partition_size=0 means the ranks of one node, and the launcher does not say how many that "
     r"is \(LOCAL_WORLD_SIZE or LOCAL_SIZE or OMPI_COMM_WORLD_LOCAL_SIZE unset\); set strategy\.hpz_partition_size "
     r"to the ranks per node$"),
    (["strategy.quantized_gradients=true"], 3, 8, 8,
     r"^strategy\.quantized_gradients=true: qgZ quantizes only the gradient reduction between nodes, and all 8 "
     r"ranks are on one node: DeepSpeed would reduce-scatter them unquantized; remove "
     r"strategy\.quantized_gradients, or use it on more than one node$"),
    (["strategy.deepspeed.zero_optimization.zero_hpz_partition_size=2"], 3, 4, 2,
     r"^strategy\.deepspeed\.zero_optimization\.zero_hpz_partition_size=2 contradicts zerodp's "
     r"zero_optimization\.zero_hpz_partition_size=1; remove the key and set strategy\.hpz_partition_size$"),
    (["strategy.deepspeed.zero_optimization.zero_quantized_weights=true"], 3, 4, 2,
     r"zero_quantized_weights=True contradicts zerodp's zero_optimization\.zero_quantized_weights=False; remove the "
     r"key and set strategy\.quantized_weights$"),
    (["strategy.deepspeed.zero_optimization.zero_quantized_gradients=true"], 3, 4, 2,
     r"zero_quantized_gradients=True contradicts .*; remove the key and set strategy\.quantized_gradients$"),
])
def test_zeropp_refusals(overrides, stage, world, node, match):
    with pytest.raises(UserError, match=match):
        deepspeed_config(cfg_of(*overrides), stage, 1, world, node)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "single", "zero2", "auto"])
def test_zeropp_under_another_strategy_is_refused_when_loading(name):
    which = "strategy\\.name=auto never chooses it" if name == "auto" else f"not {name}'s"
    with pytest.raises(ConfigError, match=rf"^strategy\.hpz_partition_size=8: ZeRO\+\+ is DeepSpeed ZeRO-3's, "
                                          rf"{which}; set strategy\.name=zero3 or remove the setting$"):
        cfg_of(f"strategy.name={name}", "strategy.hpz_partition_size=8")
    with pytest.raises(ConfigError, match=r"^strategy\.hpz_partition_size=-1 must not be negative \(1 turns hpZ off, "
                                          r"0 takes the ranks of one node\)$"):
        cfg_of("strategy.name=zero3", "strategy.hpz_partition_size=-1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed's CPU accelerator is the one without the quantizer")
@pytest.mark.parametrize("key", ["quantized_weights", "quantized_gradients"])
def test_quantized_communication_on_cpu_is_refused(key, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes of two ranks: nothing else stands in the way
    with pytest.raises(UserError, match=rf"^strategy\.{key}=true: DeepSpeed's cpu accelerator has no quantizer kernels "
                                        rf"\(QuantizerBuilder\), which ZeRO\+\+'s quantized communication runs on; "
                                        rf"set strategy\.{key}=false here, or run zero3 on GPUs$"):
        check_config(cfg_of("strategy.name=zero3", f"strategy.{key}=true"), 4, 1)


def test_dry_run_refuses_hpz_on_one_node_in_one_line(tmp_path):
    """`zerodp train --dry-run` runs the same check as setup, with the launcher's variables of 4 ranks on
    one node: one line on stderr, exit 2."""
    env = dict(base_env(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    r = subprocess.run([sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", "--dry-run", *BASE,
                        "strategy.name=zero3", f"strategy.hpz_partition_size={NODE}", f"train.out_dir={tmp_path}"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    one_line_error(r, f"^zerodp: error: strategy\\.hpz_partition_size={NODE}: "
                      + ONE_NODE.format(f"all {WORLD} ranks are on one node") + "$")


# ---------------------------------------------------------------------------------------------------
# One real hpZ run on 4 processes, reused by the assertions below
# ---------------------------------------------------------------------------------------------------


def hpz_worker(runs: list[dict]) -> dict:
    """tests.support.workers.train_runs, counting the hpZ secondary partitions DeepSpeed builds (each from a
    gathered parameter, for the gathers that follow to read) and the size of the group they are split
    over. A run with "copy" first gets a copy of that run directory's checkpoints (rank 0 copies)."""
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import Init

    from tests.support.workers import train_runs

    built, real = [], Init._partition_param_sec

    def counting(self, param, *args, **kwargs):
        real(self, param, *args, **kwargs)
        if param.ds_secondary_tensor is not None:
            built.append(self.num_ranks_in_param_group)

    Init._partition_param_sec = counting
    results, secondary = [], []
    try:
        for run in runs:
            if "copy" in run and dist.get_rank() == 0:
                out_dir = next(o.split("=", 1)[1] for o in run["overrides"] if o.startswith("train.out_dir="))
                shutil.copytree(Path(run["copy"]) / "checkpoints", Path(out_dir) / "checkpoints")
            dist.barrier()
            before = len(built)
            results += train_runs([run])
            secondary.append(built[before:])
    finally:
        Init._partition_param_sec = real
    return {"results": results, "secondary": [(len(s), sorted(set(s))) for s in secondary]}


@pytest.fixture(scope="module")
def hpz_run(tmp_path_factory):
    """STEPS steps of hpZ; half of them with a checkpoint; that checkpoint resumed to STEPS under ddp (a
    copy) and under hpZ; one step of plain zero3. The launcher's LOCAL_WORLD_SIZE=2 makes 2 nodes of the
    4 local ranks."""
    tmp = tmp_path_factory.mktemp("hpz")
    runs = [
        {"overrides": HPZ + [f"train.max_steps={STEPS}", f"train.out_dir={tmp / 'full'}"]},
        {"overrides": HPZ + [f"train.max_steps={STEPS // 2}", f"train.out_dir={tmp / 'part'}"]},
        {"overrides": BASE + ["strategy.name=ddp", f"train.max_steps={STEPS}", f"train.out_dir={tmp / 'ddp'}"],
         "copy": str(tmp / "part"), "fresh": False},
        # hpz_partition_size=0: the launcher's LOCAL_WORLD_SIZE
        {"overrides": HPZ + ["strategy.hpz_partition_size=0", f"train.max_steps={STEPS}",
                             f"train.out_dir={tmp / 'part'}"],
         "fresh": False},
        # plain zero3 after hpZ in the same process: DeepSpeed's hpZ group must not carry over
        {"overrides": BASE + ["strategy.name=zero3", SHARD_ALL, "train.max_steps=1", f"train.out_dir={tmp / 'plain'}"]},
        # LoRA under hpZ: the frozen base's gathers read the secondary copy too
        {"overrides": HPZ + LORA + [f"train.max_steps={STEPS}", f"train.out_dir={tmp / 'lora'}"]},
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCAL_WORLD_SIZE", str(NODE))
        ranks = run_distributed("tests.distributed.test_zeropp:hpz_worker", WORLD, {"runs": runs})
    return ranks, reference_run(load_config(None, BASE + [f"train.max_steps={STEPS}"]))


@pytest.fixture(scope="module")
def lora_reference():
    return reference_run(load_config(None, BASE + LORA + [f"train.max_steps={STEPS}"]))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_hpz_follows_single_process_adamw(hpz_run):
    ranks, (ref_losses, ref_weights) = hpz_run
    full = ranks[0]["results"][0]
    assert full["strategy"] == "zero3" and len(full["losses"]) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(full["losses"], ref_losses))
    weight_diff = max_diff(full["weights"], ref_weights)
    print(f"hpZ world={WORLD} node={NODE}: max |loss diff| {loss_diff:.2e}, max |param diff| {weight_diff:.2e}")
    assert loss_diff < TOLERANCE and weight_diff < TOLERANCE, (loss_diff, weight_diff)
    assert all(max_diff(r["results"][0]["weights"], full["weights"]) == 0 for r in ranks), "ranks disagree"


def test_hpz_gathers_read_a_secondary_copy_split_over_one_node(hpz_run):
    ranks, _ = hpz_run
    for rank in ranks:
        built, groups = rank["secondary"][0]
        # every parameter, again after every step (DeepSpeed drops the copy when the weights change)
        assert built >= STEPS * len(rank["results"][0]["weights"]) and groups == [NODE], rank["secondary"]
    assert ranks[0]["secondary"][2] == (0, [])  # the ddp run has none
    assert ranks[0]["secondary"][3][1] == [NODE]  # hpz_partition_size=0: the node the launcher names
    assert ranks[0]["secondary"][4] == (0, [])  # nor zero3 without hpZ, run after hpZ in the same process


def test_hpz_checkpoint_resumes_exactly_and_under_ddp(hpz_run):
    ranks, (ref_losses, ref_weights) = hpz_run
    full, part, ddp, again = ranks[0]["results"][:4]
    assert part["losses"] == full["losses"][: STEPS // 2]
    # hpZ -> hpZ: the same strategy and world, the same bits as the uninterrupted run
    assert again["losses"] == full["losses"][STEPS // 2:] and max_diff(again["weights"], full["weights"]) == 0
    # hpZ (DeepSpeed's files) -> ddp: full fp32 weights and moments, then ddp's own sums
    assert ddp["strategy"] == "ddp" and len(ddp["losses"]) == STEPS // 2
    assert ddp["losses"] == pytest.approx(ref_losses[STEPS // 2:], abs=TOLERANCE)
    assert max_diff(ddp["weights"], ref_weights) < TOLERANCE


# ---------------------------------------------------------------------------------------------------
# GPUs: qwZ and qgZ (skipped on machines without them)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu(2)
def test_quantized_communication_stays_near_the_reference(tmp_path):
    """qwZ (int8 weights in the all-gathers) and qgZ (int4 gradients in the reduction) on 2 GPUs, in
    bf16, against the fp32 reference. LOCAL_WORLD_SIZE=1 tells zerodp there are 2 nodes; DeepSpeed
    counts nodes as world // visible GPUs, so on one machine whose ranks see both GPUs its qgZ falls
    back to a plain reduce-scatter, and the third run measures qwZ alone again."""
    over = TINY + ["train.global_batch_size=4", f"train.max_steps={STEPS}", "optim.lr=1e-3", "optim.min_lr=1e-4",
                   "train.precision=bf16", "strategy.name=zero3", SHARD_ALL]
    runs = [{"overrides": over + [f"train.out_dir={tmp_path / 'bf16'}"]},
            {"overrides": over + ["strategy.quantized_weights=true", f"train.out_dir={tmp_path / 'qw'}"]},
            {"overrides": over + ["strategy.quantized_weights=true", "strategy.quantized_gradients=true",
                                  f"train.out_dir={tmp_path / 'qwqg'}"]}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCAL_WORLD_SIZE", "1")
        results = run_distributed("tests.support.workers:train_runs", 2, {"runs": runs}, device="cuda")[0]
    ref_losses, _ = reference_run(load_config(None, over))  # fp32: the reference ignores precision
    gaps = {label: max(abs(a - b) for a, b in zip(r["losses"], ref_losses))
            for label, r in zip(("bf16", "qwZ", "qwZ+qgZ"), results)}
    print(f"max |loss - fp32 reference| over {STEPS} steps: {gaps}")
    assert all(gap < QUANTIZED_BAND for gap in gaps.values()), gaps


def test_lora_under_hpz_follows_single_process_adamw(hpz_run, lora_reference):
    """LoRA under hpZ (issue 45 item 13): the adapters train as the single-process reference trains them, within
    zero3's 1e-5, the frozen base as it was, and the gathers read the secondary copies of a node."""
    ranks, _ = hpz_run
    got, (ref_losses, ref_weights) = ranks[0]["results"][5], lora_reference
    adapters = [n for n in ref_weights if "lora_" in n]
    assert adapters and len(got["losses"]) == STEPS
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
    weight_diff = max_diff(got["weights"], ref_weights)  # the base: the seeded start in both
    print(f"LoRA under hpZ: max |loss diff| {loss_diff:.2e}, max |param diff| {weight_diff:.2e}")
    assert loss_diff < TOLERANCE and weight_diff < TOLERANCE, (loss_diff, weight_diff)
    built, groups = ranks[0]["secondary"][5]
    assert built > 0 and groups == [NODE], ranks[0]["secondary"][5]
