"""Rank functions of tests/distributed/test_verify.py: `zerodp verify` under the launcher's processes."""

from __future__ import annotations

import contextlib
import io


def verify(calls: list[list[str]]) -> list[dict]:
    """`zerodp verify ARGV` for each argv, on every rank of the world (both runs in its process group):
    per call the exit code and, on rank 0, what it printed on stdout and stderr. The command's function is called
    as zerodp's main calls it, without main's exit for a failed distributed run (it would end the rank)."""
    from zerodp.cli.commands import build_parser

    out = []
    for argv in calls:
        args, extra = build_parser().parse_known_args(["verify", *argv])
        args.overrides = list(args.overrides) + extra
        printed, said = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
            code = args.func(args)
        out.append({"code": code, "stdout": printed.getvalue(), "stderr": said.getvalue()})
    return out
