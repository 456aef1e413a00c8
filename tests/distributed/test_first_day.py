"""A new user's first day: nothing lost, nothing silent. Each test pins one item a user met on the
landed main (the item numbers of the issue are in the test names' docstrings), through the command
line where that is what the user ran."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.distributed.test_cli import one_line_error, zerodp
from tests.support.cli_checks import zerodp_here
from tests.support.harness import ROOT, base_env

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SMALL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "data.max_bytes=200000",
         "data.prefetch=0", "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_every=0",
         "train.sample_tokens=0", "train.progress=false", "strategy.name=single", "checkpoint.every=0"]


def train(out: Path, *extra, check=True):
    r = zerodp("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={out}", *extra)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its bytes and modification time: what 'nothing changed' means."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run5(tmp_path_factory):
    """A finished 5-step run of a 2-layer model, checkpoints at step 4 (checkpoint.every=4) and step 5 (the
    end, off that grid), checkpoint.keep_last=2 (copied per test)."""
    out = tmp_path_factory.mktemp("run5") / "run"
    train(out, "train.max_steps=5", "checkpoint.every=4", "checkpoint.keep_last=2")
    return out


@pytest.fixture
def run(run5, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run5, out)
    return out


# -- 2. resuming into a changed model ------------------------------------------------------------------

@pytest.mark.parametrize("change, named", [
    ("model.n_layer=1", r"model.n_layer=2 there, 1 here"),
    ("model.n_embd=64", r"model.n_embd=32 there, 64 here"),
])
def test_resuming_into_another_model_is_refused_and_writes_nothing(run, change, named):
    """Item 2: the run folder is left exactly as it was, and the line names the key and the way out. A
    deeper model (model.n_layer=3) is the same launch as test_launch_and_dry_run_share_their_start_up_checks'
    another-model case, which pins the same line and the same untouched folder."""
    before = snapshot(run)
    r = train(run, "train.max_steps=6", change, check=False)
    one_line_error(r, named + r".*--fresh .*another train.out_dir")
    assert snapshot(run) == before


def test_init_from_another_model_is_refused(run, tmp_path):
    """Item 2: model.init_from of a 2-layer checkpoint into a 1-layer model no longer loads a subset;
    a foreign file without zerodp's config (safetensors export) is compared by names and shapes. The
    launch that loads it is item 10's start over from a run whose only checkpoint is damaged: one line says
    both."""
    ckpt = run / "checkpoints" / "step_00000004"
    r = train(tmp_path / "new", "train.max_steps=1", "model.n_layer=1", f"model.init_from={ckpt}", check=False)
    one_line_error(r, r"model.init_from .*step_00000004 holds a different model .*model.n_layer=2 there, 1 here")
    export = tmp_path / "export"
    assert zerodp_here("convert", ckpt, export, "--no-progress").returncode == 0
    md = export / "model.safetensors"
    from safetensors.torch import load_file, save_file

    save_file(load_file(md), md)  # the same tensors without zerodp's metadata: names and shapes only
    r = train(tmp_path / "new2", "train.max_steps=1", "model.n_layer=1", f"model.init_from={md}", check=False)
    one_line_error(r, r"parameters there are not in this model \(e.g. transformer.h.1.")
    assert not (tmp_path / "new2" / "checkpoints").exists()
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    victim = run / "checkpoints" / "step_00000005" / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-8])
    r = train(run, "train.max_steps=1", f"model.init_from={md}")
    assert re.search(r"no intact checkpoint in .*checkpoints \(1 damaged, set aside\): starting over from step 0",
                     r.stderr), r.stderr  # item 10
    assert f"weights from {md} (model.init_from)" in r.stderr


# -- 3. retention counts intact checkpoints only -----------------------------------------------------------

def test_damaged_checkpoint_is_set_aside_and_keep_last_counts_intact_ones(run):
    """Item 3: step 5 (saved at the end, off the every-4 grid) is damaged; resuming from step 4 and saving
    at 8 with keep_last=2 must keep steps 4 and 8 (before: step 4 was deleted, leaving the damaged 5)."""
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000005"]
    victim = root / "step_00000005" / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-8])  # truncated
    r = train(run, "train.max_steps=8", "checkpoint.every=4", "checkpoint.keep_last=2")
    assert r.stderr.count("step_00000005 is damaged") == 1, r.stderr
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_00000004", "step_00000005.damaged", "step_00000008"], names
    from zerodp.checkpoint import store as checkpoint

    assert checkpoint.verify(root / "step_00000004") is None and checkpoint.verify(root / "step_00000008") is None
    # what was saved is still there, for inspection
    assert (root / "step_00000005.damaged" / "meta.json").is_file()


# -- 4. Ctrl-C ---------------------------------------------------------------------------------------------

def _start(out: Path, *extra):
    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    cmd = [sys.executable, "-m", "zerodp", "train", str(ROOT / "configs/tiny.yaml"), *SMALL,
           f"train.out_dir={out}", "train.max_steps=100000", "train.log_every=1", *extra]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc, out: Path, step: int = 3, timeout: float = 120) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def test_first_ctrl_c_saves_and_exits_130_second_stops_at_once(tmp_path):
    """Item 4: the first Ctrl-C finishes the step, saves and exits 130 with a line saying so."""
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_step(proc, out)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    done = int(re.search(r"Ctrl-C: stopped after step (\d+), checkpoint saved", err).group(1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{done:08d}"
    # A second Ctrl-C (later than a launcher's forwarded copy of the first) stops at once, without
    # saving: steps of a few seconds here (a wider model, longer sequences), so that it lands mid-step.
    slow = ["model.n_embd=512", "model.n_head=8", "model.block_size=256", "train.global_batch_size=16",
            "train.micro_batch_size=16", "--fresh"]
    proc = _start(tmp_path / "slow", *slow)
    _wait_for_step(proc, tmp_path / "slow", step=1)
    proc.send_signal(signal.SIGINT)
    time.sleep(1.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "stopped by Ctrl-C" in err and "Traceback" not in err
    assert not (tmp_path / "slow" / "checkpoints" / "latest").exists()


@pytest.fixture(scope="module")
def ctrl_c_under_torchrun(tmp_path_factory) -> tuple[Path, str]:
    """One plain torchrun launch of 2 ranks under zero2, a line every 3 steps and a validation every 6, ended
    by a terminal's Ctrl-C after step 6's records: (train.out_dir, the ranks' stderr: all of it before
    torchrun's own SignalException traceback, which plain torchrun adds after the ranks have left)."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    env = base_env(2)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    over = [a.replace("strategy.name=single", "strategy.name=zero2") for a in SMALL]
    cmd = [TORCHRUN, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}",
           "-m", "zerodp", "train", str(ROOT / "configs/tiny.yaml"), *over, f"train.out_dir={out}",
           "train.max_steps=100000", "train.log_every=3", "train.eval_every=6"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for_step(proc, out, step=6)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert err.count("Traceback (most recent call last):") == 1, err
    ranks, traceback = err.split("Traceback (most recent call last):")
    assert "SignalException: Process" in traceback, err  # torchrun's, not a rank's
    return out, ranks


def test_ctrl_c_under_torchrun_saves_on_every_rank(ctrl_c_under_torchrun):
    """Item 4: a terminal's Ctrl-C reaches torchrun and both ranks; torchrun forwards it to the ranks
    again at once (the same Ctrl-C, not a second one). Both ranks finish the step and save together."""
    out, err = ctrl_c_under_torchrun
    done = int(re.search(r"Ctrl-C: stopped after step (\d+), checkpoint saved", err).group(1))
    from zerodp.checkpoint import store as checkpoint

    ckpt = out / "checkpoints" / f"step_{done:08d}"
    assert checkpoint.verify(ckpt) is None
    assert checkpoint.read_meta(ckpt)["world_size"] == 2


def _port() -> int:
    from tests.support.harness import free_port

    return free_port()


# -- 8. a config error under torchrun is always seen ----------------------------------------------------------

def test_config_error_of_a_rank_other_than_0_reaches_the_user(tmp_path):
    """Item 8: rank 1 found the error too; when rank 0 cannot print it (a launcher killed it), rank 1's
    line is what the user sees. Before, rank 1 printed nothing."""
    env = base_env(2)
    env.update(RANK="1", LOCAL_RANK="1")
    r = subprocess.run([sys.executable, "-m", "zerodp", "train", str(ROOT / "configs/tiny.yaml"),
                        "train.max_stepz=3"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    one_line_error(r, r"unknown key 'train.max_stepz'.*did you mean 'train.max_steps'")


def test_config_error_under_torchrun_is_one_line_every_time():
    env = base_env(2)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    for _ in range(3):
        # a free port, not torchrun's default 29500, which another launch on this machine may hold
        r = subprocess.run([TORCHRUN, "--nproc-per-node", "2", "--master-port", str(_port()), "-m", "zerodp", "train",
                            "configs/tiny.yaml", "train.max_stepz=3"], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0
        assert r.stderr.count("zerodp: error: unknown key 'train.max_stepz'") == 1, r.stderr


# -- 9. --dry-run checks what launching would check ----------------------------------------------------------------

@pytest.mark.parametrize("extra, pattern", [
    (["data.source=/nonexistent/corpus.txt"], r"data.source '/nonexistent/corpus.txt' not found"),
    (["model.init_from=/nonexistent/ckpt"], r"model.init_from /nonexistent/ckpt does not exist"),
    (["strategy.name=zero2", "strategy.deepspeed.gradient_clipping=3"],
     r"strategy.deepspeed.gradient_clipping=3 contradicts zerodp's gradient_clipping=1.0"),
    (["strategy.name=zero2", "strategy.offload_params=true"], r"offload_params=true needs parameter sharding"),
])
def test_dry_run_fails_where_the_launch_would(tmp_path, extra, pattern):
    """Item 9: each of these returned 0 from --dry-run and failed at launch."""
    r = zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={tmp_path}/run", *extra, "--dry-run")
    one_line_error(r, pattern)
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def _bad_out_dir(run: Path, tmp: Path) -> list[str]:
    (tmp / "file").write_text("")
    return [f"train.out_dir={tmp}/file"]


@pytest.mark.parametrize("bad, pattern", [
    (lambda run, tmp: ["data.source=/nonexistent/corpus.txt"], r"data.source '/nonexistent/corpus.txt' not found"),
    (lambda run, tmp: ["model.init_from=/nonexistent/ckpt"], r"model.init_from /nonexistent/ckpt does not exist"),
    (lambda run, tmp: [f"train.out_dir={run}", "model.n_layer=3"],  # item 2 too: the way out is named
     r"holds a different model than this config \(model.n_layer=2 there, 3 here\).*--fresh .*another train.out_dir"),
    (_bad_out_dir, r"train.out_dir \S+/file is not writable \(File exists\); choose a directory you can write to"),
    (lambda run, tmp: ["strategy.name=zero2", "strategy.offload_params=true"],
     r"offload_params=true needs parameter sharding"),
], ids=["data.source", "init_from", "another-model", "out_dir", "strategy"])
def test_launch_and_dry_run_share_their_start_up_checks(run, tmp_path, bad, pattern):
    """`zerodp train` and `zerodp train --dry-run` run one preflight (zerodp.trainer.preflight): each
    bad input stops both with the same one line and exit code 2, and an earlier run's folder stays as it
    was (the launch creates a new train.out_dir before it checks the data; the dry run creates nothing)."""
    extra = [f"train.out_dir={tmp_path}/new", *bad(run, tmp_path)]
    before = snapshot(run)
    dry = zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, "train.max_steps=6", *extra, "--dry-run")
    one_line_error(dry, pattern)
    assert not (tmp_path / "new").exists()  # a dry run writes nothing
    launch = zerodp("train", ROOT / "configs/tiny.yaml", *SMALL, "train.max_steps=6", *extra)
    one_line_error(launch, pattern)
    assert launch.stderr == dry.stderr
    assert snapshot(run) == before


def test_out_dir_check_without_writing_says_what_writing_would(tmp_path):
    """The dry run's out_dir check (nothing created) fails where the launch's (a probe file written)
    fails, with the same line, and passes where it passes."""
    from zerodp.errors import UserError
    from zerodp.trainer.preflight import check_out_dir

    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        lines = []
        for write in (False, True):
            with pytest.raises(UserError) as e:
                check_out_dir(out, write=write)
            lines.append(str(e.value))
        assert lines[0] == lines[1] and f"train.out_dir {out} is not writable (" in lines[0], lines
    check_out_dir(tmp_path / "a" / "b", write=False)
    assert not (tmp_path / "a").exists()
    check_out_dir(tmp_path / "a" / "b", write=True)
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == []


def test_dry_run_says_where_the_run_would_start(run):
    before = snapshot(run)
    r = zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={run}", "train.max_steps=6",
                    "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"# resuming from {run}/checkpoints/step_00000005 at step 5 (saved by single on 1 process(es))" in r.stdout
    assert "train.max_steps=6" in r.stdout.split("# set by you, unlike the defaults")[1]  # item 14
    r = zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={run}", "--dry-run", "--fresh")
    assert "# --fresh: starting from step 0" in r.stdout
    r = zerodp_here("train", ROOT / "configs/tiny.yaml", *SMALL, f"train.out_dir={run}", "model.n_layer=3",
                    "--dry-run")
    one_line_error(r, r"holds a different model than this config \(model.n_layer=2 there, 3 here\)")
    assert snapshot(run) == before


def test_dry_run_lists_what_you_set_apart_from_what_was_resolved(tmp_path):
    """Item 12: "differs from the defaults" listed model.n_kv_head=4, model.bias=True and
    model.tie_embeddings=True, gpt2's defaults for keys the user never set, among the user's own."""
    small = [a for a in SMALL if a != "strategy.name=single"]  # configs/tiny.yaml's strategy: auto stays
    r = zerodp_here("train", ROOT / "configs/tiny.yaml", *small, f"train.out_dir={tmp_path}/run", "--dry-run")
    assert r.returncode == 0, r.stderr
    mine = next(line for line in r.stdout.splitlines() if line.startswith("# set by you, unlike the defaults"))
    resolved = next(line for line in r.stdout.splitlines() if line.startswith("# resolved, not set by you"))
    assert "model.n_layer=2, model.n_head=2, model.n_embd=32, model.block_size=32" in mine, mine
    assert "optim.lr=0.003" in mine and f"train.out_dir='{tmp_path}/run'" in mine, mine
    assert not re.search(r"n_kv_head|model\.bias|tie_embeddings|strategy\.name", mine), mine
    assert resolved.endswith(": model.n_kv_head=2, model.bias=True, model.tie_embeddings=True, "
                             "strategy.name='single'"), resolved
    assert not (tmp_path / "run").exists()


# -- 10. say when the optimizer or the whole run starts over -------------------------------------------------------

def test_weights_only_resume_is_said(run, tmp_path):
    """Item 10: a line for a fresh AdamW after a weights-only checkpoint. The line for starting over because
    the only checkpoint is damaged: test_init_from_another_model_is_refused's last launch."""
    imported = tmp_path / "imported"
    weights = run / "checkpoints" / "step_00000004" / "model.safetensors"
    assert zerodp_here("convert", weights, imported / "checkpoints" / "step_00000004", "--to", "zerodp", "--step", "4",
                  "--no-progress").returncode == 0  # a safetensors file records no step: --step names it
    r = train(imported, "train.max_steps=5")
    assert "holds weights only, no AdamW moments: AdamW starts fresh" in r.stderr, r.stderr


# -- 12. the console ------------------------------------------------------------------------------------------------

def test_console_without_progress_bar(ctrl_c_under_torchrun):
    """Item 12: a line per log interval (the last one at the step the run stopped), val_loss on screen, the
    state line after the first step, the summary in words, and none of torch's or DeepSpeed's
    FutureWarnings. The launch is the Ctrl-C test's: the summary is said after a Ctrl-C too."""
    _, err = ctrl_c_under_torchrun
    done = re.search(r"Ctrl-C: stopped after step (\d+)", err).group(1)
    assert re.search(r"zerodp: step 3/100000: loss \d+\.\d{4}, lr .*, grad_norm .*, [\d,]+ tokens/s", err), err
    assert re.search(rf"zerodp: step {done}/100000: loss", err), err
    assert re.search(r"zerodp: step 6: val_loss \d+\.\d{4}", err), err
    assert re.search(r"rank 0 holds after the first step: params [\d.]+ MiB.*optim (?!0\.0 )[\d.]+ MiB", err), err
    assert re.search(r"zerodp: run: \d+ steps; ", err), err
    assert "FutureWarning" not in err
    assert "{" not in err  # no raw Python dict in the summary


def test_stragglers_sustained_beyond_noise_only():
    """Item 12: spikes of 41% on random ranks (a busy host) are never reported; a rank slower for
    `patience` steps is reported once per slow spell, against the other ranks (not a 2-rank mean)."""
    import random

    from zerodp.resilience.stragglers import StragglerMonitor

    rng = random.Random(0)
    noisy = StragglerMonitor(["a", "b"], margin=0.2, patience=5)
    found = []
    for _ in range(300):
        times = [0.1 * (1.41 if rng.random() < 0.3 else 1.0) for _ in range(2)]
        found += noisy.update(times, [0.0, 0.0])
    assert found == []
    slow = StragglerMonitor(["a", "b"], margin=0.2, patience=5)
    spells = [slow.update([0.1, 0.15], [0.0, 0.0]) for _ in range(20)]
    assert [i for i, f in enumerate(spells) if f] == [4]  # the 5th slow step, once
    assert spells[4][0]["rank"] == 1 and abs(spells[4][0]["slower_by"] - 0.5) < 1e-9
    slow.update([0.1, 0.1], [0.0, 0.0])  # recovered; a new spell is reported again
    again = [slow.update([0.1, 0.15], [0.0, 0.0]) for _ in range(5)]
    assert again[4] and not any(again[:4])
    tiny = StragglerMonitor(["a", "b"], margin=0.2, patience=5)  # 1 ms forward passes jitter: no report
    assert not any(tiny.update([0.001, 0.0016], [0.0, 0.0]) for _ in range(20))


# -- 13. command line and files ----------------------------------------------------------------------------------------

def test_cli_details(run):
    """Item 13: overrides are optional in the usage error, --version, and checkpoint files follow the
    umask (safetensors creates its files 0600)."""
    r = zerodp_here("train")
    one_line_error(r, r"the following arguments are required: config;")
    r = zerodp_here("--version")
    from zerodp import __version__

    assert r.returncode == 0 and r.stdout.strip() == f"zerodp {__version__}"
    modes = {p.name: p.stat().st_mode & 0o777 for p in (run / "checkpoints" / "step_00000004").iterdir()}
    assert set(modes.values()) == {0o666 & ~_umask()}, modes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- 14. config discoverability ----------------------------------------------------------------------------------------

def test_zerodp_config_lists_every_key_with_default_type_and_doc():
    from zerodp.config import Config, field_docs

    r = zerodp_here("config")
    assert r.returncode == 0, r.stderr
    docs = field_docs()
    cfg = Config().to_dict()
    assert {f.key for f in docs} == {f"{s}.{k}" for s, body in cfg.items() for k in body}
    for f in docs:
        assert f.doc, f"{f.key} has no docstring"
        assert f"  {f.key} ({f.type}, default " in r.stdout
        assert f.doc in r.stdout
    assert "  train.max_steps (int, default 100)\n      Optimizer steps to train for." in r.stdout
    one_line_error(zerodp_here("config", "trian"), r"there is no config section 'trian'")


# -- 15. packaging -----------------------------------------------------------------------------------------------------

def test_pyproject_uses_no_deprecated_setuptools_form():
    """Item 15: `project.license` as a table is deprecated (and refused from 2027-02-18)."""
    from setuptools.config import pyprojecttoml
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = Distribution()
        pyprojecttoml.apply_configuration(dist, ROOT / "pyproject.toml")
    deprecations = [str(w.message).splitlines()[0] for w in caught if "Deprecat" in w.category.__name__]
    assert deprecations == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_a_straggler_is_said_once_and_its_spells_counted_at_the_end():
    """Issue 38 item 17: a shared machine slows ranks on and off all run long (7-11 straggler lines a run):
    each slow spell is in the step's record, a rank's first one alone gets a line, at most LINES ranks,
    and the end of the run counts them."""
    from zerodp.resilience.stragglers import StragglerMonitor

    monitor = StragglerMonitor(["a", "b"], margin=0.2, patience=2)
    found, said = [], []
    for _ in range(4):  # four slow spells of rank 1, each followed by a recovery
        for times in ([0.1, 0.15], [0.1, 0.15], [0.1, 0.1]):
            f = monitor.update(times, [0.0, 0.0])
            found += f
            said += monitor.worth_a_line(f)
    assert len(found) == 4 and len(said) == 1 and said[0]["rank"] == 1
    assert monitor.summary(["a", "b"]) == "rank 1 on b (slow compute, 4 slow spells)"
    many = StragglerMonitor([f"h{i}" for i in range(8)], margin=0.2, patience=1)
    f = many.update([0.1] * 4 + [0.2] * 4, [0.0] * 8)  # 4 of 8 ranks slow at once
    assert len(f) == 4 and len(many.worth_a_line(f)) == StragglerMonitor.LINES


def test_a_log_gets_step_lines_not_a_bar_and_a_few_epoch_lines(tmp_path):
    """Issue 38 item 17: with stderr a file, not a terminal, the progress bar's redraws filled a log (566
    refreshes); now the steps are lines every train.log_every steps. A small data set ends an epoch every
    few steps (61 lines in a 150-step fine-tune): the first EPOCH_LINES are said, the rest counted once."""
    from zerodp.trainer.loop import Steps

    text = tmp_path / "text.txt"
    text.write_bytes(bytes(97 + (i * 7919) % 26 if i % 50 else 10 for i in range(1500)))
    r = zerodp("train", ROOT / "configs/tiny.yaml", "strategy.name=single", "model.n_layer=1", "model.n_embd=16",
               "model.block_size=16", f"data.source={text}", "train.global_batch_size=32", "train.micro_batch_size=32",
               "train.eval_every=0", "train.sample_tokens=0", "checkpoint.every=0", "train.max_steps=12",
               "train.log_every=6", f"train.out_dir={tmp_path / 'run'}")  # train.progress: true, the default
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "train: " not in r.stderr, r.stderr
    assert re.findall(r"zerodp: step (\d+)/12: loss", r.stderr) == ["6", "12"], r.stderr
    said = re.findall(r"zerodp: epoch (\d+) of the training data \([\d,]+ samples\) ended in step", r.stderr)
    assert said == [str(e) for e in range(1, Steps.EPOCH_LINES + 1)], r.stderr
    assert re.search(r"zerodp: \d+ more epoch\(s\) of the training data ended, the last \(epoch \d+\) in step 1[12]",
                     r.stderr), r.stderr
