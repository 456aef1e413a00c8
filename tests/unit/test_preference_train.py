"""train.objective=dpo end to end on one process: the first step's loss is ln 2 (the live reference is the
starting policy), the metrics are TRL's names in metrics.jsonl; pairs stay whole and adjacent in every
micro batch, and the step's loss is the global pair mean at any split; adapters-off is exactly the base;
bad DPO settings and the wrong data for the objective are one line, exit 2, nothing written."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import TINY
from tests.support.cli_checks import one_line_error
from tests.support.sampler_workers import write_prepared
from zerodp.cli.commands import main
from zerodp.config import ConfigError, UserError, load_config
from zerodp.data.batches import TokenBatches, load_tokens
from zerodp.models import build_model
from zerodp.models.preference import STATS, batch_loss, completion_logps
from zerodp.trainer.objective import Preference, adapters_off

G = 12  # rows: 6 pairs


def preference_folder(path, pairs=40, seed=0):
    """A prepared folder of `pairs` pairs (documents 2i, 2i+1) whose completions are their last tokens."""
    docs = np.random.default_rng(seed).integers(6, 30, size=2 * pairs).tolist()
    folder = write_prepared(path, docs, docs[:8], targets=[0.5, 0.3, 0.8])
    meta = json.loads((folder / "meta.json").read_text())
    meta["preference"] = {"rows": pairs + 4, "skipped": {"missing_field": 4, "empty_completion": 0}}
    for split, n in (("train", pairs), ("val", 4)):
        meta["splits"][split]["pairs"] = n
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return preference_folder(tmp_path_factory.mktemp("pref") / "data")


def dpo(folder, *more):
    return TINY + [f"data.source={folder}", "data.packing=false", "train.objective=dpo", "strategy.name=single", *more]


def test_the_wrong_data_for_the_objective_is_one_line_exit_2_and_nothing_written(folder, tmp_path, capsys):
    sft = write_prepared(tmp_path / "sft", [20] * 30, [20] * 4, targets=[0.5])
    out = tmp_path / "run"
    code = main(["train", "configs/tiny.yaml", *dpo(sft, f"train.out_dir={out}", "strategy.name=single")])
    one_line_error(capsys, code, r"train.objective=dpo trains on preference pairs, and .*sft holds none; run zerodp "
                                 r"prepare PAIRS.jsonl --preference")
    code = main(["train", "configs/tiny.yaml", *TINY, f"data.source={folder}", f"train.out_dir={out}",
                 "strategy.name=single"])
    one_line_error(capsys, code, r"holds preference pairs \(zerodp prepare --preference\): train them with "
                                 r"train.objective=dpo")
    assert not out.exists()


def test_a_dpo_run_starts_at_ln2_and_logs_trls_metrics(folder, tmp_path, group, capsys):
    from zerodp.trainer.loop import train

    cfg = load_config(None, dpo(folder, "strategy.name=single", "train.max_steps=3", f"train.out_dir={tmp_path}",
                                "optim.lr=1e-3", "dpo.beta=0.5", "train.eval_every=1", "train.eval_batches=2"))
    summary = train(cfg, fresh=True)
    assert "(40 preference pairs in train, 4 in val; 4 rows of 44 skipped at prepare: 4 missing field)" in \
        capsys.readouterr().err
    assert summary["losses"][1] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(k in r for r in records for k in STATS)
    first, last = records[0], records[-1]
    assert first["rewards/margins"] == 0.0 and first["logps/chosen"] < 0
    # the validation pairs after the first update: the policy moved from the reference
    assert abs(first["val_loss"] - math.log(2)) > 1e-4 and first["val_rewards/margins"] != 0.0
    assert last["val_rewards/accuracies"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # 2 micro batches of 2 rows: 4 pairs
    assert last["rewards/chosen"] != 0.0 and last["loss"] != pytest.approx(math.log(2), abs=1e-4)
    assert "rewards/chosen" not in (tmp_path / "config.yaml").read_text()  # the metrics, not the config
    assert not any(p.name.startswith("reference") for p in (tmp_path / "checkpoints").rglob("*"))
    # zerodp eval of the run prints what its last validation logged: the same pairs, the same reference
    assert logged_validation(tmp_path) == eval_json(tmp_path, capsys)


def eval_json(run, capsys) -> dict:
    """`zerodp eval RUN --json`'s figures."""
    capsys.readouterr()
    assert main(["eval", str(run), "--json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def logged_validation(run, step=None) -> dict:
    """The val_ figures metrics.jsonl logged at `step` (the last validation without one)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    record = [r for r in records if "val_loss" in r and (step is None or r["step"] == step)][-1]
    return {k: pytest.approx(v, abs=1e-6) for k, v in record.items() if k.startswith("val_")}


@pytest.mark.parametrize("world,micro", [(1, 12), (1, 2), (2, 2), (2, 6), (3, 4), (3, 2)])
def test_pairs_stay_whole_and_the_loss_is_the_global_pair_mean_at_any_split(folder, world, micro):
    cfg = load_config(None, dpo(folder, f"train.global_batch_size={G}", f"train.micro_batch_size={micro}",
                                "dpo.rpo_alpha=0.3"))
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    policy, reference = build_model(cfg.model, seed=1), build_model(cfg.model, seed=2)
    objective = object.__new__(Preference)
    objective.cfg, objective.mode, objective.sums = cfg, "live", {}
    objective.reference = type("Held", (), {"model": reference})()
    for step in (0, 4):
        x, y = data.rows(data.offsets(step, G))
        samples = data.locate(step, G).sample
        assert (samples[0::2] % 2 == 0).all() and (samples[1::2] == samples[0::2] + 1).all()  # (chosen, rejected)
        with torch.no_grad():
            lp, n = completion_logps(policy(x), y)
            lr, _ = completion_logps(reference(x), y)
            whole, stats = batch_loss(cfg.dpo, lp, lr, n, G // 2, int(n[0::2].sum()))
            split = 0.0
            for rank in range(world):
                batches = data.rank_micro_batches(step, G, micro, rank, world)
                assert batches.parts == G // micro and batches.pairs == G // 2
                for batch in batches:
                    split += objective(policy, batch, batches).item() / batches.parts  # the strategies' mean
        assert split == pytest.approx(whole.item(), rel=1e-5, abs=1e-6)
        assert objective.sums.pop(step + 1) == pytest.approx(stats, rel=1e-5, abs=1e-5)


def test_adapters_off_is_exactly_the_base(folder):
    cfg = load_config(None, dpo(folder, "model.lora.rank=4"))
    model = build_model(cfg.model, seed=1)
    base = build_model(load_config(None, dpo(folder)).model, seed=1)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p.data)  # adapters that change the output
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert (model(x) - base(x)).abs().max() > 1e-3
        with adapters_off(model):
            assert torch.equal(model(x), base(x))
        assert (model(x) - base(x)).abs().max() > 1e-3  # restored


@pytest.mark.parametrize("override,pattern", [
    ("dpo.beta=0", r"dpo.beta=0.0 must be > 0"),
    ("dpo.loss=hinge", r"dpo.loss"),
    ("dpo.label_smoothing=0.5", r"dpo.label_smoothing=0.5 must be in \[0, 0.5\)"),
    ("dpo.simpo_gamma=1", r"dpo.simpo_gamma=1.0 applies to dpo.loss=simpo"),
    ("train.micro_batch_size=3", r"train.micro_batch_size=3 would split a preference pair"),
    ("data.packing=true", r"train.objective=dpo takes one sequence a row"),
])
def test_bad_dpo_settings_are_refused(folder, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, dpo(folder, "train.global_batch_size=12", override))


def test_a_resumed_dpo_run_continues_the_trajectory_with_the_same_reference(folder, tmp_path, group):
    """Stopped after step 2 (mid-epoch: 40 pairs, 6 a step) and resumed to step 4: the reference is rebuilt
    from the starting weights, not the resumed policy, so steps 3 and 4 are the uninterrupted run's."""
    from zerodp.trainer.loop import train

    def run(out, steps, fresh):
        cfg = load_config(None, dpo(folder, f"train.max_steps={steps}", f"train.out_dir={out}", "optim.lr=1e-2",
                                    "optim.decay_steps=4", "checkpoint.every=0"))
        return train(cfg, fresh=fresh, return_weights=True)

    straight = run(tmp_path / "a", 4, True)
    run(tmp_path / "b", 2, True)
    resumed = run(tmp_path / "b", 4, False)
    assert sorted(resumed["losses"]) == [3, 4]
    for step in (3, 4):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], abs=1e-6)
    assert abs(straight["losses"][3] - math.log(2)) > 1e-3  # a reference rebuilt from step 2 would give ln 2
    assert max((resumed["weights"][n] - w).abs().max().item() for n, w in straight["weights"].items()) < 1e-6


