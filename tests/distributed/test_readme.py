"""The README's commands run as written: every command of its ```bash blocks, and each ```python block,
in the order the README gives them, in a fresh copy of the repository (its tracked files, as they are
in this checkout), each one exiting 0. A command may read only what an earlier one wrote.

The copy runs with this environment's bin folder first on PATH (zerodp, torchrun, deepspeed) and
PYTHONPATH set to the copy, on the CPU like the rest of the suite (tests/conftest.py hides the GPUs).
What is not run is left out by one of these rules, and nothing else:

- PLACEHOLDER: a command a reader completes (`CONFIG.yaml`, `path/to/...`, `...`);
- NEEDS_GPUS: a launch that needs GPUs or several nodes (`deepspeed --num_gpus` without
  `DS_ACCELERATOR=cpu`, the multinode launchers, `sbatch`);
- `make test`: the suite itself.

`make quickstart` runs through the Makefile against this environment (`VENV=` this one, its install
step left out with `make -o`): it is the command that trains `runs/tiny`, which later commands read.
In the copy, configs/tiny.yaml (the quick start's config) trains a tenth of its steps, with its
evaluations and checkpoints a tenth as far apart (`SHORTER`): every part of the run (warm-up, both
evaluations, both checkpoints and the retention, the end-of-run sample and summary) still runs, and a
later command reads a run complete at its last step as it would at 500, in a tenth of the time. The
walk-through's own run and evaluation are shortened the same way in the copy's README (`SHORTER_README`:
20 of its 60 steps with the evaluation at the last one, as written; `zerodp eval` on 20,000 of its 100,000
tokens): the commands after them read the same kinds of folders.
The counts below pin what runs and what each rule leaves out, so that a rule that starts to skip more
(or a README that loses its commands) fails here. `pytest -s` prints each command's seconds: most of
the time is make quickstart's steps and the walk-through's training and `zerodp eval`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent

PLACEHOLDER = re.compile(r"CONFIG\.yaml|path/to/|\.\.\.")
NEEDS_GPUS = re.compile(r"^(?!.*DS_ACCELERATOR=cpu).*\bdeepspeed --num_gpus|launchers/multinode_|\bsbatch\b")
THE_SUITE = "make test"
QUICKSTART = "make quickstart"

EXPECTED_RUN = 19  # 18 shell commands and 1 python block
EXPECTED_SKIPPED = {"placeholder": 17, "needs GPUs": 1, "the suite itself": 1}
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
# configs/tiny.yaml's lines that the copy shortens by 10: the quick start's steps, and its evaluations and
# checkpoints, 2 each as in the shipped config.
SHORTER = {"max_steps: 500": "max_steps: 50", "eval_every: 250": "eval_every: 25", "every: 250": "every: 25"}
# The README's words that the copy shortens: the walk-through's training run and its `zerodp eval`.
SHORTER_README = {"train.max_steps=60 train.eval_every=60": "train.max_steps=20 train.eval_every=20",
                  "--max-tokens 100000": "--max-tokens 20000"}


@dataclass
class Command:
    line: int  # 1-based line of the README where it starts
    kind: str  # "bash" or "python"
    text: str  # what runs: a shell command (with its heredoc), or a python block's source
    shell: str  # the shell words, comments and heredoc bodies left out: what the rules read

    @property
    def skip(self) -> str | None:
        """The rule that leaves this command out, or None when it runs."""
        if self.kind == "python":
            return None
        if self.shell == THE_SUITE:
            return "the suite itself"
        if PLACEHOLDER.search(self.shell):
            return "placeholder"
        if NEEDS_GPUS.search(self.shell):
            return "needs GPUs"
        return None


def commands(text: str) -> list[Command]:
    """The commands of the ```bash blocks and the ```python blocks of `text`, in order."""
    out: list[Command] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        kind, start = fence[3:].strip(), i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"README.md:{i + 1}: unclosed code block"
        body = lines[start:end]
        if kind == "python":
            out.append(Command(start, "python", "\n".join(body) + "\n", ""))
        elif kind == "bash":
            out.extend(shell_commands(body, start + 1))
        i = end + 1
    return out


def shell_commands(body: list[str], first_line: int) -> list[Command]:
    out: list[Command] = []
    k = 0
    while k < len(body):
        line, at = body[k], first_line + k
        k += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [line]
        while parts[-1].rstrip().endswith("\\"):  # continuation lines
            parts.append(body[k])
            k += 1
        shell = " ".join(p.rstrip().removesuffix("\\") for p in parts)
        heredoc = HEREDOC.search(shell)
        if heredoc:  # its body, up to the delimiter line, goes to the command's stdin
            delimiter = heredoc.group(2)
            while body[k].strip() != delimiter:
                parts.append(body[k])
                k += 1
            parts.append(body[k])
            k += 1
        words = " ".join(shlex.split(shell, comments=True))
        out.append(Command(at, "bash", "\n".join(parts) + "\n", words))
    return out


def test_readme_commands_and_skip_rules():
    """Fast: what the rules leave out of the README's commands, by rule, and how many run."""
    cmds = commands(README.read_text(encoding="utf-8"))
    skipped: dict[str, int] = {}
    for c in cmds:
        if c.skip:
            skipped[c.skip] = skipped.get(c.skip, 0) + 1
    ran = [c for c in cmds if not c.skip]
    assert skipped == EXPECTED_SKIPPED and len(ran) == EXPECTED_RUN, (
        f"README commands: {len(ran)} would run (expected {EXPECTED_RUN}), left out {skipped} "
        f"(expected {EXPECTED_SKIPPED}); update the counts in tests/test_readme.py only for a README "
        f"change that adds or removes commands:\n"
        + "\n".join(f"  README.md:{c.line}: [{c.skip or 'runs'}] {c.shell or '(python block)'}" for c in cmds))
    assert any(c.shell == QUICKSTART for c in ran)


