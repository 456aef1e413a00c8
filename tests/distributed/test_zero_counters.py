"""DeepSpeed's own counters follow zerodp's step across a resume (issue 9, item 6).

The engine saves global_steps, global_samples and skipped_steps in its model-states file and AdamW's
step per param group in each rank's optimizer file. zerodp resumes a ZeRO run without DeepSpeed's
loader, so unless it sets them they restart at 0: a run resumed at step 4 and saved at 6 would write
`global_steps: 2`, and importing that DeepSpeed folder (`zerodp convert ds_out/ ... --to zerodp`,
docs/checkpoints.md) would resume at step 2, replaying data and learning rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.harness import run_distributed
from zerodp.cli.commands import main as zerodp_main
from zerodp.convert.deepspeed_ckpt import DeepSpeedSource
from zerodp.convert.safeload import safe_torch_load

GLOBAL_BATCH = 8


def train_then_probe(runs: list[dict], probes: list[dict]) -> list[dict]:
    """Do `runs` in turn (train: {overrides, fresh}; or import: {src, dst, step}, rank 0 converting a
    model.safetensors into a zerodp checkpoint); then per probe {strategy, ckpt, overrides, init} set
    up a fresh strategy, load the checkpoint as a resume does (or with `init`, as model.init_from
    does) and report the live engine's counters."""
    import torch.distributed as dist

    from zerodp.checkpoint import store as checkpoint
    from zerodp.config import load_config
    from zerodp.convert import open_checkpoint, write_zerodp
    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy
    from zerodp.trainer.loop import train

    for run in runs:
        if "import" in run:
            if dist.get_rank() == 0:
                with open_checkpoint(run["import"]["src"]) as src:
                    write_zerodp(src, run["import"]["dst"], step=run["import"]["step"], progress=False)
            dist.barrier()
        else:
            train(load_config(None, run["overrides"]), fresh=run["fresh"])
    report = []
    for probe in probes:
        cfg = load_config(None, probe["overrides"])
        world = dist.get_world_size()
        strategy = make_strategy(probe["strategy"])
        torch.manual_seed(0)
        strategy.setup(build_model(cfg.model, device="meta"), RunContext(cfg, dist.get_rank(), world, dist.get_rank(),
                                                  torch.device("cpu"), cfg.check_batch_split(world)))
        if probe.get("init"):
            checkpoint.init_from(strategy, probe["ckpt"])
        else:
            checkpoint.load(strategy, Path(probe["ckpt"]), world)
        engine = strategy.model
        report.append({
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "adam_steps": [float(s["step"]) for s in strategy.optimizer.state.values() if s],
        })
    return report


def saved_counters(ds_dir: Path) -> dict:
    """What the DeepSpeed folder records, read through zerodp's own (pickle-safe) reader."""
    src = DeepSpeedSource(ds_dir)
    states = safe_torch_load(src.model_file)
    adam = [float(s["step"]) for r in range(src.world)
            for s in src.ranks.osd(r)["base_optimizer_state" if src.stage <= 2 else "optimizer_state_dict"]
            ["state"].values()]
    return {"global_steps": src.meta["step"], "global_samples": states["global_samples"],
            "skipped_steps": states["skipped_steps"], "adam_steps": adam}