def test_zerodp_verify_passes_on_a_dpo_config(folder, tmp_path, group):
    """Two micro-batch splits of the same DPO run, compared step by step and tensor by tensor."""
    code = main(["verify", "configs/tiny.yaml", *dpo(folder, f"train.out_dir={tmp_path / 'run'}", "optim.lr=1e-2"),
                 "--against", "train.micro_batch_size=6", "--steps", "2"])
    assert code == 0


def test_precomputed_reference_log_probs_give_the_live_trajectory_and_are_refused_once_stale(tmp_path, group,
                                                                                              capsys):
    """dpo.reference=precomputed: one pass at step 0 writes every pair's reference log-probs beside the data;
    the run then follows the live reference's within 1e-5 (train and validation); a second run reads the
    file; changed data, or a resume without the file, is refused in one line."""
    from zerodp.trainer.loop import train

    data = preference_folder(tmp_path / "pairs")

    def run(out, reference, steps=3, fresh=True):
        cfg = load_config(None, dpo(data, f"train.max_steps={steps}", f"train.out_dir={out}", "optim.lr=1e-2",
                                    "train.eval_every=3", "train.eval_batches=2", f"dpo.reference={reference}",
                                    "checkpoint.every=0"))
        summary = train(cfg, fresh=fresh, return_weights=True)
        return summary, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    live, live_metrics = run(tmp_path / "live", "live")
    pre, pre_metrics = run(tmp_path / "pre", "precomputed")
    assert (data / "reference_logps.npz").is_file() and (data / "reference_logps.json").is_file()
    for step in (1, 2, 3):
        assert pre["losses"][step] == pytest.approx(live["losses"][step], abs=1e-5)
    assert pre_metrics[-1]["val_loss"] == pytest.approx(live_metrics[-1]["val_loss"], abs=1e-5)
    assert pre_metrics[-1]["val_rewards/margins"] == pytest.approx(live_metrics[-1]["val_rewards/margins"], abs=1e-5)
    with np.load(data / "reference_logps.npz") as t:
        assert t["train"].shape == (80,) and (t["train"] < 0).all()
    again, _ = run(tmp_path / "again", "precomputed")  # reads the file: the same numbers
    assert logged_validation(tmp_path / "pre") == eval_json(tmp_path / "pre", capsys)
    assert again["losses"] == pre["losses"]
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "seed": 5}))  # the data prepared again, differently
    with pytest.raises(UserError, match=r"reference_logps.npz holds reference log-probs of other weights or data "
                                        r"\(the data changed since\); move reference_logps.npz and .json out of"):
        run(tmp_path / "stale", "precomputed")
    (data / "meta.json").write_text(json.dumps(meta))
    for name in ("reference_logps.npz", "reference_logps.json"):
        (data / name).rename(tmp_path / name)
    with pytest.raises(UserError, match=r"reference_logps.npz is not there, and this run resumes at step 3"):
        run(tmp_path / "pre", "precomputed", steps=4, fresh=False)


