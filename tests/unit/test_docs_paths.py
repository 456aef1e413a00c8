"""Every file and module README.md and docs/*.md name exists: repository paths (`zerodp/...`,
`benchmarks/...`, `configs/...`, `launchers/...`, `tests/...`, `docs/...`) and dotted names
(`zerodp.x.y`, a module or something a module defines). A dotted name that is neither must be a key
zerodp writes (safetensors metadata such as `zerodp.tied`): a string the package's source holds.
Paths with a placeholder (`<family>`, `*`) are left out."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:zerodp|benchmarks|configs|launchers|tests|docs)/[\w./<>*-]*)")
DOTTED = re.compile(r"(?<![\w/.-])(zerodp(?:\.\w+)+)")


def named(doc: str, pattern: re.Pattern) -> list[tuple[int, str]]:
    """(line, name) for each match of `pattern` in `doc`, trailing punctuation left out."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(i, m.group(1).rstrip(".,:;)")) for i, line in enumerate(text.splitlines(), 1)
            for m in pattern.finditer(line)]


def resolves(dotted: str) -> bool:
    """`dotted` is a module, or a name a module defines (zerodp.planner.training.estimate_for_run)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def package_strings() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "zerodp").rglob("*.py"))


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_named_exists(doc):
    missing = [f"{doc}:{i}: {p}" for i, p in named(doc, PATH)
               if not any(c in p for c in "<>*") and not (ROOT / p).exists()]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS)
def test_every_module_named_exists(doc):
    source = None
    missing = []
    for i, name in named(doc, DOTTED):
        if resolves(name):
            continue
        source = source if source is not None else package_strings()
        if f'"{name}"' not in source:  # a metadata key zerodp writes
            missing.append(f"{doc}:{i}: {name}")
    assert not missing, "modules or names that do not exist:\n" + "\n".join(missing)


def test_the_check_finds_what_is_gone():
    assert not (ROOT / "zerodp/launcher.py").exists() and not resolves("zerodp.planner.estimate_for_run")
    assert resolves("zerodp.distributed.launcher") and resolves("zerodp.planner.training.estimate_for_run")


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_what_the_readmes_commands_write_is_ignored_by_git():
    import subprocess

    written = ["runs/tiny/metrics.jsonl", "tok.json", "data/stdlib/train.bin", "export/model.safetensors",
               "hf-llama/config.json"]
    source = ["zerodp/data/batches.py", "configs/tiny.yaml"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *written, *source], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.stdout.split() == written, r.stdout
