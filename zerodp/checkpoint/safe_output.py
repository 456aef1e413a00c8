"""Outputs that never cost data: every zerodp command that writes a folder goes through here.

    check_output(dst, inputs=[src], overwrite=args.overwrite, command="zerodp convert --to zerodp",
                 not_replaceable=why_not)        # refuses before anything is read or written
    with staged(dst) as tmp:                     # a fresh hidden sibling of dst
        ...write the whole output into tmp...
    # dst is now the new output; an old one was deleted only after the new one had taken its place

The rules: an output never overlaps an input (the same folder, or either one inside the other, with
symlinks resolved); a non-empty output folder is replaced only with `overwrite`, and only when the
command recognises it as its own earlier output of the same kind (`not_replaceable(dst)` is None); a
training run folder is never replaced. Nothing is deleted before the new output is complete and on
disk; a failure at any point, Ctrl-C included, leaves the old output as it was and no temporary
folder behind. No torch import: `zerodp prepare` and friends use it too.
"""

from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

from zerodp.errors import UserError

# What makes a folder a training run (zerodp.trainer.loop writes all three into train.out_dir).
RUN_MARKERS = ("checkpoints", "metrics.jsonl", "config.yaml")


def refuse_overlap(output: str | Path, inputs: Iterable[str | Path]) -> None:
    """UserError if `output` is an input, lies inside one, or holds one (symlinks resolved)."""
    out = Path(output).resolve()
    for given in inputs:
        inp = Path(given).resolve()
        if out == inp:
            rel = "is"
        elif inp in out.parents:
            rel = "lies inside"
        elif out in inp.parents:
            rel = "holds"
        else:
            continue
        raise UserError(f"the output {output} {rel} the input {given}; writing it could destroy what is being "
                        f"read, so choose an output folder that neither holds nor lies inside any input")


def check_output(dst: str | Path, inputs: Iterable[str | Path], overwrite: bool, command: str,
                 not_replaceable: Callable[[Path], str | None]) -> None:
    """Refuse (UserError) to write `dst` unless it is new, empty, or (with `overwrite`) an earlier output
    this command may replace. `not_replaceable(folder)` gets a non-empty folder and returns None if
    it is the command's own earlier output of the same kind, else what it is ("holds x.json, which
    ... did not write"), which goes into the message."""
    refuse_overlap(dst, inputs)
    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} exists and is a file; choose a new folder for the output")
    if not dst.is_dir() or not any(dst.iterdir()):
        return
    marker = next((m for m in RUN_MARKERS if (dst / m).exists()), None)
    why = f"is a training run folder (it has {marker})" if marker else not_replaceable(dst)
    if why:
        raise UserError(f"{dst} {why}; {command} never replaces it, even with --overwrite; choose a new folder")
    if not overwrite:
        raise UserError(f"{dst} already exists and is not empty; choose a new folder or pass --overwrite")


@contextmanager
def staged(dst: str | Path) -> Iterator[Path]:
    """Yield a new empty folder beside `dst` (`.DST.tmp-<pid>-<random>`); it becomes `dst` when the
    block ends normally.

    An existing `dst` (check_output has allowed it) is renamed aside, the new folder renamed in, and
    only then the old one deleted. If the block raises (KeyboardInterrupt included) or a rename fails,
    the temporary folder is removed and `dst` is left as it was. A symlinked `dst` keeps its link: the
    folder it points to is the one replaced."""
    final = Path(dst).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    # Hidden names: zerodp's globs (step_*, *.safetensors) never take a half-written output for a real one.
    token = f"{os.getpid()}-{secrets.token_hex(3)}"
    tmp, old = final.with_name(f".{final.name}.tmp-{token}"), final.with_name(f".{final.name}.old-{token}")
    tmp.mkdir()  # not mkdtemp: its mode 0700 would become the output's
    moved_aside = False
    try:
        yield tmp
        _fsync_tree(tmp)  # the new output is on disk before the old one can go
        if final.exists():
            os.rename(final, old)
            moved_aside = True
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        if moved_aside and not final.exists():
            os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if moved_aside:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        _fsync_dir(d)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
