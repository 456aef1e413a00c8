"""benchmarks/checkpoint_stall.py replaces its run folders under --out: it refuses a folder it did not make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stall(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks/checkpoint_stall.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_an_out_folder_holding_other_files_is_refused_and_left_alone(tmp_path):
    (tmp_path / "ddp-sync").mkdir()
    (tmp_path / "ddp-sync" / "mine.txt").write_text("keep")
    r = stall("--out", tmp_path, "--strategies", "ddp")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"checkpoint_stall.py: error: --out {tmp_path}: exists and is not a folder this benchmark made "
        "(nor an empty one); name a new or empty folder"]
    assert (tmp_path / "ddp-sync" / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp-sync"]
