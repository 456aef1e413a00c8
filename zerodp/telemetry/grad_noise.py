"""The gradient noise scale B_noise = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A.1), measured from the two gradient norms a data-parallel step already
has, and what it says about the global batch (docs/grad_noise.md).

A gradient averaged over B examples has E|G_B|^2 = |G|^2 + tr(Sigma) / B. Two batch sizes give two
equations and the paper's unbiased estimates of both unknowns:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Here B_small is one rank's micro batch (|G_small|^2: the mean over ranks and micro batches of each
micro batch's own gradient norm squared, taken before any reduction) and B_big the global batch
(|G_big|^2: the reduced gradient's norm squared, the step's grad_norm squared).

Under a loss mask an example is a target token and the micro batches hold uneven numbers n_i of them:
micro batch i's gradient reaches the hooks weighted by w_i = n_i P / N (zerodp.data.batches.MicroBatches;
P micro batches of N targets a step), so E|w_i g_i|^2 = w_i^2 |G|^2 + w_i tr_tok / (N / P). Over the P
micro batches, with `spread` = mean(w_i^2) (1 without a mask) and tr(Sigma) taken per sequence's worth
of targets (tr_tok / (N / B_big)):

    |G_small|^2 ~ spread |G|^2 + tr(Sigma) / B_small,    |G_big|^2 ~ |G|^2 + tr(Sigma) / B_big

which spread = 1 makes the two equations above; the estimate in sequences is then the critical batch in
target tokens over the step's targets per sequence. Either estimate of one
step is noisy (|G|^2 may come out negative); each is smoothed by its own bias-corrected exponential
moving average over steps and the ratio is taken of the averages.

Pure arithmetic: no torch, so the planner (`zerodp plan --from-run`) imports it too.
"""

from __future__ import annotations

import math


class NoiseScale:
    """The running estimate: `update` once per optimizer step, in step order, on every rank alike."""

    def __init__(self, b_small: int, b_big: int, decay: float, tokens_per_sequence: int, state: dict | None = None):
        assert 0 < b_small < b_big, (b_small, b_big)
        self.b_small, self.b_big, self.decay, self.tokens_per_sequence = b_small, b_big, decay, tokens_per_sequence
        state = state or {}
        self.grad_sq = state.get("grad_sq", 0.0)
        """EMA of the |G|^2 estimates, not yet bias-corrected."""
        self.trace = state.get("trace", 0.0)
        """EMA of the tr(Sigma) estimates, not yet bias-corrected."""
        self.steps = state.get("steps", 0)
        """Steps averaged in (a non-finite step, an fp16 overflow, is left out)."""

    def state(self) -> dict:
        """What a checkpoint keeps, so that a resumed run continues the average (trainer.json)."""
        return {"grad_sq": self.grad_sq, "trace": self.trace, "steps": self.steps}

    def update(self, small_sq: float, big_sq: float, spread: float = 1.0) -> dict | None:
        """Average in one step's |G_small|^2 and |G_big|^2; return the record's `grad_noise_scale`
        ({"sequences", "tokens"}), or None while either average is not positive (the quantities are).
        `spread`: under a loss mask, the mean of the step's micro batches' squared loss weights (1 without
        one); a step whose targets all sit in one micro batch (spread = B_big / B_small), or that has none
        (0), compares no two batch sizes and is left out."""
        bs, bb, d = self.b_small, self.b_big, self.decay
        if math.isfinite(small_sq) and math.isfinite(big_sq) and 0 < spread < bb / bs:
            trace = (small_sq - spread * big_sq) / (1 / bs - spread / bb)
            grad_sq = big_sq - trace / bb
            self.grad_sq = d * self.grad_sq + (1 - d) * grad_sq
            self.trace = d * self.trace + (1 - d) * trace
            self.steps += 1
        return self.estimate()

    def estimate(self) -> dict | None:
        if self.steps == 0 or self.grad_sq <= 0 or self.trace <= 0:
            return None
        # The bias corrections 1 - decay^steps of the two averages are the same and cancel in the ratio.
        sequences = self.trace / self.grad_sq
        return {"sequences": sequences, "tokens": sequences * self.tokens_per_sequence}


def skip_reason(world_size: int, micro_batch: int, global_batch: int) -> str:
    """Why no estimate can be made for this batch split ("" when one can): it needs two batch sizes."""
    if micro_batch < global_batch:
        return ""
    return (f"grad_noise_scale: off: one process without gradient accumulation sees one batch size "
            f"({global_batch} sequences) and the estimate needs two; accumulate (train.micro_batch_size below "
            f"train.global_batch_size) or run on more processes")


def advice(global_batch: int, estimate: dict | None, steps: int) -> str:
    """The run summary's line: where the global batch stands against the measured critical batch."""
    if estimate is None:
        return (f"critical batch: not measurable yet after {steps} step(s) (an averaged estimate of |G|^2 or "
                f"tr(Sigma) is not positive: too few steps to tell signal from noise); train longer for one")
    b = estimate["sequences"]
    ratio = global_batch / b
    head = (f"critical batch (gradient noise scale, averaged over {steps} steps): ~{two_figures(b):,} sequences "
            f"(~{two_figures(estimate['tokens']):,} tokens); global batch {global_batch:,} sequences is {times(ratio)}")
    if ratio < 0.5:
        return f"{head} it: up to ~{times(1 / ratio)} more GPUs would still scale near-linearly"
    if ratio > 2:
        return f"{head} it: a smaller global batch would reach the same loss in fewer tokens"
    return f"{head} it: near the balance of steps against tokens"


def times(x: float) -> str:
    return f"{x:.2g}x" if x < 10 else f"{x:,.0f}x"


def two_figures(x: float):
    """Two significant figures: the estimate is not more precise than that."""
    if x < 10:
        return float(f"{x:.2g}")
    digits = math.floor(math.log10(x)) - 1
    return int(round(x / 10**digits) * 10**digits)
