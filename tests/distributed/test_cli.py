"""Bad input on the command line: one line on stderr saying what and how to fix, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli_checks import zerodp_here
from tests.support.harness import ROOT, base_env


def zerodp(*args, cwd=ROOT):
    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    return subprocess.run([sys.executable, "-m", "zerodp", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)


def one_line_error(r, pattern: str):
    import re

    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert re.search(pattern, lines[0]), lines[0]


def test_help_lists_subcommands():
    r = zerodp("--help")
    assert r.returncode == 0 and "train" in r.stdout and "plan" in r.stdout


@pytest.mark.parametrize("setup, args, pattern", [
    (None, ["train", "missing.yaml"], r"^zerodp: error: config file missing.yaml not found"),
    ("train:\n  max_steps: [1\n", ["train", "{cfg}"], r"YAML syntax error in .*cfg.yaml at line"),
    ("train:\n  max_step: 3\n", ["train", "{cfg}"], r"unknown key 'train.max_step' .*did you mean 'train.max_steps'"),
    ("train:\n  max_steps: x\n", ["train", "{cfg}"], r"train.max_steps in .* must be an integer, got 'x'"),
    ("strategy:\n  name: fsdb\n", ["train", "{cfg}"], r"strategy.name='fsdb' is not one of .*did you mean 'fsdp'"),
    ("train:\n  global_batch_size: 6\n  micro_batch_size: 4\n", ["train", "{cfg}"],
     r"not a multiple of train.micro_batch_size=4"),
    ("train:\n  global_batch_size: 6\n  micro_batch_size: 2\n",
     ["train", "{cfg}", "--dry-run", "train.micro_batch_size=4"],
     r"train.global_batch_size=6 is not a multiple of train.micro_batch_size=4"),
    ("model:\n  n_layer: 1\n", ["train", "{cfg}", "train.out_dir={tmp}/afile/sub", "train.progress=false",
                               "train.sample_tokens=0", "data.max_bytes=20000", "model.block_size=16"],
     r"train.out_dir .*afile/sub is not writable \(.*\); choose a directory you can write to"),
    (None, ["train", "{cfg}", "bogus"], r"override 'bogus' is not of the form section.key=value"),
    (None, ["frobnicate"], r"^zerodp: error: argument .*invalid choice: 'frobnicate'"),
    (None, ["train", "{cfg}", "--nope"], r"unrecognized arguments: --nope"),
    (None, ["train", "{cfg}", "data.source=/nonexistent/corpus"], r"data.source '/nonexistent/corpus' not found"),
    ("", ["train", "{cfg}", "data.source={tmp}/empty.txt"], r"data.source '.*empty.txt' holds no text"),
    ("", ["train", "{cfg}", "data.source={tmp}/empty.bin"], r"data.source .*empty.bin is empty; give a .bin file"),
    (None, ["plan", "--model", "gpt5"], r"unknown model 'gpt5'; did you mean 'gpt2'\? known models: gpt2, "),
    (None, ["plan", "--model", "gpt2", "--gpus", "0"], r"--gpus 0: GPUs per node must be at least 1"),
    (None, ["plan", "--model", "gpt2", "--hbm", "lots"], r"--hbm 'lots' is not a size; write a number and a unit"),
    (None, ["convert", "/nope", "{tmp}/out"], r"/nope does not exist; pass a checkpoint folder or .safetensors file"),
    (None, ["convert", "{cfg}", "{tmp}/out"], r"cfg.yaml is not a format zerodp reads"),
    (None, ["inspect", "{tmp}/afile"], r"afile is not a format zerodp reads"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, setup, args, pattern):
    """Errors found in the training start-up (the data, the run folder) come from a launched `python -m
    zerodp`; the rest (usage, config, plan, convert, inspect), found before a process group or any training,
    from zerodp's main run in this process (tests.support.cli_checks.zerodp_here: the same exit code and
    output, without a second of imports each)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(setup or "train:\n  progress: false\n")
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.bin").write_bytes(b"")
    args = [a.format(cfg=cfg, tmp=tmp_path) for a in args]
    start_up = args[0] == "train" and any(a.startswith(("data.source=", "train.out_dir=")) for a in args)
    one_line_error(zerodp(*args) if start_up else zerodp_here(*args), pattern)


def test_dry_run_prints_resolved_config(tmp_path):
    r = zerodp("train", ROOT / "configs/tiny.yaml", "--dry-run", "train.max_steps=9")
    assert r.returncode == 0, r.stderr
    assert "max_steps: 9" in r.stdout and "grad_accum_steps 2" in r.stdout


def test_zero_without_a_cpp_compiler_is_one_line_before_anything_is_written(tmp_path):
    """DeepSpeed compiles cpu_adam at the first strategy.offload_optimizer launch. Before: no compiler meant
    ninja's failure and a 68-157-line traceback (exit 1), after the run folder was made."""
    out = tmp_path / "run"
    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "CXX"):
        env.pop(k, None)
    # this environment's python and ninja, no compiler; an extensions folder where nothing is built yet
    env.update(PATH=str(Path(sys.executable).parent), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    r = subprocess.run([sys.executable, "-m", "zerodp", "train", ROOT / "configs/tiny.yaml", "strategy.name=zero2",
                        "strategy.offload_optimizer=true", "model.n_layer=1", "model.block_size=16",
                        "data.max_bytes=20000", "train.progress=false", f"train.out_dir={out}"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    one_line_error(r, r"^zerodp: error: strategy.name=zero2 with strategy.offload_optimizer=true: DeepSpeed compiles "
                      r"its C\+\+ op cpu_adam at the first launch and there is no C\+\+ compiler \(no c\+\+ on "
                      r"PATH\); install one \(apt-get install g\+\+")
    assert not out.exists()
