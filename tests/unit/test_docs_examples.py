"""The docs' `zerodp plan` examples are the planner's real output.

A fenced block whose first line is `$ zerodp plan ARGS` must hold, below that line, exactly what the
command prints (stdout, or the one-line error on stderr). Any other block that looks like plan output
fails the test too, so an example cannot escape the check by losing its command line. After a change
to the planner, rewrite the examples with

    .venv/bin/python -m tests.unit.test_docs_examples --write

and read the diff: prose around the examples quotes some of their numbers.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/memory_model.md", "README.md")
COMMAND = "$ zerodp plan "
# Lines only `zerodp plan` prints: its header, the table's column names, the choice.
LOOKS_LIKE_OUTPUT = re.compile(r"^(zerodp plan: |strategy +micro +accum +ckpt +params|Choice: |Nothing fits on )")


@dataclass
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lines: list[str]  # between the fences

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    """Every fenced (```) block of `doc`, a path relative to the repository root."""
    out, start, body = [], None, []
    for i, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            if start is None:
                start, body = i, []
            else:
                out.append(Block(doc, start, body))
                start = None
        elif start is not None:
            body.append(line)
    assert start is None, f"{doc}:{start}: unclosed code block"
    return out


def examples() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc) if b.lines and b.lines[0].startswith(COMMAND)]


def output_of(command: str) -> str:
    """What `$ zerodp plan ...` prints, run in-process from the repository root, without the final newline."""
    from zerodp.cli.commands import main

    argv = shlex.split(command.removeprefix("$ "))[1:]
    buffer, cwd = io.StringIO(), os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            main(argv)
    finally:
        os.chdir(cwd)
    return buffer.getvalue().rstrip("\n")


def test_docs_have_checked_examples():
    assert any(b.doc == "docs/memory_model.md" for b in examples())


@pytest.mark.parametrize("block", examples(), ids=lambda b: b.where)
def test_example_is_the_planners_output(block):
    expected = output_of(block.lines[0])
    assert "\n".join(block.lines[1:]) == expected, (
        f"{block.where}: the example is not what `{block.lines[0][2:]}` prints; "
        f"regenerate with: python -m tests.unit.test_docs_examples --write")


@pytest.mark.parametrize("doc", DOCS)
def test_no_unchecked_plan_output(doc):
    unchecked = [b.where for b in blocks(doc) if not (b.lines and b.lines[0].startswith(COMMAND))
                 and any(LOOKS_LIKE_OUTPUT.match(line) for line in b.lines)]
    assert not unchecked, (f"blocks of `zerodp plan` output without their command at {', '.join(unchecked)}: "
                           f"start each with `{COMMAND}...` on its first line so this test checks it")


def write() -> None:
    """Replace every example's output with what its command prints now."""
    for doc in DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for b in reversed([b for b in examples() if b.doc == doc]):
            first = b.line  # index of the command line (the fence is at index b.line - 1)
            lines[first + 1:first + len(b.lines)] = [line + "\n" for line in output_of(b.lines[0]).splitlines()]
        if "".join(lines) != text:
            (ROOT / doc).write_text("".join(lines), encoding="utf-8")
            print(f"rewrote the examples of {doc}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.unit.test_docs_examples --write")
    write()