def test_a_lora_dpo_run_evaluates_as_logged_and_exports_as_any_run(folder, tmp_path, group, capsys):
    """The reference is the base with the adapters off: zerodp eval prints the logged validation figures; the
    checkpoint exports to Hugging Face, merged, and as a PEFT folder, the reference nowhere in them."""
    from zerodp.api import load_model
    from zerodp.trainer.loop import train

    run = tmp_path / "run"
    cfg = load_config(None, dpo(folder, "model.lora.rank=4", "model.lora.alpha=8", "train.max_steps=2",
                                f"train.out_dir={run}", "optim.lr=1e-2", "train.eval_every=2",
                                "train.eval_batches=2"))
    train(cfg, fresh=True)
    logged = logged_validation(run, step=2)
    assert logged["val_rewards/margins"] != 0.0
    assert logged == eval_json(run, capsys)
    assert main(["convert", str(run), str(tmp_path / "merged"), "--to", "hf", "--merge"]) == 0
    assert main(["convert", str(run), str(tmp_path / "peft"), "--to", "peft"]) == 0
    files = [p.name for where in ("merged", "peft", "run") for p in (tmp_path / where).rglob("*")]
    assert not any("reference" in f for f in files), files  # no reference held, none saved or exported
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        trained = load_model(run)(x)
        assert torch.allclose(load_model(tmp_path / "merged")(x), trained, atol=1e-5)
        assert torch.allclose(load_model(tmp_path / "peft")(x), trained, atol=1e-5)
        assert (trained - load_model(tmp_path / "peft" / "base")(x)).abs().max() > 1e-4  # the adapters trained


