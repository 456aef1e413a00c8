"""train.objective=dpo at world 2 and 3 follows the single-process run on the same global batches of pairs
(global batch 12 rows = 6 pairs, micro batches of 2: accumulation 6, 3 and 2 at world 1, 2 and 3): under
ddp at world 2 each loss type (sigmoid with label smoothing and the RPO term, ipo, simpo) with the live
frozen reference or none, and LoRA with the adapters switched off as the reference; for sigmoid and LoRA
also zero3 and fsdp at world 2 (the live reference a second instance of the strategy, sharded as the
policy) and ddp and zero3 at world 3; the precomputed reference (its pass run under zero3 and fsdp at
world 2) gives the live reference's trajectory. Per-step losses, the final weights and the logged rewards, on the
training and the validation pairs, agree within test_equivalence.py's 1e-5. One launch per world size
runs every training."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.conftest import TINY
from tests.support.harness import run_distributed
from tests.unit.test_preference_train import preference_folder
from zerodp.models.lora_spec import is_adapter

TOLERANCE = 1e-5
STEPS = 3
BASE = [o for o in TINY if not o.startswith(("train.global_batch_size", "train.micro_batch_size"))] + [
    "train.global_batch_size=12", "train.micro_batch_size=2", f"train.max_steps={STEPS}", "optim.lr=3e-3",
    "data.packing=false", "train.objective=dpo", "train.log_every=1", "train.eval_every=3", "train.eval_batches=3"]
CASES = {"sigmoid": ["dpo.beta=0.5", "dpo.label_smoothing=0.1", "dpo.rpo_alpha=0.2"],
         "ipo": ["dpo.loss=ipo", "dpo.beta=0.5"],
         "simpo": ["dpo.loss=simpo", "dpo.beta=2.0", "dpo.simpo_gamma=0.3"],
         "lora": ["model.lora.rank=4", "model.lora.alpha=8", "dpo.beta=0.5"],
         "precomputed": ["dpo.beta=0.5", "dpo.label_smoothing=0.1", "dpo.rpo_alpha=0.2", "dpo.reference=precomputed"]}
STRATEGIES = {1: ["single"], 2: ["ddp", "zero3", "fsdp"], 3: ["ddp", "zero3"]}
SHARDED = ("sigmoid", "lora")  # the cases zero3 and fsdp run, and world 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    data = preference_folder(root / "pairs")
    results = {}
    for world, names in STRATEGIES.items():
        keys = [(case, name, world) for name in names for case in CASES
                if world < 3 and name in ("single", "ddp") or case in SHARDED
                or case == "precomputed" and name in ("zero3", "fsdp") and world == 2]
        plan = [{"overrides": BASE + CASES[case] + [f"data.source={source(root, data, case, name, world)}",
                                                    f"strategy.name={name}",
                                                    f"train.out_dir={root / f'{case}-{name}-{world}'}"]}
                for case, name, world in keys]
        got = run_distributed("tests.support.workers:train_runs", world, {"runs": plan})[0]
        for (case, name, world), result in zip(keys, got):
            out = root / f"{case}-{name}-{world}"
            results[(case, name, world)] = {**result, "metrics": [json.loads(x) for x in
                                                                  (out / "metrics.jsonl").read_text().splitlines()]}
    return results


def source(root, data, case, name, world):
    """The data folder of a run: its own copy for a precomputed reference, so that each run's pass, under
    its own strategy, computes the reference log-probs it trains with."""
    if case != "precomputed":
        return data
    own = root / f"pairs-{name}-{world}"
    shutil.copytree(data, own, dirs_exist_ok=True)
    return own


@pytest.mark.parametrize("case,name,world", [(c, "ddp", 2) for c in CASES] + [
    (c, n, w) for c in SHARDED for n, w in (("zero3", 2), ("fsdp", 2), ("ddp", 3), ("zero3", 3))] + [
    ("precomputed", "zero3", 2), ("precomputed", "fsdp", 2)])
def test_every_strategy_at_world_2_and_3_follows_one_process(runs, case, name, world):
    one, two = runs[(case, "single", 1)], runs[(case, name, world)]
    assert len(one["losses"]) == STEPS and two["strategy"] == name
    # the reference is the starting policy: every log-ratio is 0 at the first step
    first = {"ipo": (1 / (2 * 0.5)) ** 2, "lora": math.log(2)}
    if case == "precomputed":  # the same trajectory as the live reference's
        live = runs[("sigmoid", "single", 1)]
        assert max(abs(a - b) for a, b in zip(one["losses"], live["losses"])) < TOLERANCE
        assert abs(two["metrics"][-1]["val_loss"] - live["metrics"][-1]["val_loss"]) < TOLERANCE
    if case in first:
        assert one["losses"][0] == pytest.approx(first[case], abs=1e-6)
    if case == "sigmoid":  # ln 2 whatever the smoothing, plus the RPO term's NLL of the chosen tokens
        assert one["losses"][0] > math.log(2) + 0.1
    assert abs(one["losses"][-1] - one["losses"][0]) > 1e-4  # it trained
    loss_diff = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
    trained = [n for n in one["weights"] if case != "lora" or is_adapter(n)]
    weight_diff = max((one["weights"][n] - two["weights"][n]).abs().max().item() for n in trained)
    print(f"{case}: {name} world {world} vs single: |loss diff| {loss_diff:.1e}, |weight diff| {weight_diff:.1e}")
    assert loss_diff < TOLERANCE and weight_diff < TOLERANCE, (case, loss_diff, weight_diff)
    for a, b in zip(one["metrics"], two["metrics"]):
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert a[key] == pytest.approx(b[key], abs=TOLERANCE), (case, key)
    assert any(r["rewards/margins"] != 0.0 for r in one["metrics"][1:])
    # the validation pairs, shared out among the ranks, give the same loss and rewards
    assert one["metrics"][-1]["val_rewards/margins"] != 0.0
    for key in ("val_loss", "val_rewards/chosen", "val_rewards/margins", "val_logps/rejected"):
        assert one["metrics"][-1][key] == pytest.approx(two["metrics"][-1][key], abs=TOLERANCE), (case, key)