# (out_dir name, strategy of steps 1-4, strategy resuming to 6, AdamW steps saved at 6)
CASES = [
    ("zero1-zero1", "zero1", "zero1", 6.0),  # same strategy and world size: ZeroStrategy.load
    ("zero2-zero2", "zero2", "zero2", 6.0),
    ("zero3-zero3", "zero3", "zero3", 6.0),
    ("ddp-zero2", "ddp", "zero2", 6.0),  # another strategy: checkpoint.load -> load_full
    ("import-zero2", None, "zero2", 2.0),  # weights only (docs: resume an import): AdamW starts fresh
]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Every case trained 4 steps (or imported at step 4) then resumed to 6, in one process group,
    and each step-4 checkpoint loaded again into a fresh strategy to read the live counters."""
    from tests.conftest import TINY

    tmp = tmp_path_factory.mktemp("counters")
    base = TINY + [f"train.global_batch_size={GLOBAL_BATCH}", "optim.decay_steps=10"]
    runs, probes = [], []
    for name, first, then, _ in CASES:
        out = tmp / name
        if first is None:
            weights = tmp / "ddp-zero2" / "checkpoints" / "step_00000004" / "model.safetensors"
            runs.append({"import": {"src": str(weights), "dst": str(out / "checkpoints" / "step_00000004"),
                                    "step": 4}})
        else:
            runs.append({"overrides": base + [f"strategy.name={first}", "train.max_steps=4",
                                              f"train.out_dir={out}"], "fresh": True})
        again = base + [f"strategy.name={then}", f"train.out_dir={out}"]
        runs.append({"overrides": again + ["train.max_steps=6"], "fresh": False})
        probes.append({"strategy": then, "ckpt": str(out / "checkpoints" / "step_00000004"), "overrides": again})
    # the import reads the ddp run's step 4, so that run goes first
    order = [3, 4, 0, 1, 2]
    runs = [r for i in order for r in runs[2 * i : 2 * i + 2]]
    probes.append({"strategy": "zero2", "ckpt": str(tmp / "zero2-zero2" / "checkpoints" / "step_00000006"),
                   "overrides": base + ["strategy.name=zero2", f"train.out_dir={tmp / 'init'}"], "init": True})
    live = run_distributed("tests.distributed.test_zero_counters:train_then_probe", 2, {"runs": runs, "probes": probes})
    return tmp, live


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c[0] for c in CASES])
def test_resumed_run_saves_the_zerodp_step_in_deepspeeds_counters(resumed, i):
    tmp, live = resumed
    name, _, _, adam = CASES[i]
    saved = saved_counters(tmp / name / "checkpoints" / "step_00000006" / "deepspeed")
    assert saved["adam_steps"] and set(saved["adam_steps"]) == {adam}, name
    del saved["adam_steps"]
    assert saved == {"global_steps": 6, "global_samples": 6 * GLOBAL_BATCH, "skipped_steps": 0}, name
    for rank in live:  # right after loading step 4, before any step: every counter at 4 on every rank
        got = rank[i]
        assert (got["global_steps"], got["global_samples"], got["skipped_steps"], got["micro_steps"]) == \
            (4, 4 * GLOBAL_BATCH, 0, 4), name
        assert set(got["adam_steps"]) == ({4.0} if adam == 6.0 else set()), name


def test_init_from_weights_leaves_the_counters_at_zero(resumed):
    """model.init_from starts a run at step 0 from a checkpoint's weights, whatever step it was saved at."""
    _, live = resumed
    for rank in live:
        assert rank[len(CASES)] == {"global_steps": 0, "global_samples": 0, "skipped_steps": 0, "micro_steps": 0,
                                    "adam_steps": []}


@pytest.mark.parametrize("name", ["zero2-zero2", "ddp-zero2"])
def test_documented_import_of_the_deepspeed_folder_resumes_at_the_right_step(resumed, name, capsys):
    """docs/checkpoints.md: `zerodp convert ds_out/ runs/imported/checkpoints/step_... --to zerodp`."""
    import json

    tmp, _ = resumed
    src = tmp / name / "checkpoints" / "step_00000006" / "deepspeed"
    assert zerodp_main(["inspect", str(src)]) == 0
    assert "step:        6" in capsys.readouterr().out
    dst = tmp / f"imported-{name}"
    assert zerodp_main(["convert", str(src), str(dst), "--to", "zerodp", "--no-progress"]) == 0
    assert json.loads((dst / "meta.json").read_text())["step"] == 6
    assert json.loads((dst / "trainer.json").read_text())["step"] == 6
