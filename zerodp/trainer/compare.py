"""Two runs of one config compared (`zerodp verify`): step by step their loss and gradient norm (from
each run's metrics.jsonl), and at the end each weight tensor (from each run's final checkpoint, read
the way `zerodp convert` reads any strategy's: zerodp.convert), judged against the tolerance of the
runs' precision (TOLERANCES)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Tolerance:
    """Relative differences two runs may show and still count as the same trajectory."""

    loss: float
    grad_norm: float
    weight: float
    """Per tensor: max |a - b| over the larger of max |a| and 1 (relative for large weights, absolute
    for those below 1, as the suite's absolute weight tolerance)."""
    source: str


TOLERANCES = {
    # The suite's equivalence promise (tests/distributed/test_equivalence.py: every strategy at world 2
    # and 3 within 1e-5 of one process over 8 steps, losses near 5.5 and weights) holds at 1e-5 relative
    # with room. Gradient norms carry the reduction order's rounding further, and so do weights whose
    # gradient is only rounding (an attention key's bias): Adam divides it by its own sqrt(v), up to 3e-5
    # at lr 1e-2 (that file's docstring): 1e-4. Measured ddp vs fsdp, world 2, 3 steps: 1e-7 and 2.6e-6.
    "fp32": Tolerance(1e-5, 1e-4, 1e-4, "fp32: the equivalence suite's 1e-5 (tests/distributed/test_equivalence.py)"),
    # The widest pinned band of docs/strategies.md's precision table: zero and fsdp in bf16 within 0.005 to
    # 0.03 of fp32 (tested < 0.03 at a loss near 3, 1%); weights held in bf16 round at 2^-8 = 0.4%.
    "16bit": Tolerance(1e-2, 5e-2, 2e-2, "bf16/fp16: the precision table's band (docs/strategies.md)"),
}
"""By train.precision: "fp32" when both runs are, else "16bit"."""


def tolerance_for(*precisions: str) -> Tolerance:
    """The tolerance of two runs in these train.precision values: fp32 only when both are."""
    return TOLERANCES["fp32" if all(p == "fp32" for p in precisions) else "16bit"]


def read_steps(run_dir: Path) -> dict[int, dict]:
    """{step: {"loss", "grad_norm"}} from a run's metrics.jsonl."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out[r["step"]] = {"loss": r["loss"], "grad_norm": r["grad_norm"], "target_tokens": r.get("target_tokens")}
    return out


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def weight_differences(dir_a: Path, dir_b: Path, shapes: dict[str, tuple]) -> dict[str, float]:
    """{parameter: max |a - b| / max(max |a|, 1)} between two runs' newest checkpoints (any strategy, any world
    size), for the model's parameters `shapes` ({name: shape})."""
    from zerodp.convert import open_checkpoint
    from zerodp.convert.full_state import FullState

    out = {}
    with open_checkpoint(Path(dir_a) / "checkpoints") as sa, open_checkpoint(Path(dir_b) / "checkpoints") as sb:
        fa, fb = FullState(sa, with_optimizer=False), FullState(sb, with_optimizer=False)
        for name, shape in shapes.items():
            a, b = fa.get(name, "param", shape), fb.get(name, "param", shape)
            out[name] = ((a - b).abs().max() / a.abs().max().clamp_min(1.0)).item()
    return out


@dataclass
class Verdict:
    tolerance: Tolerance
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, relative loss difference, relative grad-norm difference)."""
    weights: dict[str, float] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    """Steps one run recorded and the other did not."""
    targets: int | None = None
    """The target tokens of the compared steps (metrics.jsonl's target_tokens; None: every token is one)."""

    @property
    def compared(self) -> bool:
        """Whether anything was compared: some step, and a target in the steps (with none every loss and
        gradient is 0 in both runs, which agree whatever the strategy did)."""
        return bool(self.steps) and self.targets != 0

    @property
    def first_step(self) -> int | None:
        """The first step whose loss or gradient norm differs beyond the tolerance."""
        t = self.tolerance
        return next((s for s, dl, dg in self.steps if dl > t.loss or dg > t.grad_norm), None)

    @property
    def differing(self) -> list[tuple[str, float]]:
        """Tensors beyond the weight tolerance, largest difference first."""
        return sorted(((n, d) for n, d in self.weights.items() if d > self.tolerance.weight), key=lambda x: -x[1])

    @property
    def passed(self) -> bool:
        return self.compared and not self.missing and self.first_step is None and not self.differing

    def report(self, label_a: str, label_b: str) -> str:
        t = self.tolerance
        lines = [f"{label_a}  vs  {label_b}", f"tolerance: {t.source}: loss {t.loss:g}, grad norm {t.grad_norm:g}, "
                 f"weights {t.weight:g} (of max(|w|, 1))", "step  loss diff  grad-norm diff"]
        lines += [f"{s:4d}  {dl:9.2e}  {dg:14.2e}" + ("  <-" if dl > t.loss or dg > t.grad_norm else "")
                  for s, dl, dg in self.steps]
        top = sorted(self.weights.items(), key=lambda x: -x[1])[:5]
        lines.append("largest weight differences: " + ", ".join(f"{n} {d:.2e}" for n, d in top))
        if self.passed:
            lines.append(f"PASS: {len(self.steps)} steps and {len(self.weights)} tensors within the tolerance")
            return "\n".join(lines)
        why = []
        if not self.compared:
            why.append(f"nothing was compared: the {len(self.steps)} steps held no target token (every loss and "
                       f"gradient 0); give data whose samples hold targets (see what start-up says about them)"
                       if self.steps else "nothing was compared: no step was recorded by both runs")
        if self.missing:
            why.append(f"steps {self.missing} are recorded by one run only")
        if (s := self.first_step) is not None:
            dl, dg = next((dl, dg) for k, dl, dg in self.steps if k == s)
            why.append(f"the first differing step is {s} (loss {dl:.2e}, grad norm {dg:.2e} relative)")
        if self.differing:
            why.append(f"{len(self.differing)} tensors differ, most: " + ", ".join(
                f"{n} {d:.2e}" for n, d in self.differing[:5]))
        lines.append("FAIL: " + "; ".join(why))
        return "\n".join(lines)


def compare_runs(dir_a: Path, dir_b: Path, shapes: dict[str, tuple], tolerance: Tolerance) -> Verdict:
    """Compare two finished runs' folders step by step and tensor by tensor."""
    a, b = read_steps(dir_a), read_steps(dir_b)
    v = Verdict(tolerance, missing=sorted(set(a) ^ set(b)))
    v.steps = [(s, relative(a[s]["loss"], b[s]["loss"]), relative(a[s]["grad_norm"], b[s]["grad_norm"]))
               for s in sorted(set(a) & set(b))]
    counts = [a[s]["target_tokens"] for s in sorted(set(a) & set(b))]
    v.targets = None if any(c is None for c in counts) else int(sum(counts))
    v.weights = weight_differences(dir_a, dir_b, shapes)
    return v
