"""Checks of the loop's features at world = every visible GPU (1 on one GPU): the Llama family,
activation checkpointing, evaluation, the prefetch thread, the default (non-deterministic) kernels,
gradient accumulation, offload, train.compile (its zero3 row allowed past zerodp's refusal on CUDA, which
this group is there to lift or keep)."""

from __future__ import annotations

from benchmarks.gpu.ranks import reference, versus
from benchmarks.gpu.runner import LLAMA, Setup, launch, run_spec
from benchmarks.gpu.verdicts import EQUIVALENCE_TOLERANCE, Result, evaluation

EVAL_EVERY = 4


def _name(setup: Setup, name: str) -> str:
    """What a strategy runs as at this world (ddp on one device is single: the catalog's on_one_device)."""
    from zerodp.strategies.catalog import spec

    return (spec(name).on_one_device or name) if setup.world == 1 else name


def features(setup: Setup) -> list[Result]:
    """fsdp, fp32, TINY, 8 steps at world N: the baseline against single (1e-4); activation checkpointing
    (recomputes the same kernels), accumulation of 2 micro batches (fsdp, zero2, zero3) and the Llama
    family (fsdp, zero3 against single llama) within 1e-4; evaluation every 4 steps; data.prefetch=2
    (the thread, pinned batches, non-blocking copies) bit-identical to prefetch 0; and
    train.deterministic=false close to the deterministic run (1e-4), bit-equal or not."""
    w = setup.world
    fsdp = setup.tiny() + ["strategy.name=fsdp"]
    runs = {
        "baseline": fsdp,
        "activation checkpointing": fsdp + ["model.activation_checkpointing=true"],
        "evaluation": fsdp + [f"train.eval_every={EVAL_EVERY}", "train.eval_batches=2"],
        "prefetch": fsdp + ["data.prefetch=2"],
        "non-deterministic kernels": fsdp + ["train.deterministic=false"],
        **{f"accumulation {n}": setup.tiny() + [f"strategy.name={n}", "train.micro_batch_size=1"]
           for n in ("fsdp", "zero2", "zero3")},
        **{f"llama {n}": setup.tiny() + LLAMA + [f"strategy.name={n}"] for n in ("fsdp", "zero3")},
    }
    try:
        ref, llama = reference(setup), reference(setup, "llama")
        got = dict(zip(runs, launch(setup, [run_spec(o, setup.tmp / f"f-{i}", 8) for i, o in enumerate(runs.values())],
                                    w)))
    except RuntimeError as e:
        return [Result("features", False, str(e))]
    base = got["baseline"]
    results = [versus(f"fsdp (world {w}) vs single", base, ref, EQUIVALENCE_TOLERANCE)]
    for what, run in got.items():
        check = f"{what} (world {w})"
        if what.startswith("accumulation"):
            results.append(versus(check + ", 2 micro batches a step, vs single", run, ref, EQUIVALENCE_TOLERANCE))
        elif what.startswith("llama"):
            results.append(versus(check + " vs single llama", run, llama, EQUIVALENCE_TOLERANCE))
        elif what == "activation checkpointing" or what == "non-deterministic kernels":
            results.append(_against(check + " vs the baseline", run, base, EQUIVALENCE_TOLERANCE))
        elif what == "prefetch":
            results.append(_against(check + ", data.prefetch=2 vs 0", run, base, 0.0))
        elif what == "evaluation":
            results.append(Result(check, False, run.get("error") or base.get("error")) if "error" in run or
                           "error" in base else
                           evaluation(check, run["records"], EVAL_EVERY, 8, run["losses"], base["losses"]))
    return results


def _against(check: str, run: dict, base: dict, tolerance: float) -> Result:
    if "error" in base:
        return Result(check, False, f"the baseline: {base['error']}")
    return versus(check, run, base, tolerance)


def offload(setup: Setup) -> list[Result]:
    """Every offload row the catalog offers (zero2 and zero3 offload_optimizer, zero3 with
    offload_params, fsdp's CPUOffloadPolicy), fp32 at world N, against single: 1e-4. The fsdp row is
    where the step's grad norm comes back in host memory while the loss stays on the device."""
    from zerodp.strategies.catalog import CATALOG

    w = setup.world
    # On 2 CPU ranks DeepSpeed 0.19.8's offload (zero2 offload_optimizer) did not get past its setup in
    # 100 s: the CPU mode runs FSDP's row only.
    rows = [(s.name, opt, par) for s in CATALOG.values() for opt, par in s.offload_variants
            if not (setup.cpu and s.layout == "deepspeed")]
    runs = [run_spec(setup.tiny() + [f"strategy.name={n}", f"strategy.offload_optimizer={str(o).lower()}",
                                     f"strategy.offload_params={str(p).lower()}"], setup.tmp / f"off-{i}", 8)
            for i, (n, o, p) in enumerate(rows)]
    try:
        ref = reference(setup)
        got = launch(setup, runs, w)
    except RuntimeError as e:
        return [Result("offload", False, str(e))]
    return [versus(f"offload {n} ({'optimizer' if o else ''}{' and ' if o and p else ''}{'params' if p else ''}, "
                   f"world {w}) vs single", run, ref, EQUIVALENCE_TOLERANCE) for (n, o, p), run in zip(rows, got)]


def compiled(setup: Setup) -> list[Result]:
    """train.compile=true under fsdp and zero3 (each block compiled, then sharded), fp32 at world N: within
    1e-4 of single (Inductor's fused kernels round differently; the eager strategies' tolerance holds).
    zero3's row runs past zerodp's refusal of zero3 + compile on CUDA (zerodp.strategies.zero.ZERO3_COMPILE):
    its PASS is what lifts the refusal, its FAIL what keeps it."""
    from zerodp.strategies.zero import ZERO3_COMPILE

    w = setup.world
    names = ("fsdp", "zero3")
    runs = [run_spec(setup.tiny() + [f"strategy.name={n}", "train.compile=true"], setup.tmp / f"c-{n}", 8)
            for n in names]
    try:
        ref = reference(setup)
        # zero3 + compile is refused on CUDA until this check passes: lifted for this launch alone
        got = launch(setup, runs, w, timeout=420, env={ZERO3_COMPILE: "1"})
    except RuntimeError as e:
        return [Result("compile", False, str(e))]
    return [versus(f"compile {n} (world {w}) vs single", run, ref, EQUIVALENCE_TOLERANCE) for n, run in zip(names, got)]
