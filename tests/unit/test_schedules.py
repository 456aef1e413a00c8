"""The learning-rate schedules (zerodp.optim.schedules): each one's lr pinned at chosen steps, and the
registry covering config's names without torch (a wsd run resumed mid-decay: test_schedule_resume)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.config import SCHEDULES, load_config
from zerodp.optim.schedules import REGISTRY, lr_at, wsd_decay

# peak 1e-3, floor 1e-4, 10 warmup steps, 100 decay steps: the schedule spans steps 0..109
BASE = ["optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10", "train.max_steps=110"]


def lrs(overrides: list[str], steps: list[int]) -> list[float]:
    cfg = load_config(None, BASE + overrides)
    return [lr_at(cfg, k) for k in steps]


def test_warmup_is_shared():
    # step k of the warmup: lr (k + 1) / warmup_steps, whatever the schedule
    for name in SCHEDULES:
        assert lrs([f"optim.schedule={name}"], [0, 4, 9]) == pytest.approx([1e-4, 5e-4, 1e-3]), name


def test_cosine_is_the_default():
    # decay progress 0, 0.25, 0.5, 1, past the end: 1e-4 + 0.5 (1 + cos(pi p)) 9e-4
    steps = [10, 35, 60, 110, 500]
    assert lrs([], steps) == pytest.approx([1e-3, 8.681981e-4, 5.5e-4, 1e-4, 1e-4])
    assert lrs(["optim.schedule=cosine"], steps) == lrs([], steps)


def test_linear():
    assert lrs(["optim.schedule=linear"], [10, 35, 60, 109, 110, 500]) == pytest.approx(
        [1e-3, 7.75e-4, 5.5e-4, 1.09e-4, 1e-4, 1e-4])


def test_wsd_holds_then_decays_over_the_last_fraction():
    # 110 steps, decay_fraction 0.2: the decay takes the last 22 steps, from step 88 on
    assert wsd_decay(load_config(None, BASE + ["optim.schedule=wsd"])) == (88, 22)
    steps = [10, 50, 87, 88, 99, 109, 110, 500]  # stable, stable, last stable, decay start, mid, last, end
    assert lrs(["optim.schedule=wsd"], steps) == pytest.approx(
        [1e-3, 1e-3, 1e-3, 1e-3, 5.5e-4, 1.409091e-4, 1e-4, 1e-4])
    # 1-sqrt: 1e-4 + (1 - sqrt(p)) 9e-4, p = 11/22 at step 99, 21/22 at 109
    assert lrs(["optim.schedule=wsd", "optim.decay_shape=1-sqrt"], steps) == pytest.approx(
        [1e-3, 1e-3, 1e-3, 1e-3, 3.636039e-4, 1.206924e-4, 1e-4, 1e-4])
    # decay_fraction 0.4 of 110: the last 44 steps, from step 66 on
    assert lrs(["optim.schedule=wsd", "optim.decay_fraction=0.4"], [65, 66, 88]) == pytest.approx([1e-3, 1e-3, 5.5e-4])


def test_wsd_decay_never_starts_in_the_warmup_and_follows_decay_steps():
    # 12 steps, half of them decay: the decay would start at 6, inside the 10 warmup steps
    assert wsd_decay(load_config(None, BASE + ["optim.schedule=wsd", "optim.decay_fraction=0.5",
                                               "train.max_steps=12"])) == (10, 2)
    # optim.decay_steps fixes the schedule whatever max_steps a part of the run has
    fixed = ["optim.schedule=wsd", "optim.decay_steps=100"]
    assert lrs(fixed + ["train.max_steps=90"], [87, 88, 99]) == lrs(fixed + ["train.max_steps=500"], [87, 88, 99])


def test_batch_scaling_applies_to_every_schedule():
    scaled = ["optim.scale_lr_with_batch=true", "optim.base_batch_size=8", "train.global_batch_size=32",
              "train.micro_batch_size=8"]
    for name in SCHEDULES:
        assert lrs([f"optim.schedule={name}"] + scaled, [9, 110]) == pytest.approx([4e-3, 4e-4]), name


def test_the_registry_covers_the_config_names_without_torch():
    assert tuple(REGISTRY) == SCHEDULES == ("cosine", "linear", "wsd")
    code = ("import sys\nimport zerodp.optim.schedules\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed'))\n"
            "assert not bad, bad\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# -- a wsd run split mid-decay, resumed at another world size ------------------------------------------------------

# 2 warmup + 6 steps (decay_steps fixed: the first part trains to max_steps=5); decay_fraction 0.5 of those 8:
