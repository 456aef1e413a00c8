"""`zerodp plan --from-run RUN`: the critical batch a run measured (its last `grad_noise_scale`,
zerodp.telemetry.grad_noise) against the global batch of each world size.

Data parallelism grows the global batch with every rank: at the run's sequences per rank per step
(micro batch x accumulation) W ranks train W x that many. Above the critical batch, each extra
sequence per step buys less progress (docs/grad_noise.md): those world sizes are marked.

Pure: reads RUN/metrics.jsonl and RUN/config.yaml; no torch, no process group.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from zerodp.errors import UserError
from zerodp.telemetry.grad_noise import times, two_figures

MAX_WORLD = 65536


@dataclass
class CriticalBatch:
    run: str
    step: int
    sequences: float
    """The critical batch (gradient noise scale) the run measured last, in sequences..."""
    tokens: float
    """...and in tokens."""
    world_size: int
    """The run's world size, and the sequences each rank trained per step: what a world size multiplies."""
    per_rank: int
    rows: list[dict]
    """Per world size: {"world_size", "global_batch", "ratio" (global batch / critical), "exceeds"}."""

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [f"critical batch measured by {self.run} at step {self.step}: ~{two_figures(self.sequences):,} sequences "
               f"(~{two_figures(self.tokens):,} tokens; the gradient noise scale, docs/grad_noise.md)",
               f"global batch by world size at the run's {self.per_rank:,} sequences per rank per step "
               f"(it ran on {self.world_size}):",
               f"  {'world':>7}  {'global batch':>12}  {'vs critical':>11}"]
        for r in self.rows:
            mark = "  exceeds it: each extra sequence per step buys less progress" if r["exceeds"] else ""
            out.append(f"  {r['world_size']:>7,}  {r['global_batch']:>12,}  {times(r['ratio']):>11}{mark}")
        within = [r["world_size"] for r in self.rows if not r["exceeds"]]
        out.append(f"up to {within[-1]:,} ranks stay at or below the critical batch" if within else
                   "every world size exceeds it: a smaller batch per rank (micro batch, accumulation) fits it better")
        return out


def critical_batch(run_dir: str, planned_world: int | None = None) -> CriticalBatch:
    """The run's last estimate and the world sizes (powers of two up to the first past twice the
    critical batch, the run's own and `planned_world`) whose global batch exceeds it. UserError when
    RUN is not a run directory or measured no estimate."""
    run = Path(run_dir)
    metrics, config = run / "metrics.jsonl", run / "config.yaml"
    if not metrics.is_file() or not config.is_file():
        raise UserError(f"--from-run {run_dir}: no metrics.jsonl and config.yaml there; give the train.out_dir "
                        f"of a `zerodp train` run")
    last = None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and isinstance(record.get("grad_noise_scale"), dict):
            last = record
    if last is None:
        raise UserError(f"--from-run {run_dir}: metrics.jsonl holds no grad_noise_scale; train with "
                        f"train.grad_noise_scale=true on several processes (or with accumulation on one), for "
                        f"enough steps that the estimate is positive")
    from zerodp.config import load_config  # imports yaml only

    cfg = load_config(str(config), [])
    # metrics.jsonl's per-device tokens/s is tokens/s over the world size
    world = max(1, round(last["tokens_per_s"] / last["tokens_per_s_per_device"]))
    per_rank = cfg.train.global_batch_size // world
    noise = last["grad_noise_scale"]
    sizes, w = {world, *([planned_world] if planned_world else [])}, 1
    while w <= MAX_WORLD:
        sizes.add(w)
        if w * per_rank > 2 * noise["sequences"]:
            break
        w *= 2
    rows = [{"world_size": w, "global_batch": w * per_rank, "ratio": w * per_rank / noise["sequences"],
             "exceeds": w * per_rank > noise["sequences"]} for w in sorted(sizes)]
    return CriticalBatch(str(run_dir), last["step"], noise["sequences"], noise["tokens"], world, per_rank, rows)


def run(args, build) -> int:
    """`zerodp plan --from-run RUN [model source ...]`: the plan first when a model source is given
    (`build`: zerodp.planner.cli.build), then the run's critical batch by world size; with --json one
    object ({"plan", "critical_batch"}). Returns 0."""
    sourced = any(getattr(args, k, None) is not None for k in ("config", "hf_config", "model", "params"))
    plan = build(args) if sourced else None
    found = critical_batch(args.from_run, args.gpus * args.nodes if sourced else None)
    if args.json:
        print(json.dumps({**({"plan": plan.to_dict()} if plan else {}), "critical_batch": found.to_dict()}, indent=2))
    else:
        print("\n".join(([plan.table(), ""] if plan else []) + found.lines()))
    return 0