def snapshot(*folders) -> dict:
    """Every file under `folders`: its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for f in folders for p in sorted(f.rglob("*"))}


def test_a_refused_precomputed_reference_writes_nothing(tmp_path, capsys):
    """A resume that finds no reference log-probs, and a file of other data, are refused at start-up, before
    the run folder is opened: the run and data folders are as they were, a new run folder never made."""
    data = preference_folder(tmp_path / "pairs")

    def train(out, steps):  # its own process: a launch's error under a process group ends the process
        r = subprocess.run([sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml",
                            *dpo(data, f"train.max_steps={steps}", f"train.out_dir={out}",
                                 "dpo.reference=precomputed")], capture_output=True, text=True, timeout=300)
        sys.stderr.write(r.stderr)  # for one_line_error
        return r.returncode

    assert train(tmp_path / "run", 2) == 0
    for name in ("reference_logps.npz", "reference_logps.json"):
        (data / name).rename(tmp_path / name)
    before = snapshot(tmp_path / "run", data)
    capsys.readouterr()
    one_line_error(capsys, train(tmp_path / "run", 3), r"reference_logps.npz is not there, and this run resumes at "
                                                       r"step 2")
    assert snapshot(tmp_path / "run", data) == before
    for name in ("reference_logps.npz", "reference_logps.json"):
        (tmp_path / name).rename(data / name)
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "seed": 5}))  # the data prepared again, differently
    before = snapshot(tmp_path / "run", data)
    for out, steps in ((tmp_path / "run", 3), (tmp_path / "new", 2)):
        one_line_error(capsys, train(out, steps), r"holds reference log-probs of other weights or data \(the data "
                                                  r"changed since\)")
    assert snapshot(tmp_path / "run", data) == before and not (tmp_path / "new").exists()


def test_the_dpo_lora_recipe_runs_on_cpu_by_overrides(folder, tmp_path, group):
    """configs/dpo-llama-lora.yaml at the suite's tiny shapes on a small preference set, as its header says:
    the reference is the base with the adapters off, so the first step's loss is ln 2 and no copy is held."""
    from zerodp.trainer.loop import train

    cfg = load_config("configs/dpo-llama-lora.yaml", [
        "model.hf_config=", "model.init_from=", "model.arch=llama", "model.n_layer=2", "model.n_head=2",
        "model.n_embd=32", "model.block_size=32", "train.precision=fp32", "strategy.name=single",
        f"data.source={folder}", "train.global_batch_size=12", "train.max_steps=2", f"train.out_dir={tmp_path}",
        "train.progress=false", "optim.warmup_steps=1"])
    assert (cfg.train.objective, cfg.dpo.reference, cfg.model.lora["rank"]) == ("dpo", "adapters-off", 16)
    assert cfg.train.global_batch_size == 12 and not cfg.data.packing
    summary = train(cfg, fresh=True)
    assert summary["losses"][1] == pytest.approx(math.log(2), abs=1e-6)
