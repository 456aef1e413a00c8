"""TensorBoard and Weights & Biases receive what metrics.jsonl holds, step by step; a missing optional
package is a one-line error naming the install."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_checks import zerodp_here
from tests.support.harness import ROOT, base_env

# A Llama of a few thousand parameters: start-up dominates, the steps take milliseconds.
LLAMA = ["strategy.name=single", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=1", "model.n_embd=32",
         "model.intermediate_size=64", "model.block_size=32", "data.max_bytes=200000", "data.prefetch=0",
         "train.global_batch_size=4", "train.micro_batch_size=2", "train.max_steps=5", "train.log_every=2",
         "train.eval_every=4", "train.eval_batches=1", "train.sample_tokens=0", "train.progress=false",
         "checkpoint.every=0"]


def _env() -> dict:
    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    return dict(env, WANDB_MODE="offline", WANDB_SILENT="true")


def flat(record: dict) -> dict:
    """A metrics.jsonl record with its mappings' entries as key/sub."""
    out = {k: v for k, v in record.items() if not isinstance(v, dict)}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update({f"{k}/{sub}": x for sub, x in v.items()})
    return out


def test_tensorboard_and_wandb_hold_every_scalar_of_metrics_jsonl(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zerodp", "train", "configs/llama-tiny.yaml", *LLAMA, f"train.out_dir={out}",
           "train.tensorboard=true", "train.wandb=zerodp-test"]
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [flat(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 2, 3, 4, 5]
    scalars = {k for rec in records for k, v in rec.items() if k != "step" and isinstance(v, (int, float))}
    assert "comm_bytes/total" in scalars  # a mapping's numbers under key/sub
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "val_loss"} <= scalars
    assert {"grad_noise_scale/sequences", "grad_noise_scale/tokens"} <= scalars  # 2 micro batches of 2: two sizes

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == scalars
    for key in scalars:
        logged = {e.step: e.value for e in events.Scalars(key)}
        want = {rec["step"]: rec[key] for rec in records if key in rec}
        assert logged.keys() == want.keys(), key
        for step, value in want.items():
            assert logged[step] == pytest.approx(value, rel=1e-6), (key, step)  # event files hold float32

    # W&B offline: the run's transaction log, read back by wandb's own inspector
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    dump = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(runs[0])],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert dump.returncode == 0, dump.stderr[-2000:]
    history = [json.loads(x)["history"]["item"] for x in dump.stdout.splitlines() if '"type":"history"' in x]
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5]
    for rec, h in zip(records, history):
        for key in scalars & rec.keys():
            assert h[key] == pytest.approx(rec[key], rel=1e-12), (key, rec["step"])


@pytest.mark.parametrize("package, key, value", [("tensorboard", "train.tensorboard", "true"),
                                                 ("wandb", "train.wandb", "myproject")])
def test_missing_logger_package_is_one_line_naming_the_install(tmp_path, package, key, value, monkeypatch):
    """The package is made unimportable in the process (as if it were not installed): a launch, and a dry run
    (which checks it too) through zerodp's main in this process."""
    args = ["train", "configs/llama-tiny.yaml", *LLAMA, f"train.out_dir={tmp_path}", f"{key}={value}"]
    script = (f"import sys; sys.modules[{package!r}] = None; from zerodp.cli.commands import main; "
              f"sys.exit(main(sys.argv[1:]))")
    launched = subprocess.run([sys.executable, "-c", script, *args], env=_env(), cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    monkeypatch.setitem(sys.modules, package, None)
    for r in (launched, zerodp_here(*args, "--dry-run")):
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines[-1] == (f"zerodp: error: {key}{'=true' if package == 'tensorboard' else ''} needs the "
                             f"{package} package, which is not installed: pip install 'zerodp[{package}]'"), r.stderr
        assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_without_a_login_is_one_line(tmp_path):
    """Online mode without an API key: wandb refuses; every rank stops with one line, no traceback."""
    env = {k: v for k, v in _env().items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "config"))  # no ~/.netrc, no saved login
    cmd = [sys.executable, "-m", "zerodp", "train", "configs/llama-tiny.yaml", *LLAMA,
           f"train.out_dir={tmp_path / 'run'}", "train.wandb=zerodp-test"]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    line = [ln for ln in r.stderr.splitlines() if ln.strip()][-1]
    assert line.startswith("zerodp: error: train.wandb=zerodp-test: Weights & Biases could not start a run ("), line
    assert "run `wandb login`, or set WANDB_MODE=offline" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
