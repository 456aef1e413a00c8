"""The groups a short rental of one GPU is for: the Llama-3.2-1B shape's throughput per planned strategy
(tokens/s, MFU, host syncs per step and the allocator's peak beside the planner's, from the same runs),
the background save's stall beside a synchronous save's, and the correctness groups on tiny shapes
(resume bit-identity, fp16 under ZeRO). Runs at world = every visible GPU (2 CPU processes in the CPU
mode, tiny shapes there)."""

from __future__ import annotations

from benchmarks.gpu.ranks import versus
from benchmarks.gpu.runner import COMMON, ROOT, Setup, launch, run_spec
from benchmarks.gpu.verdicts import GIB, Result, band_between, bf16_bands, host_syncs, same_losses, throughput

# The throughput rows: (label, config overrides) over the 1B shape (tiny on the CPU). A row whose
# overrides this zerodp does not accept (a key another branch adds: model.loss_chunks,
# model.activation_checkpointing=selective|full) is skipped with a line saying so.
EAGER_ROWS = [
    ("single", ["strategy.name=single"]),
    ("fsdp", ["strategy.name=fsdp"]),
    ("zero2", ["strategy.name=zero2"]),
    ("zero3", ["strategy.name=zero3"]),
    ("single loss_chunks=8", ["strategy.name=single", "model.loss_chunks=8"]),
    ("single activation_checkpointing=selective", ["strategy.name=single", "model.activation_checkpointing=selective"]),
    ("single activation_checkpointing=full", ["strategy.name=single", "model.activation_checkpointing=full"]),
]
COMPILED_ROWS = [
    ("single compile", ["strategy.name=single", "train.compile=true"]),
    ("fsdp compile", ["strategy.name=fsdp", "train.compile=true"]),
]
STEPS, LOG_EVERY = 12, 5
"""Steps per throughput run: 1-2 the warm-up (Throughput.WARMUP_STEPS), the medians over 3-12; host syncs
counted over steps 6-10 (the first interval holds the start, the last the run's end)."""
MEMORY_BAND = 0.10
"""The allocator's peak within this fraction of the planner's (issue 39's target for the 1B shape)."""


def _shape(setup: Setup) -> tuple[list[str], str, int]:
    """The 1B shape's overrides (tiny on the CPU), its precision and micro batch."""
    from benchmarks import gpu_throughput as gt

    if setup.cpu:
        return gt.TINY["llama-1b"], "fp32", 2
    return gt.MODELS["llama-1b"], "bf16", 4


def _base(setup: Setup) -> list[str]:
    model, precision, micro = _shape(setup)
    w = setup.world
    return [*COMMON, *model, f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * w}",
            f"train.precision={precision}", "train.sample_tokens=0", "train.eval_every=0", "data.source=builtin",
            f"train.log_every={LOG_EVERY}", "checkpoint.enabled=false", f"train.device={setup.device}"]


def accepted(overrides: list[str]) -> str | None:
    """None when this zerodp's config takes `overrides`, else why not (a key or value it lacks)."""
    from zerodp.config import load_config
    from zerodp.errors import ConfigError

    try:
        load_config(str(ROOT / "configs/tiny.yaml"), overrides)
    except ConfigError as e:
        return str(e)
    return None


