"""A step's figures, from the device to metrics.jsonl: the loop keeps each step's loss, grad norm and
timings where they were computed (`Pending`) and fetches a whole interval of them at its next sync
point (`fetch_interval`: one device sync, one all-gather), so a step that does not log never waits for
the device. `Throughput` turns them into records with tokens/s and MFU, and the run's summary line.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from zerodp.config import Config
from zerodp.distributed.process_group import all_gather_floats
from zerodp.resilience.stragglers import Stopwatch


@dataclass
class Pending:
    """A step whose figures are still where they were computed (on a GPU: on the device), until the
    next sync point fetches them."""

    step: int
    lr: float
    loss: torch.Tensor
    """This rank's mean loss over its micro batches, a 0-d tensor."""
    grad_norm: torch.Tensor | float
    """A tensor where the strategy computes it on the device; DeepSpeed hands back a float."""
    timer: Stopwatch
    """The whole step: forward, backward and the optimizer."""
    forward: Stopwatch
    data_wait_s: float
    """Host seconds spent waiting for this step's batch."""
    probe: Stopwatch | None
    local_grad_sq: torch.Tensor | None = None
    """This rank's mean micro-batch gradient norm squared before the reduction (strategy.local_grad_sq,
    zerodp.telemetry.grad_noise), a 0-d tensor; None where not measured."""
    targets: int | None = None
    """The target tokens of the step's whole global batch, where a loss mask says which are (the loss is
    their mean); None without a mask (every token is one)."""
    spread: float = 1.0
    """The mean squared loss weight of the step's micro batches (MicroBatches.spread; 1 without a mask)."""
    balance: torch.Tensor | None = None
    """A mixture of experts: this rank's mean balance loss over its micro batches (zerodp.models.moe_spec),
    a 0-d tensor; None for a dense model."""
    expert_load: torch.Tensor | None = None
    """A mixture of experts: the tokens each sparse block sent to each expert on this rank in the step
    (L, E) (zerodp.models.moe.RouterLog.take_load); None for a dense model."""


def fetch_interval(pending: list[Pending], request_code: float, interval_start: float | None = None):
    """The figures of the steps since the last sync point, on every rank.

    One device sync (the stacked losses and norms to the host, with a mixture of experts' tokens per
    expert summed over the interval on the device; the Stopwatches' CUDA events are done then) and one
    all-gather. Returns (per step: one row per rank of [loss, step seconds, data wait,
    grad norm, forward seconds, probe seconds, local gradient norm squared (nan where not measured),
    wall seconds per step, balance loss (nan for a dense model)]; seconds the all-gather took; the highest
    preemption request of any rank, 0 for none: the signal of any rank stops all of them; the tokens each
    sparse block sent to each expert over the interval on all ranks, (L, E) lists, or None for a dense
    model). The wall seconds
    are the interval's: from `interval_start` (perf_counter; the loop's start of the interval) to the
    moment the device finished its last step (after the sync), over its steps, the same for each; 0
    without an `interval_start`."""
    on_device = [v.detach().float() for p in pending for v in (p.loss, p.grad_norm, p.local_grad_sq, p.balance)
                 if torch.is_tensor(v)]
    loads = [p.expert_load for p in pending if p.expert_load is not None]
    load = torch.stack(loads).sum(0).float() if loads else None  # (L, E) this rank's, still on the device
    flat = torch.stack(on_device)
    host = (flat if load is None else torch.cat([flat, load.reshape(-1).to(flat.device)])).tolist()
    fetched, load_values = iter(host[:len(on_device)]), host[len(on_device):]
    wall = (time.perf_counter() - interval_start) / len(pending) if interval_start is not None else 0.0
    values = []
    for p in pending:
        loss = next(fetched)
        norm = next(fetched) if torch.is_tensor(p.grad_norm) else p.grad_norm
        local_sq = next(fetched) if torch.is_tensor(p.local_grad_sq) else float("nan")
        balance = next(fetched) if torch.is_tensor(p.balance) else float("nan")
        values += [loss, p.timer.seconds(), p.data_wait_s, norm, p.forward.seconds(),
                   p.probe.seconds() if p.probe is not None else 0.0, local_sq, wall, balance]
    t0 = time.perf_counter()
    gathered = all_gather_floats(values + load_values + [request_code])
    sync_wait = time.perf_counter() - t0
    width = len(values) // len(pending)
    per_step = [[r[i * width:(i + 1) * width] for r in gathered] for i in range(len(pending))]
    interval_load = None
    if load is not None:
        summed = [sum(r[len(values) + j] for r in gathered) for j in range(len(load_values))]
        E = load.shape[-1]
        interval_load = [summed[i:i + E] for i in range(0, len(summed), E)]
    return per_step, sync_wait, max(r[-1] for r in gathered), interval_load


