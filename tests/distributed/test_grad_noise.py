"""The gradient noise scale (zerodp.telemetry.grad_noise, docs/grad_noise.md) against its definition.

One process trains the tiny model with accumulation (micro batch 2, global batch 16: the two batch
sizes) at a learning rate of 1e-12, so that every step sees the same weights; then per-example
gradients at those weights (torch.func: one gradient per sequence) give

* the same two norms per step, replayed through the same averages: the run's `grad_noise_scale` of
  every step to 1e-4 (the hooks measure what the estimator is defined on, normalised for the
  accumulation's 1/8), and
* the definition, B_simple = tr(Sigma) / |G|^2, brute force over all 640 sequences the run saw: the
  running estimate agrees within BRUTE_FORCE_TOLERANCE (both are estimates from the same 640 samples;
  the running one uses only pairs within a batch, so it is the noisier).

That the estimate does not depend on the strategy (ddp, zero1-3, fsdp at world 2 and 3) is asserted
on the runs of tests/distributed/test_equivalence.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import ROOT, run_distributed
from zerodp.telemetry.grad_noise import NoiseScale, advice, skip_reason

STEPS, MICRO, GLOBAL = 40, 2, 16
BRUTE_FORCE_TOLERANCE = 0.25
"""Relative: the running estimate vs B_simple over the same sequences."""


def brute_force(overrides: list[str]) -> dict:
    """Train per `overrides`, then the per-example gradients of every sequence the run saw, at its
    final weights: the replayed estimate per step and B_simple over all of them."""
    import torch
    from torch.func import functional_call, grad, vmap

    from zerodp.config import load_config
    from zerodp.data.batches import TokenBatches, load_tokens
    from zerodp.models import build_model
    from zerodp.trainer.loop import train

    cfg = load_config(None, overrides)
    summary = train(cfg, fresh=True, return_weights=True)
    records = [json.loads(x) for x in (Path(cfg.train.out_dir) / "metrics.jsonl").read_text().splitlines()]
    model = build_model(cfg.model, device="cpu")
    model.load_state_dict(summary["weights"], strict=False)  # tied alias restored from its source
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, x, y):  # one sequence: (T,) -> its mean token loss
        return functional_call(model, p, (x[None], y[None]))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    replay = NoiseScale(MICRO, GLOBAL, cfg.train.grad_noise_ema, cfg.model.block_size)
    replayed, every = [], []
    for step in range(STEPS):
        micro = []
        for x, y in data.rank_micro_batches(step, GLOBAL, MICRO, 0, 1):
            g = per_example(params, x, y)
            micro.append(torch.cat([v.flatten(1) for v in g.values()], dim=1))  # (MICRO, P)
        g = torch.cat(micro).double()  # (GLOBAL, P)
        every.append(g)
        small_sq = sum(m.double().mean(0).square().sum().item() for m in micro) / len(micro)
        replayed.append(replay.update(small_sq, g.mean(0).square().sum().item()))
    g = torch.cat(every)  # (N, P)
    n = g.shape[0]
    mean = g.mean(0)
    trace = (g - mean).square().sum().item() / (n - 1)  # tr(Sigma), unbiased
    grad_sq = mean.square().sum().item() - trace / n  # |G|^2, unbiased
    return {"records": records, "replayed": replayed, "b_simple": trace / grad_sq, "run": summary["run"],
            "moved": max((summary["weights"][k] - v).abs().max().item()
                         for k, v in build_model(cfg.model, cfg.train.seed, "cpu").state_dict().items()
                         if k in summary["weights"])}


def test_running_estimate_matches_per_example_gradients(tiny, tmp_path, capsys):
    over = tiny + [f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL}",
                   f"train.max_steps={STEPS}", "optim.lr=1e-12", "optim.min_lr=1e-12", "strategy.name=single",
                   "train.log_every=10", f"train.out_dir={tmp_path}"]
    res = run_distributed("tests.distributed.test_grad_noise:brute_force", 1, {"overrides": over})[0]
    assert res["moved"] < 1e-9  # the same weights at every step
    records = res["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r, replayed in zip(records, res["replayed"]):
        if replayed is None:  # the averaged |G|^2 not yet positive: no estimate in the record either
            assert "grad_noise_scale" not in r, r
            continue
        for unit in ("sequences", "tokens"):
            assert r["grad_noise_scale"][unit] == pytest.approx(replayed[unit], rel=1e-4), (r["step"], unit)
    final = records[-1]["grad_noise_scale"]["sequences"]
    b_simple = res["b_simple"]
    with capsys.disabled():  # the figures docs/grad_noise.md quotes, with pytest -s
        print(f"\nrunning estimate {final:.3f} sequences vs brute-force B_simple {b_simple:.3f} "
              f"({final / b_simple - 1:+.1%}) after {STEPS} steps of {GLOBAL}")
    assert b_simple > 0
    assert abs(final / b_simple - 1) < BRUTE_FORCE_TOLERANCE
    assert res["run"]["grad_noise_scale"]["sequences"] == final
    _check_plan_from_run(tmp_path, records[-1], capsys)


NO_TORCH = ("import json, sys\nfrom zerodp.cli.commands import main\nassert main(sys.argv[1:]) == 0\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')]\nassert not bad, bad\n")


def _check_plan_from_run(run_dir: Path, last: dict, capsys) -> None:
    """`zerodp plan --from-run` on the run just made: its last estimate, the world sizes above it
    marked, and no torch imported; bad input is one line on stderr and exit 2."""
    r = subprocess.run([sys.executable, "-c", NO_TORCH, "plan", "--from-run", str(run_dir), "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)["critical_batch"]
    critical = last["grad_noise_scale"]["sequences"]
    assert (found["step"], found["sequences"], found["world_size"], found["per_rank"]) == (STEPS, critical, 1, GLOBAL)
    assert found["rows"][0] == {"world_size": 1, "global_batch": GLOBAL, "ratio": GLOBAL / critical,
                                "exceeds": GLOBAL > critical}
    assert all(row["exceeds"] == (row["world_size"] * GLOBAL > critical) for row in found["rows"])
    from zerodp.cli.commands import main

    capsys.readouterr()
    assert main(["plan", "--from-run", str(run_dir), "--model", "gpt2", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    table, _, noise = out.partition("critical batch measured by")
    assert "ddp" in table  # the plan's table first
    assert noise.startswith(f" {run_dir} at step {STEPS}: ~")
    assert "exceeds it" in noise and "\n        8 " in noise  # the planned world size (8 GPUs) is listed

    bare = run_dir / "without"
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (bare / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in json.loads(x).items() if k != "grad_noise_scale"}) + "\n" for x in lines))
    for target, message in ((bare, "metrics.jsonl holds no grad_noise_scale; train with train.grad_noise_scale=true"),
                            (run_dir / "missing", "no metrics.jsonl and config.yaml there")):
        assert main(["plan", "--from-run", str(target)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith(f"zerodp: error: --from-run {target}: ") and message in err, err


def test_estimator_recovers_a_known_noise_scale():
    """Norms drawn as E|G_B|^2 = |G|^2 + tr(Sigma)/B prescribes, exactly: the estimate is tr/|G|^2."""
    noise = NoiseScale(4, 64, 0.9, tokens_per_sequence=128)
    for _ in range(5):
        est = noise.update(2.0 + 300.0 / 4, 2.0 + 300.0 / 64)
    assert est["sequences"] == pytest.approx(150.0) and est["tokens"] == pytest.approx(150.0 * 128)
    assert noise.update(float("inf"), 1.0) == est and noise.steps == 5  # an fp16 overflow is left out
    resumed = NoiseScale(4, 64, 0.9, 128, noise.state())
    assert resumed.estimate() == est
    all_noise = NoiseScale(4, 64, 0.9, 128)
    assert all_noise.update(10.0, 0.5) is None  # 64 x 0.5 < 4 x 10: the |G|^2 estimate is negative
    assert NoiseScale(4, 64, 0.9, 128).update(1.0, 2.0) is None  # |G_small| < |G_big|: tr(Sigma) negative


def test_advice_and_when_the_estimate_is_skipped():
    below = advice(480, {"sequences": 1600.0, "tokens": 1600.0 * 1024}, 500)
    assert "global batch 480 sequences is 0.3x it: up to ~3.3x more GPUs would still scale near-linearly" in below
    assert "~1,600 sequences (~1,600,000 tokens)" in below
    above = advice(6400, {"sequences": 1600.0, "tokens": 1600.0}, 500)
    assert "is 4x it: a smaller global batch would reach the same loss in fewer tokens" in above
    assert "near the balance of steps against tokens" in advice(16, {"sequences": 23.0, "tokens": 2944.0}, 500)
    assert "not measurable yet after 3 step(s)" in advice(16, None, 3)
    assert skip_reason(2, 8, 16) == "" and skip_reason(1, 8, 16) == ""
    assert "needs two" in skip_reason(1, 16, 16)
    assert math.isclose(NoiseScale(8, 16, 0.0, 1).update(1.0, 0.75)["sequences"], 8.0)  # |G|^2 0.5, tr 4