def test_readme_lists_every_doc():
    """The Documentation table names every docs/*.md, one row each."""
    text = README.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| \[(docs/[\w.-]+\.md)\]", text, re.M))
    docs = (str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    missing = sorted(d for d in docs if d not in listed)
    assert not missing, f"README.md's Documentation table leaves out {', '.join(missing)}"


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked files as they are in this checkout (edits included), nothing else."""
    r = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    for name in r.stdout.decode().split("\0"):
        src = ROOT / name
        if name and src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def shorten_quickstart(config: Path) -> None:
    """SHORTER's lines of the copy's quick-start config, each found once (whole lines), replaced."""
    text = config.read_text(encoding="utf-8")
    for old, new in SHORTER.items():
        pattern = re.compile(rf"^(\s*){re.escape(old)}$", re.M)
        assert len(pattern.findall(text)) == 1, f"{config.name}: expected one line '{old}' (update SHORTER)"
        text = pattern.sub(lambda m: m.group(1) + new, text)
    config.write_text(text, encoding="utf-8")


def shorten_walkthrough(readme: Path) -> None:
    """SHORTER_README's words of the copy's README, each found once, replaced."""
    text = readme.read_text(encoding="utf-8")
    for old, new in SHORTER_README.items():
        assert text.count(old) == 1, f"README.md: expected '{old}' once (update SHORTER_README)"
        text = text.replace(old, new)
    readme.write_text(text, encoding="utf-8")


def argv_of(c: Command) -> tuple[list[str], str | None]:
    """How `c` runs: the argv and its stdin."""
    if c.kind == "python":
        return ["python", "-"], c.text
    if c.shell == QUICKSTART:
        # The Makefile's quickstart recipe, on this environment: VENV names it, and its install step
        # (which would pip-install the copy into it) is taken as done.
        venv = BIN.parent
        make = f"make quickstart VENV={shlex.quote(str(venv))} -o {shlex.quote(str(venv / '.installed'))}"
        return ["bash", "-c", make], None
    return ["bash", "-c", c.text], None


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout (git ls-files makes the copy)")
@pytest.mark.skipif(not all((BIN / tool).exists() for tool in ("zerodp", "torchrun", "deepspeed")),
                    reason=f"zerodp, torchrun and deepspeed must be installed in {BIN}")
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_readme_commands_run_in_order_in_a_fresh_copy(tmp_path):
    copy = fresh_copy(tmp_path / "zerodp")
    shorten_quickstart(copy / "configs" / "tiny.yaml")
    shorten_walkthrough(copy / "README.md")
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONPATH=str(copy))
    r = subprocess.run(["python", "-c", "import zerodp; print(zerodp.__file__)"], cwd=copy, env=env,
                       capture_output=True, text=True, check=True)
    assert Path(r.stdout.strip()).is_relative_to(copy), r.stdout

    ran, times = 0, []
    for c in commands((copy / "README.md").read_text(encoding="utf-8")):
        if c.skip:
            continue
        argv, stdin = argv_of(c)
        t0 = time.monotonic()
        r = subprocess.run(argv, cwd=copy, env=env, input=stdin, capture_output=True, text=True, timeout=1800)
        times.append((time.monotonic() - t0, c))
        out = (r.stdout + r.stderr)[-6000:]
        assert r.returncode == 0, f"README.md:{c.line}: exit {r.returncode}: {c.shell or c.text}\n{out}"
        ran += 1
    assert ran == EXPECTED_RUN
    print("\nREADME commands, seconds each:")
    for seconds, c in times:
        print(f"  {seconds:6.1f}  README.md:{c.line}: {c.shell or '(python block)'}")
    print(f"  {sum(s for s, _ in times):6.1f}  in all")