class Throughput:
    """Turns a step's per-rank figures into its metrics.jsonl record: tokens/s (all ranks and per
    device) and, where the device's peak is known, MFU: the model's FLOPs per token
    (`zerodp.models.flops_per_token`: 6 per multiplying parameter plus attention) times tokens/s per
    device, over the peak. Both come from that step's own time, the slowest rank's `max_step_time_s`
    (its forward, backward and optimizer, CUDA events on a GPU, plus its wait for data), so a slow first
    step (compilation, allocator growth) stays in its own row. `wall_step_s` is the interval's wall time
    per step (from one sync point to the next over its steps, the host's time between the steps
    included, evaluations and saves not); the tokens are the whole global batch. The run's summary
    leaves the first WARMUP_STEPS steps of a launch out and says which steps it covers."""

    WARMUP_STEPS = 2
    """Steps at the start of each launch left out of the summary and the console's medians (where more
    steps follow): the first compiles, tunes kernels and grows the allocator; the second still settles."""

    def __init__(self, cfg: Config, rank: int, world_size: int, flops_per_token: int, peak: float | None,
                 tokens: int = 0):
        self.rank, self.world_size, self.flops, self.peak = rank, world_size, flops_per_token, peak
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.block_size
        self.tokens = tokens
        """Tokens trained on so far, the resumed run's included."""
        self.first_step: int | None = None
        """The first step this launch ran (its warm-up starts there)."""

    def rate(self, seconds: float) -> dict:
        tokens_per_s = self.tokens_per_step / seconds
        out = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / self.world_size}
        if self.peak:
            out["mfu"] = self.flops * out["tokens_per_s_per_device"] / self.peak
        return out

    def record(self, p: Pending, per_rank: list[list[float]], sync_wait: float) -> dict:
        self.tokens += self.tokens_per_step
        if self.first_step is None:
            self.first_step = p.step
        times = [r[1] + r[2] for r in per_rank]
        slowest = max(range(len(times)), key=lambda r: times[r])
        wall = max(r[7] for r in per_rank) or max(times) + sync_wait  # without a wall figure: the steps' own
        return {
            "step": p.step, "loss": sum(r[0] for r in per_rank) / len(per_rank), "lr": p.lr,
            "grad_norm": per_rank[self.rank][3], "tokens": self.tokens, **self.rate(times[slowest]),
            "wall_step_s": wall,
            "step_time_s": times[self.rank], "max_step_time_s": times[slowest], "slowest_rank": slowest,
            "data_wait_s": max(r[2] for r in per_rank), "sync_wait_s": sync_wait,
            **({"target_tokens": p.targets} if p.targets is not None else {}),
            **({"balance_loss": sum(r[8] for r in per_rank) / len(per_rank)} if p.balance is not None else {}),
        }

    def measured(self, records: list[dict]) -> tuple[list[dict], str]:
        """Of `records` (this launch's, in step order), those a median should cover: without the
        launch's first WARMUP_STEPS steps where others remain; and the words that say which steps they
        are ("steps 3-12, warm-up steps 1-2 left out", or "step 1, a warm-up step")."""
        if not records:
            return [], ""
        warm = self.first_step + self.WARMUP_STEPS if self.first_step is not None else records[0]["step"]
        kept = [r for r in records if r["step"] >= warm] or records
        left = [r["step"] for r in records if r not in kept]
        what = _steps(kept[0]["step"], kept[-1]["step"])
        if left:
            what += f", warm-up {_steps(left[0], left[-1])} left out"
        elif kept[0]["step"] < warm:
            what += " (warm-up, all there is)"
        return kept, what

    def summary(self, records: list[dict], straggler_wait_s: float, save_s: float) -> dict:
        """The run's figures: at the median step after the warm-up (Throughput.measured; each step's own
        time, the slowest rank's), the median wall time per step over the same steps, and the seconds
        the job waited for data, for stragglers and for checkpoint saves."""
        kept, what = self.measured(records)
        if not kept:
            return {}
        step_s = statistics.median(r["max_step_time_s"] for r in kept)
        return {"steps": len(records), "measured_steps": what, "median_step_s": step_s, **self.rate(step_s),
                "median_wall_step_s": statistics.median(r["wall_step_s"] for r in kept),
                "data_wait_s": sum(r["data_wait_s"] for r in records), "straggler_wait_s": straggler_wait_s,
                "checkpoint_save_s": save_s}


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def describe_run(run: dict) -> str:
    """The run summary line."""
    mfu = f", MFU {run['mfu']:.1%}" if "mfu" in run else ""
    return (f"run: {run['steps']} steps; {run['measured_steps']}: median step {run['median_step_s']:.3f}s, "
            f"{run['tokens_per_s']:,.0f} tokens/s ({run['tokens_per_s_per_device']:,.0f} per device){mfu}, "
            f"wall {run['median_wall_step_s']:.3f}s a step with the time between steps; "
            f"waited {run['data_wait_s']:.1f}s for data, {run['straggler_wait_s']:.1f}s for stragglers, "
            f"{run['checkpoint_save_s']:.1f}s for checkpoint saves")


def peak_flops(cfg: Config, device: torch.device) -> tuple[float | None, str]:
    """One device's peak FLOP/s for MFU at train.precision: train.peak_tflops, else the planner's table
    for a CUDA device (dense 16-bit tensor-core peak, or fp32 without TF32). None on a CPU, and with a
    line saying why for a GPU the table does not know."""
    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops * 1e12, ""
    if device.type != "cuda":
        return None, ""
    from zerodp.planner.hardware import gpu_from_device_name

    name = torch.cuda.get_device_name(device)
    spec, unknown = gpu_from_device_name(name, 0)
    if unknown:
        return None, f"no MFU: {name} is not in the planner's table; give its peak with train.peak_tflops"
    return spec.peak_flops_32 if cfg.train.precision == "fp32" else spec.peak_flops_16, ""
