"""A mixture of experts' routers over a log interval, from the tokens each sparse block sent to each
expert (counted on the device as the blocks sort tokens, zerodp.models.moe.RouterLog; summed over the
interval's steps and the ranks at the sync point that already fetches the step figures, so no extra
host sync): per block, the most loaded expert's share against the mean share (1.0: perfectly balanced,
E: one expert takes every token), the least-used expert's share against the mean (0.0: an expert
received nothing), and the experts that received no token. An idle expert over a whole interval is
said in one line: it trains on nothing while it is idle."""

from __future__ import annotations


def router_figures(load: list[list[float]]) -> dict:
    """metrics.jsonl's router keys of one interval's (L, E) tokens per expert: per sparse block, in
    order, `moe/max_load` and `moe/min_load` (shares against the mean) and `moe/idle_experts` (indices)."""
    max_load, min_load, idle = [], [], []
    for counts in load:
        mean = sum(counts) / len(counts)
        max_load.append(round(max(counts) / mean, 4) if mean else 0.0)
        min_load.append(round(min(counts) / mean, 4) if mean else 0.0)
        idle.append([e for e, n in enumerate(counts) if n == 0])
    return {"moe/max_load": max_load, "moe/min_load": min_load, "moe/idle_experts": idle}


def idle_warning(figures: dict, blocks: list[int], first: int, last: int) -> str | None:
    """One line naming the experts that received no token over steps first..last (None if every one did);
    `blocks`: the model's block index of each sparse block."""
    idle = [(b, e) for b, e in zip(blocks, figures["moe/idle_experts"]) if e]
    if not idle:
        return None
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    which = "; ".join(f"block {b}: {', '.join(map(str, e))}" for b, e in idle)
    n = sum(len(e) for _, e in idle)
    return (f"router: {n} expert(s) received no token in {steps} ({which}): they train on nothing while idle; "
            f"a larger model.moe.router_aux_loss_coef spreads the tokens")


def summary(figures: dict) -> str:
    """The log line's words: the worst block's most loaded expert against the mean, and the idle experts."""
    idle = sum(len(e) for e in figures["moe/idle_experts"])
    return f", experts max load {max(figures['moe/max_load']):.2f}x mean, {idle} idle"
