"""train.objective=dpo at world 2 and 3 follows the single-process run on the same global batches of pairs
(global batch 12 rows = 6 pairs, micro batches of 2: accumulation 6, 3 and 2 at world 1, 2 and 3), for every
strategy (ddp, zero1, zero2, zero3, fsdp) at both world sizes and each loss type: sigmoid with label smoothing
and the RPO term (the live frozen reference, a second instance of the strategy, sharded as the policy under
zero3 and fsdp), ipo (live) and simpo (no reference), each under every strategy at one of the two world
sizes (LOSS_ONLY), LoRA with the adapters switched off as the reference, and the precomputed reference (its
pass run under the run's own strategy) for the full model and for LoRA. Per-step losses, the final weights
(LoRA: the adapters) and the logged rewards, on the training and the validation pairs, agree within
test_equivalence.py's 1e-5 (two steps suffice: a beta 10% off, or another label smoothing or simpo margin,
moves the weights 20x to 800x that).

The three reference modes give one trajectory: on the same config, precomputed follows live (full model) and
adapters-off (LoRA; a live copy is refused with model.lora: the base with the adapters off is the same function
at the starting point) within 1e-5, per-step losses and final weights. Each run's end-of-run "DPO reference per
rank" figure (zerodp.telemetry.comm: the live reference's state_bytes()) is what zerodp.planner.preference
predicts within 5%: the frozen copy's bytes for live, none at all for precomputed, adapters-off and simpo.
One launch per world size runs every training."""

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
STEPS = 2
BASE = [o for o in TINY if not o.startswith(("train.global_batch_size", "train.micro_batch_size"))] + [
    "train.global_batch_size=12", "train.micro_batch_size=2", f"train.max_steps={STEPS}", "optim.lr=3e-3",
    "data.packing=false", "train.objective=dpo", "train.log_every=1", f"train.eval_every={STEPS}",
    "train.eval_batches=3", "checkpoint.enabled=false"]
SIGMOID = ["dpo.beta=0.5", "dpo.label_smoothing=0.1", "dpo.rpo_alpha=0.2"]
# the adapters (B from zero) move little in two steps: a larger lr, that a wrong beta moves them 20x the tolerance
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "dpo.beta=0.5", "optim.lr=1e-2"]
CASES = {"sigmoid": SIGMOID,
         "ipo": ["dpo.loss=ipo", "dpo.beta=0.5"],
         "simpo": ["dpo.loss=simpo", "dpo.beta=2.0", "dpo.simpo_gamma=0.3"],
         "lora": LORA,
         "precomputed": SIGMOID + ["dpo.reference=precomputed"],
         "lora-precomputed": LORA + ["dpo.reference=precomputed"]}
REFERENCE = {"sigmoid": "live", "ipo": "live", "simpo": None, "lora": "adapters-off", "precomputed": "precomputed",
             "lora-precomputed": "precomputed"}
SHARED = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
STRATEGIES = {1: ["single"], 2: SHARED, 3: SHARED}
LOSS_ONLY = {"ipo": {2: ["ddp", "zero2", "fsdp"], 3: ["zero1", "zero3"]},
             "simpo": {2: ["zero1", "zero3"], 3: ["ddp", "zero2", "fsdp"]}}