def _rows_throughput(setup: Setup, rows: list[tuple[str, list[str]]]) -> list[Result]:
    from benchmarks import gpu_throughput as gt

    w, base = setup.world, _base(setup)
    _, device, memory = gt.gpus()
    precision = _shape(setup)[1]
    results, runs, index = [], [], []
    for label, extra in rows:
        if w > 1:  # single is one process: ddp is its row at a larger world (the catalog's on_one_device)
            label, extra = label.replace("single", "ddp"), [x.replace("=single", "=ddp") for x in extra]
        over = base + extra
        why = accepted(over)
        if why:
            results.append(Result(f"throughput llama-1b {label}", True, f"not in this zerodp: {why}", skip=True))
            continue
        runs.append(run_spec(over, setup.tmp / f"tp-{len(runs)}", STEPS, count_syncs=True))
        index.append((label, over))
    if not runs:
        return results
    try:
        got = launch(setup, runs, w, timeout=560)
    except RuntimeError as e:
        return results + [Result("throughput llama-1b", False, str(e))]
    for (label, over), run in zip(index, got):
        check = f"{label} {precision} (world {w})"
        fitting, e = gt.planned(over + [f"train.out_dir={setup.tmp}/plan", f"train.max_steps={STEPS}"], w, memory,
                                device)
        plan = f"{e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, step {e.step_s:.3g} s, {e.total_bytes / GIB:.1f} GiB"
        if "error" in run:
            results.append(Result(f"throughput llama-1b {check}", False, run["error"]))
            continue
        r = run["run"]
        figures = {"tokens_per_s_per_device": r["tokens_per_s_per_device"], "mfu": r.get("mfu"),
                   "step_s": r["median_step_s"], "steps": r["measured_steps"],
                   "peak": f"{(run['peaks'].get('train', 0) - run.get('allocated_before', 0)) / GIB:.1f} GiB"
                   if not setup.cpu else None}
        results.append(throughput(f"throughput llama-1b {check}", figures, True, plan))
        results.append(host_syncs(f"host syncs {check}", run["syncs"], LOG_EVERY, LOG_EVERY + 1, 2 * LOG_EVERY,
                                  run["sync_where"]))
        if not setup.cpu:
            # less what earlier runs of the worker left allocated (said when there is any)
            left = run.get("allocated_before", 0)
            m = memory_beside_plan(f"memory llama-1b {check}", run["peaks"]["train"] - left,
                                   e.total_bytes - e.overhead_bytes)
            results.append(Result(m.check, m.ok, m.detail + (f"; {left / GIB:.2f} GiB left by earlier runs not "
                                                               f"counted" if left else "")))
    return results


def memory_beside_plan(check: str, measured: int, planned: int, band: float = MEMORY_BAND) -> Result:
    """The allocator's peak (max_memory_allocated over the run) beside the planner's (its total less the
    CUDA context, which the allocator does not see): a pass within `band` of it."""
    off = measured / planned - 1
    return Result(check, abs(off) <= band, f"allocator peak {measured / GIB:.2f} GiB, planned {planned / GIB:.2f} GiB "
                                           f"({off:+.1%}; band {band:.0%})")


def throughput_eager(setup: Setup) -> list[Result]:
    """EAGER_ROWS on the 1B shape, bf16, micro batch 4, checkpoint.enabled=false, 12 steps each in one
    process: tokens/s per GPU and MFU at the median step after the warm-up (the run summary's), host
    syncs per step over steps 6-10, the allocator's peak beside the planner's."""
    return _rows_throughput(setup, EAGER_ROWS)


def throughput_compiled(setup: Setup) -> list[Result]:
    """COMPILED_ROWS (train.compile=true) as throughput_eager; each row pays Inductor's compilation in its
    warm-up steps, which the medians leave out."""
    return _rows_throughput(setup, COMPILED_ROWS)


CPU_SAVE_NOISE_S = 0.1
"""How far the CPU mode's tiny background save may hold the loop past the synchronous one (seen: 0.04 s
against 0.03 s on 2 busy cores)."""


def save_stall(setup: Setup) -> list[Result]:
    """The 1B shape under single (tiny on the CPU), eager: a synchronous save (2 steps, the save at the end)
    beside a background one (checkpoint.async_save, 3 steps, checkpoint.every=2: the stall at step 2 is
    the host copy, the end's save waited for); keep_last=1, each run's folder deleted at its end, so at
    most two checkpoints are on disk at once. Passes when the background stall is below the synchronous
    save; in the CPU mode (a checkpoint of a few KB, both saves some 30 ms of fsync and thread start-up) within
    CPU_SAVE_NOISE_S of it, which the timing's noise decides, not the save."""
    from benchmarks.gpu.features import _name

    one = _name(setup, "ddp")  # single on one GPU
    base = [o for o in _base(setup) if o != "checkpoint.enabled=false"] + [
        f"strategy.name={one}", "checkpoint.keep_last=1", "checkpoint.every=2"]
    runs = [run_spec(base, setup.tmp / "save-sync", 2),
            run_spec(base + ["checkpoint.async_save=true"], setup.tmp / "save-async", 3)]
    check = f"save llama-1b {one} {_shape(setup)[1]} (world {setup.world})"
    try:
        sync, background = launch(setup, runs, setup.world, timeout=400)
    except RuntimeError as e:
        return [Result(check, False, str(e))]
    error = sync.get("error") or background.get("error")
    if error:
        return [Result(check, False, error)]
    full, stall = sync["saves"].get(2), background["saves"].get(2)
    if full is None or stall is None:
        return [Result(check, False, f"no save at step 2 timed: sync {sync['saves']}, "
                                     f"background {background['saves']}")]
    size = f", {sync['checkpoint_bytes'] / 1e9:.1f} GB a checkpoint" if sync.get("checkpoint_bytes") else ""
    slack = CPU_SAVE_NOISE_S if setup.cpu else 0.0
    return [Result(check, stall < full + slack, f"background save held the loop {stall:.2f} s at step 2, a "
                                                f"synchronous save {full:.2f} s{size}; the background run's end "
                                                f"waited {background['saves'].get(3, float('nan')):.2f} s")]


def resume(setup: Setup) -> list[Result]:
    """Tiny shapes at world N, single (ddp at world 2+), fsdp and zero3 (bf16; fp16 too on a GPU, where
    DeepSpeed has it): 4 steps straight, and 2 steps then 2 more resumed from the step-2 checkpoint in a
    new train(): the resumed losses bit-identical to the straight run's steps 3-4."""
    from benchmarks.gpu.features import _name

    precisions = ["bf16"] + ([] if setup.cpu else ["fp16"])
    runs, index = [], []
    for name in (_name(setup, "ddp"), "fsdp", "zero3"):
        for p in precisions:
            over = setup.tiny() + [f"strategy.name={name}", f"train.precision={p}", "checkpoint.every=2"]
            out = setup.tmp / f"resume-{name}-{p}"
            runs += [run_spec(over, out.with_name(out.name + "-a"), 4), run_spec(over, out, 2, keep=True),
                     run_spec(over, out, 4, fresh=False)]
            index.append((name, p))
    try:
        got = launch(setup, runs, setup.world, timeout=560)
    except RuntimeError as e:
        return [Result("resume", False, str(e))]
    results = []
    for i, (name, p) in enumerate(index):
        straight, resumed = got[3 * i], got[3 * i + 2]
        check = f"resume {name} {p} (world {setup.world})"
        error = straight.get("error") or got[3 * i + 1].get("error") or resumed.get("error")
        results.append(Result(check, False, error) if error else
                       same_losses(check, resumed["losses"], straight["losses"][2:]))
    return results


def fp16_zero(setup: Setup) -> list[Result]:
    """fp16 (DeepSpeed's dynamic loss scale) under zero1, zero2 and zero3 against single's fp16 (torch's
    GradScaler), tiny shapes at world N: within the sum of docs/strategies.md's bf16 bands (fp16 rounds
    finer than bf16)."""
    from benchmarks.gpu.features import _name

    w = setup.world
    bands = bf16_bands((ROOT / "docs" / "strategies.md").read_text())
    names = [_name(setup, "ddp"), "zero1", "zero2", "zero3"]
    runs = [run_spec(setup.tiny() + [f"strategy.name={n}", "train.precision=fp16"], setup.tmp / f"fp16-{n}", 8)
            for n in names]
    try:
        got = launch(setup, runs, w)
    except RuntimeError as e:
        return [Result("fp16", False, str(e))]
    ref = got[0]
    if "error" in ref:
        return [Result(f"fp16 {names[0]}", False, ref["error"])]
    return [versus(f"fp16 {n} (world {w}) vs {names[0]} fp16", run, ref, band_between(n, "ddp", bands))
            for n, run in zip(names[1:], got[1:])]
