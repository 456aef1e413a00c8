"""Validation: the loss over the target tokens of the validation batches, normalised once over all of them.

With a loss mask (`zerodp prepare --chat`) micro batches hold very different numbers of targets, so the
mean of per-micro-batch means would weigh a batch of 3 answer tokens as much as one of 300 (the bug
docs/fine_tuning.md works through for training). Here every micro batch adds its sum of target losses
and its target count, and the loss is sum / count over every micro batch of every rank: one all-reduce
of two numbers per source. Without a mask every micro batch holds micro x block_size targets and this
is the plain mean.
"""

from __future__ import annotations

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


@torch.no_grad()
def evaluate(strategy, val_data, cfg, env) -> dict[str, float]:
    """The validation loss over eval_batches micro batches per rank: the sum of their target tokens' losses
    over the number of their targets, on every rank together: {"val_loss"}, and for a mixture the loss of
    each source ("val_loss/<name>") with val_loss their mean by weight."""
    strategy.model.eval()
    micro, sources = cfg.train.micro_batch_size, val_data.per_source()
    sums = torch.zeros(len(sources), 2, dtype=torch.float64)  # on the CPU: the gloo path of every backend
    for j, (_, data) in enumerate(sources):
        for i in range(cfg.train.eval_batches):
            # Fixed validation batches: step index i of the validation split.
            batch = data.rank_micro_batches(i, micro * env.world_size, micro, env.rank, env.world_size)[0]
            with strategy.autocast():
                loss = strategy.model(*(t.to(env.device) for t in batch))
            total, n = target_sums(loss, batch[1])
            sums[j, 0] += total.cpu()
            sums[j, 1] += n
    strategy.model.train()
    dist.all_reduce(sums)
    losses = token_weighted(sums)
    if len(sources) == 1:
        return {"val_loss": losses[0]}
    weights = [s.weight for s in val_data.streams]
    blended = sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)
    return {"val_loss": blended, **{f"val_loss/{name}": loss for (name, _), loss in zip(sources, losses)}}


def windows_batch(split, mask, rows, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) (len(rows), block) of the consecutive windows `rows` of a split's tokens (window r: tokens
    [r*block, r*block + block + 1)), y IGNORE_INDEX where `mask` (the split's loss mask, or None) says the
    token is no target; `zerodp eval`'s batches."""
    import numpy as np

    buf = np.stack([np.asarray(split[r * block : r * block + block + 1], dtype=np.int64) for r in rows])
    y = buf[:, 1:].copy()
    if mask is not None:
        keep = np.stack([np.asarray(mask[r * block + 1 : r * block + block + 1]) for r in rows])
        y[keep == 0] = IGNORE_INDEX
    return torch.from_numpy(buf[:, :-1]), torch.from_numpy(y)
