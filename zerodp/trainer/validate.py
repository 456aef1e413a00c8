"""Validation: the loss over the target tokens of the validation set, normalised once over all of them.

The validation set of a split is fixed by the data settings and three training keys alone: micro batch i
(i < train.eval_batches) is positions [i*micro, (i+1)*micro) of the val split's sample sequence
(zerodp.data.samples, seeded with train.seed; micro = train.micro_batch_size), with the run's packing,
loss mask and document masking. It is the same at every world size and strategy: rank r computes micro
batches r, r + world, ... (every rank the same number of forwards, a sharded model's collectives need
it: a rank short of one computes a micro batch without targets, which adds nothing), and the sums are
all-reduced. `zerodp eval RUN` computes the same set with the same code on one process (`validation_sums`).

With a loss mask (`zerodp prepare --chat`) micro batches hold very different numbers of targets, so the
mean of per-micro-batch means would weigh a batch of 3 answer tokens as much as one of 300 (the bug
docs/fine_tuning.md works through for training). Here every micro batch adds its sum of target losses
and its target count, and the loss is sum / count over every micro batch of every rank: one all-reduce
of two numbers per source. Without a mask every micro batch holds micro x block_size targets and this
is the plain mean.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from zerodp.data.batches import IGNORE_INDEX


def target_sums(loss: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(sum of the target tokens' losses, number of targets) of a micro batch from the model's loss: its
    mean over the targets of `targets` (B, T), IGNORE_INDEX where none (the model divides by the count
    clamped to 1, so a micro batch without targets adds (0, 0))."""
    n = int((targets != IGNORE_INDEX).sum())
    return loss.detach().double() * max(n, 1), n


def token_weighted(sums: torch.Tensor) -> list[float]:
    """sums (sources, 2): [target-loss sum, target count] of each source -> each source's loss (sum /
    count; NaN for a source without a target)."""
    return [float(s / n) if n else float("nan") for s, n in sums.tolist()]


def rank_batches(batches: int, rank: int, world: int) -> list[int | None]:
    """The validation micro batches rank `rank` of `world` computes: r, r + world, ... below `batches`,
    then None (a forward without targets) up to ceil(batches / world), so every rank runs as many."""
    per = -(-batches // world)
    return [i if i < batches else None for i in range(rank, per * world, world)]


def validation_sums(forward: Callable, val_data, cfg, rank: int = 0, world: int = 1,
                    autocast=contextlib.nullcontext) -> torch.Tensor:
    """(sources, 2) float64 on the CPU: [target-loss sum, target count] of this rank's share of each
    source's validation set (the module docstring), `forward(batch)` giving a micro batch's mean loss
    over its targets."""
    micro, batches = cfg.train.micro_batch_size, cfg.train.eval_batches
    sources = val_data.per_source()
    sums = torch.zeros(len(sources), 2, dtype=torch.float64)  # on the CPU: the gloo path of every backend
    for j, (_, data) in enumerate(sources):
        for i in rank_batches(batches, rank, world):
            batch = data.rows(data.offsets(0 if i is None else i, micro))
            if i is None:  # the same shapes, no targets: (0, 0)
                batch = (batch[0], torch.full_like(batch[1], IGNORE_INDEX), *batch[2:])
            with autocast():
                loss = forward(batch)
            total, n = target_sums(loss, batch[1])
            sums[j, 0] += total.cpu()
            sums[j, 1] += n
    return sums


def losses_of(sums: torch.Tensor, val_data) -> dict[str, float]:
    """{"val_loss"} from the summed (sources, 2) of every rank, and for a mixture each source's loss
    ("val_loss/<name>") with val_loss their mean by weight."""
    losses = token_weighted(sums)
    if len(val_data.streams) == 1:
        return {"val_loss": losses[0]}
    names = [s.name for s in val_data.streams]
    weights = [s.weight for s in val_data.streams]
    blended = sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)
    return {"val_loss": blended, **{f"val_loss/{name}": loss for name, loss in zip(names, losses)}}


@torch.no_grad()
def evaluate(strategy, val_data, cfg, env) -> dict[str, float]:
    """The validation loss over the validation set (the module docstring), every rank together:
    {"val_loss"}, and for a mixture the loss of each source ("val_loss/<name>") with val_loss their mean
    by weight."""
    strategy.model.eval()
    sums = validation_sums(lambda batch: strategy.model(*(t.to(env.device) for t in batch)), val_data, cfg,
                           env.rank, env.world_size, strategy.autocast)
    strategy.model.train()
    dist.all_reduce(sums)
    return losses_of(sums, val_data)


def split_offsets(data, max_tokens: int | None = None) -> np.ndarray:
    """The start offsets of every sample of a (one-source) split once, in order: its fixed windows of
    block_size + 1 tokens, or with data.packing=false its documents; those that end (a document: start)
    within its first `max_tokens` tokens only. `zerodp eval --all`'s samples."""
    T, n = data.block, data.samples_per_epoch()[0]
    if data.packing:
        if max_tokens is not None:
            n = min(n, max(0, max_tokens) // T)
        return np.arange(n, dtype=np.int64) * T
    starts = np.asarray(data.streams[0].index[:n], dtype=np.int64)
    return starts if max_tokens is None else starts[starts < max(0, max_tokens)]
