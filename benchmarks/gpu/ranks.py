"""Checks across ranks, at world = every visible GPU (2+): the fp32 equivalence of each strategy with
`single`, bf16 and fp16 against ddp within docs/strategies.md's bands, HSDP, and a killed rank."""

from __future__ import annotations

from benchmarks.gpu.runner import ROOT, Setup, launch, run_spec
from benchmarks.gpu.state import killed_rank
from benchmarks.gpu.verdicts import EQUIVALENCE_TOLERANCE, Result, band_between, bf16_bands, hsdp_group, same_losses

NAMES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def reference(setup: Setup, arch: str = "gpt2") -> dict:
    """`single` on one device in fp32, the global batch of setup.world ranks (once per arch; RuntimeError
    if it did not run)."""
    from benchmarks.gpu.runner import LLAMA

    key = f"single {arch}"
    if key not in setup.cache:
        runs = [run_spec(setup.tiny() + ["strategy.name=single"], setup.tmp / "single-gpt2", 8, weights=True),
                run_spec(setup.tiny() + LLAMA + ["strategy.name=single"], setup.tmp / "single-llama", 8)]
        gpt2, llama = launch(setup, runs, 1)
        for name, got in (("single gpt2", gpt2), ("single llama", llama)):
            if "error" in got:
                raise RuntimeError(f"the single-device reference failed: {got['error']}")
            setup.cache[name] = got
    return setup.cache[key]


def versus(check: str, run: dict, want: dict, tolerance: float, weights: bool = False) -> Result:
    """Losses (and with `weights` the final weights) within `tolerance` of `want`'s; a run's error fails."""
    if "error" in run:
        return Result(check, False, run["error"])
    r = same_losses(check, run["losses"], want["losses"], tolerance)
    if not (r.ok and weights):
        return r
    worst = max(float((run["weights"][n] - w).abs().max()) for n, w in want["weights"].items())
    if worst > tolerance:
        return Result(check, False, f"weights differ by up to {worst:.3g} > {tolerance:g}")
    return Result(check, True, r.detail + f"; weights within {worst:.2g}")


def equivalence(setup: Setup) -> list[Result]:
    """fp32: ddp, zero1/2/3 and fsdp at world N against single on one device (losses and weights, 1e-4);
    then the killed-rank check, which compares with the ddp run at world 2."""
    w = setup.world
    try:
        ref = reference(setup)
        got = launch(setup, [run_spec(setup.tiny() + [f"strategy.name={n}"], setup.tmp / f"eq-{n}", 8, weights=True)
                             for n in NAMES], w)
    except RuntimeError as e:
        return [Result("equivalence", False, str(e))]
    results = [versus(f"equivalence {n} (world {w})", run, ref, EQUIVALENCE_TOLERANCE, weights=True)
               for n, run in zip(NAMES, got)]
    ddp2 = got[0]
    if w != 2:
        try:
            ddp2 = launch(setup, [run_spec(setup.tiny(2) + ["strategy.name=ddp"], setup.tmp / "ddp2", 8,
                                           weights=True)], 2)[0]
        except RuntimeError as e:
            return results + [Result("killed rank", False, f"the uninterrupted run: {e}")]
    if "error" in ddp2:
        return results + [Result("killed rank", False, f"the uninterrupted run: {ddp2['error']}")]
    return results + [killed_rank(setup, ddp2)]


def mixed_precision(setup: Setup) -> list[Result]:
    """bf16 at world N: ddp within its band of the fp32 reference, zero1/2/3 and fsdp within
    band(strategy) + band(ddp) of ddp's bf16 run; fp16 (GPU only): zero1 and zero2 against ddp's fp16 run
    within the same sums (fp16's 10 mantissa bits round finer than bf16's 7, so bf16's band bounds it)."""
    w = setup.world
    bands = bf16_bands((ROOT / "docs" / "strategies.md").read_text())
    precisions = ["bf16"] + ([] if setup.cpu else ["fp16"])  # DeepSpeed's CPU accelerator has no fp16
    names = {"bf16": NAMES, "fp16": ("ddp", "zero1", "zero2")}
    runs, index = [], []
    for p in precisions:
        for n in names[p]:
            runs.append(run_spec(setup.tiny() + [f"strategy.name={n}", f"train.precision={p}"],
                                 setup.tmp / f"mp-{n}-{p}", 8))
            index.append((p, n))
    try:
        ref = reference(setup)
        got = dict(zip(index, launch(setup, runs, w)))
    except RuntimeError as e:
        return [Result("bf16/fp16", False, str(e))]
    results = [versus(f"bf16 ddp (world {w}) vs fp32 single", got["bf16", "ddp"], ref, bands["ddp"])]
    for p in precisions:
        ddp = got[p, "ddp"]
        for n in names[p][1:]:
            check = f"{p} {n} (world {w}) vs ddp {p}"
            if "error" in ddp:
                results.append(Result(check, False, f"ddp {p}: {ddp['error']}"))
                continue
            results.append(versus(check, got[p, n], ddp, band_between(n, "ddp", bands)))
    return results


def hsdp(setup: Setup) -> list[Result]:
    """fsdp with strategy.hybrid_shard at world N, shard groups of hsdp_group(N) (1 on 2 GPUs: every rank
    its own replica, the 2-D mesh and the replicas' all-reduce still run), against single: 1e-4."""
    w, group = setup.world, hsdp_group(setup.world)
    over = setup.tiny() + ["strategy.name=fsdp", "strategy.hybrid_shard=true", f"strategy.shard_group_size={group}"]
    check = f"hsdp fsdp (world {w}, {w // group} replicas of {group})"
    try:
        ref = reference(setup)
        (run,) = launch(setup, [run_spec(over, setup.tmp / "hsdp", 8, weights=True)], w)
    except RuntimeError as e:
        return [Result(check, False, str(e))]
    return [versus(check, run, ref, EQUIVALENCE_TOLERANCE, weights=True)]
