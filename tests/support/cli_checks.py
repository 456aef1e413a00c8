"""Checks of what a command prints: the one-line error every bad input gets; and `zerodp_here`, a
command run in this process."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one_line_error(capsys, code: int, pattern: str) -> None:
    """The command returned exit code 2 and wrote one line on stderr, no traceback, matching `pattern`."""
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(pattern, lines[0]), lines[0]


def zerodp_here(*args, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """`zerodp ARGS` run by zerodp.cli.commands.main in this process, from `cwd`: its exit code and what it
    printed, as `python -m zerodp ARGS` gives them, without the seconds a new process spends importing
    torch. For the commands that start no process group and train nothing (`train --dry-run`, `config`,
    `inspect`, `convert`, usage errors); what main changes in the process (environment, warning filters,
    working directory) is put back."""
    from zerodp.cli.commands import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    environ = dict(os.environ)
    try:
        with (warnings.catch_warnings(), contextlib.chdir(cwd), contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse: --version, a usage error
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(["zerodp", *argv], code, out.getvalue(), err.getvalue())
