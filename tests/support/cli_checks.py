"""Checks of what a command prints: the one-line error every bad input gets."""

from __future__ import annotations

import re


def one_line_error(capsys, code: int, pattern: str) -> None:
    """The command returned exit code 2 and wrote one line on stderr, no traceback, matching `pattern`."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]
