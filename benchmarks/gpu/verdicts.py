"""The checks' verdicts: pure functions of what a run measured, tested on CPU
(tests/distributed/test_gpu_checks.py)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 2**30
EQUIVALENCE_TOLERANCE = 1e-4
"""fp32 runs of the same math (another strategy, world size, accumulation, offload, recomputation) agree
within this (tests/distributed/test_equivalence.py's promise)."""


@dataclass
class Result:
    check: str
    ok: bool
    detail: str
    skip: bool = False
    """Not run (a group past the --budget, a row this zerodp has no key for): neither a pass nor a failure."""

    def line(self) -> str:
        return f"{'SKIP' if self.skip else 'PASS' if self.ok else 'FAIL'} {self.check}: {self.detail}"


def exit_code(results: list[Result]) -> int:
    """1 if any check failed (or none ran), else 0."""
    ran = [r for r in results if not r.skip]
    return 0 if ran and all(r.ok for r in ran) else 1


def summary(results: list[Result]) -> str:
    failed = sum(not r.ok and not r.skip for r in results)
    skipped = sum(r.skip for r in results)
    return (f"gpu_checks: {len(results) - failed - skipped} passed, {failed} failed"
            + (f", {skipped} skipped" if skipped else ""))


def same_losses(check: str, got: list[float], want: list[float], tolerance: float = 0.0) -> Result:
    """Equal lengths and every loss within `tolerance` (0: bit-identical)."""
    if len(got) != len(want):
        return Result(check, False, f"{len(got)} losses against {len(want)}")
    worst = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not abs(a - b) <= tolerance]
    if bad:
        i = bad[0]
        return Result(check, False, f"loss {i} is {got[i]!r}, expected {want[i]!r} (max |diff| {worst:.3g}"
                                    f"{', tolerance %g' % tolerance if tolerance else ''})")
    what = "bit-identical" if tolerance == 0 else f"max |diff| {worst:.2g} <= {tolerance:g}"
    if tolerance and got == want:
        what += " (bit-identical)"
    return Result(check, True, f"{len(got)} losses {what}")


def within(check: str, figures: list[tuple[str, float, float]]) -> Result:
    """figures: (what, measured, limit) in bytes; passes when every measured <= its limit."""
    parts = [f"{w} {m / GIB:.2f} GiB {'<=' if m <= lim else '>'} {lim / GIB:.2f} GiB" for w, m, lim in figures]
    return Result(check, all(m <= lim for _, m, lim in figures), "; ".join(parts))


def bf16_bands(strategies_md: str) -> dict[str, float]:
    """Per strategy, the bf16 band against the fp32 reference that docs/strategies.md's precision table
    states and the tests pin: its row 'bf16 band vs fp32 reference', the 'tested < x' bound where a cell
    has one, else its '< x'. The header names the columns ('ddp / single', 'zero1/2/3', 'fsdp')."""
    lines = strategies_md.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("| bf16 band vs fp32 reference"))
    header = next(lines[i] for i in range(row, -1, -1) if lines[i].startswith("| |"))
    bands = {}
    for names, cell in zip(_cells(header), _cells(lines[row])):
        found = re.search(r"tested < ([0-9.]+)", cell) or re.search(r"< ([0-9.]+)", cell)
        parts = [p.strip() for p in names.split("/")]
        stem = re.match(r"[a-z]+", parts[0]).group(0)
        for p in parts:
            bands[stem + p if p.isdigit() else p] = float(found.group(1))
    return bands


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")][1:]


def band_between(a: str, b: str, bands: dict[str, float]) -> float:
    """Two bf16 runs, each within its band of the same fp32 run, differ by at most the sum of the bands."""
    return bands[a] + bands[b]


def host_syncs(check: str, counts: dict[int, int], log_every: int, first: int, last: int,
               where: dict[int, str] | None = None) -> Result:
    """Host syncs per optimizer step over steps first..last (`counts`: syncs seen from a step's start to
    the next step's, by step). The loop fetches its figures once per train.log_every steps in one device
    sync (zerodp.telemetry.step_metrics.fetch_interval), so a step that is not a sync point has none and
    a sync point one: at most 1 / log_every per step."""
    steps = range(first, last + 1)
    between = {s: counts.get(s, 0) for s in steps if s % log_every and counts.get(s, 0)}
    total = sum(counts.get(s, 0) for s in steps)
    points = sum(1 for s in steps if s % log_every == 0)
    figure = f"{total} over steps {first}-{last} ({total / len(steps):.2f} per step, limit 1/{log_every} = " \
             f"{points / len(steps):.2f})"
    if between:
        s = min(between)
        at = f" at {where[s]}" if where and s in where else ""
        return Result(check, False, f"{figure}; step {s}, not a sync point, synced {between[s]} times{at}")
    if total > points:
        return Result(check, False, f"{figure}: more than one per sync point")
    return Result(check, True, figure)


def evaluation(check: str, records: list[dict], every: int, steps: int, losses: list[float],
               without: list[float]) -> Result:
    """Validation at every `every`-th step and the last, a finite val_loss each, and training unchanged:
    its losses bit-identical to the run without evaluation."""
    want = sorted({s for s in range(every, steps + 1, every)} | {steps})
    got = [r["step"] for r in records if "val_loss" in r]
    if got != want:
        return Result(check, False, f"val_loss at steps {got}, expected {want}")
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if not all(math.isfinite(v) for v in vals):
        return Result(check, False, f"val_loss {vals}")
    same = same_losses(check, losses, without)
    if not same.ok:
        return Result(check, False, "training changed by evaluation: " + same.detail)
    return Result(check, True, f"val_loss {', '.join(f'{v:.4f}' for v in vals)} at steps {want}; training losses "
                               f"bit-identical to the run without evaluation")


def hsdp_group(world: int) -> int:
    """strategy.shard_group_size for HSDP on one machine of `world` GPUs: two replicas of world/2 where
    world >= 4; on 2 or 3 GPUs groups of 1 (a forced one rank per node: every rank a replica)."""
    return world // 2 if world >= 4 and world % 2 == 0 else 1


def throughput(check: str, got: dict, fits: bool, plan: str) -> Result:
    """A 1B-class run's figures (benchmarks/gpu_throughput.run), beside the planner's: a run that failed
    fails; one the planner says does not fit is skipped (a pass); MFU and tokens/s are printed, not judged."""
    if not fits:
        return Result(check, True, f"skipped: the planner says it does not fit ({plan})")
    if "error" in got:
        return Result(check, False, got["error"])
    mfu = f"{got['mfu']:.1%}" if got.get("mfu") is not None else "n/a"
    steps = f" ({got['steps']})" if got.get("steps") else ""
    return Result(check, True, f"{got['tokens_per_s_per_device']:,.0f} tokens/s per GPU, MFU {mfu}, step "
                               f"{got['step_s']:.3f} s{steps}, peak {got.get('peak') or 'n/a'} (planned: {plan})")
