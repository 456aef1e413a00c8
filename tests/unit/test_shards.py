"""tests.support.shards: the shares of `make test` are disjoint, cover every test file, and are balanced."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.shards import BUILD_SECONDS, BUILDS_CPU_ADAM, SECONDS, UNIT_SECONDS, assignment, keep, parse_shard

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_shares_cover_every_file_once(n):
    files = sorted(ROOT.glob("*/test_*.py"))
    shares = [keep(files, f"{k}/{n}") for k in range(n)]
    assert sum(len(s) for s in shares) == len(files) and set().union(*shares) == set(files)
    assert all(p in shares[0] for p in files if p.parent.name == "unit")  # the unit tier: share 0


def test_two_shares_are_balanced_by_the_table():
    names = sorted(p.name for p in (ROOT / "distributed").glob("test_*.py"))
    share = assignment(names, 2)
    load = [sum(SECONDS.get(f, 0) for f in names if share[f] == k) for k in (0, 1)]
    load[0] += UNIT_SECONDS  # the unit tier runs in share 0
    load[share[BUILDS_CPU_ADAM[0]]] += BUILD_SECONDS
    assert abs(load[0] - load[1]) <= max(SECONDS.values()) * 0.1 + 30, load
    assert assignment(list(reversed(names)), 2) == share  # the order files come in changes nothing


@pytest.mark.parametrize("n", [2, 3])
def test_the_files_that_build_cpu_adam_share_a_share(n):
    """Its build is paid once, by the first of them, in the share they all run in."""
    names = sorted(p.name for p in (ROOT / "distributed").glob("test_*.py"))
    assert set(BUILDS_CPU_ADAM) <= set(names)
    assert len({assignment(names, n)[f] for f in BUILDS_CPU_ADAM}) == 1


@pytest.mark.parametrize("bad", ["2/2", "-1/2", "x/2", "1"])
def test_a_bad_share_is_refused(bad):
    with pytest.raises(ValueError):
        parse_shard(bad)