"""ipo and simpo differ from sigmoid only in the loss taken of the pairs' log-probs (zerodp/trainer/objective.py,
which no strategy sees; their references, live and none, are sigmoid's and every strategy's plain setup): each
meets every strategy at one of the two world sizes, and each world size under two or three strategies, where
the other cases run every strategy at both."""
RUNS = [(case, name, world) for world, names in STRATEGIES.items() for name in names for case in CASES
        if world == 1 or name in LOSS_ONLY.get(case, {}).get(world, names)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    data = preference_folder(root / "pairs")
    results = {}
    for world in STRATEGIES:
        keys = [k for k in RUNS if k[2] == world]
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
    if not case.endswith("precomputed"):
        return data
    own = root / f"pairs-{case}-{name}-{world}"
    shutil.copytree(data, own, dirs_exist_ok=True)
    return own


def trained(case, weights):
    return [n for n in weights if not case.startswith("lora") or is_adapter(n)]


def weight_diff(case, one, two):
    return max((one["weights"][n] - two["weights"][n]).abs().max().item() for n in trained(case, one["weights"]))


@pytest.mark.parametrize("case,name,world", [k for k in RUNS if k[2] > 1])
def test_every_strategy_at_world_2_and_3_follows_one_process(runs, case, name, world):
    one, two = runs[(case, "single", 1)], runs[(case, name, world)]
    assert len(one["losses"]) == STEPS and two["strategy"] == name
    # the reference is the starting policy: every log-ratio is 0 at the first step
    first = {"ipo": (1 / (2 * 0.5)) ** 2, "lora": math.log(2), "lora-precomputed": math.log(2)}
    if case in first:
        assert one["losses"][0] == pytest.approx(first[case], abs=1e-6)
    if case in ("sigmoid", "precomputed"):  # ln 2 whatever the smoothing, plus the RPO term's NLL of the chosen
        assert one["losses"][0] > math.log(2) + 0.1
    assert abs(one["losses"][-1] - one["losses"][0]) > 1e-4  # it trained
    loss_diff = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
    weights = weight_diff(case, one, two)
    print(f"{case}: {name} world {world} vs single: |loss diff| {loss_diff:.1e}, |weight diff| {weights:.1e}")
    assert loss_diff < TOLERANCE and weights < TOLERANCE, (case, loss_diff, weights)
    for a, b in zip(one["metrics"], two["metrics"]):
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert a[key] == pytest.approx(b[key], abs=TOLERANCE), (case, key)
    assert any(r["rewards/margins"] != 0.0 for r in one["metrics"][1:])
    # the validation pairs, shared out among the ranks, give the same loss and rewards
    assert one["metrics"][-1]["val_rewards/margins"] != 0.0
    for key in ("val_loss", "val_rewards/chosen", "val_rewards/margins", "val_logps/rejected"):
        assert one["metrics"][-1][key] == pytest.approx(two["metrics"][-1][key], abs=TOLERANCE), (case, key)


@pytest.mark.parametrize("name,world", [(n, w) for w, names in STRATEGIES.items() for n in names])
def test_the_reference_modes_give_one_trajectory_and_only_live_holds_a_copy(runs, name, world):
    """precomputed against live (full model) and against adapters-off (LoRA), on the same config and strategy;
    the held reference bytes of every run against the planner's."""
    for live, pre in (("sigmoid", "precomputed"), ("lora", "lora-precomputed")):
        a, b = runs[(live, name, world)], runs[(pre, name, world)]
        loss_diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
        weights = weight_diff(live, a, b)
        print(f"{REFERENCE[live]} vs precomputed ({live}), {name} world {world}: |loss diff| {loss_diff:.1e}, "
              f"|weight diff| {weights:.1e}")
        assert loss_diff < TOLERANCE and weights < TOLERANCE, (live, loss_diff, weights)
        assert a["metrics"][-1]["val_loss"] == pytest.approx(b["metrics"][-1]["val_loss"], abs=TOLERANCE)
    for case, mode in REFERENCE.items():
        if (case, name, world) not in runs:  # LOSS_ONLY's
            continue
        held = runs[(case, name, world)]["planned"].get("reference", {"predicted": 0, "measured": 0})
        print(f"{case} ({mode}), {name} world {world}: reference predicted {held['predicted']:,} B, "
              f"measured {held['measured']:,} B per rank")
        if mode == "live":  # the frozen copy: at least its fp32 shard of the parameters
            assert held["predicted"] > 0 and abs(held["measured"] - held["predicted"]) <= 0.05 * held["predicted"]
        else:
            assert held == {"predicted": 0, "measured": 0}, (case, held)
