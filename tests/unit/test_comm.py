"""zerodp.telemetry.comm's counter on a real (one-rank, gloo) process group in this process: sizes per kind,
one count for a collective that forwards to another, nothing outside a step, the functions given back,
DDP's buckets seen through the comm hook. Several ranks, every engine and the planner's prediction:
tests/distributed/test_equivalence.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from zerodp.telemetry.comm import CommMeter, StepComm


@pytest.mark.filterwarnings("ignore:`torch.distributed.*` is deprecated:FutureWarning")
def test_each_kind_counted_once_with_its_full_size(group, monkeypatch):
    """all_gather_into_tensor and reduce_scatter_tensor, DeepSpeed's names, forward to torch's newer ones.
    The group is taken for one of 2 ranks (this process has one): a group of one sends nothing, below."""
    from zerodp.telemetry import comm

    monkeypatch.setattr(comm, "_group_size", lambda group: 2)
    meter = CommMeter(True)
    originals = (dist.all_reduce, c10d.all_gather_single, dist.reduce_scatter_tensor)
    x = torch.ones(10)  # 40 bytes
    dist.all_reduce(x)  # before the step: not counted
    with meter.step():
        dist.all_reduce(x)
        dist.all_reduce(torch.ones(3, dtype=torch.bfloat16))  # 6 bytes
        dist.all_gather_into_tensor(torch.empty(10), x)  # forwards to all_gather_single: one all-gather
        dist.reduce_scatter_tensor(torch.empty(10), torch.ones(10))
        dist.broadcast(torch.ones(4, dtype=torch.int64), src=0)
    dist.all_reduce(x)  # after: not counted
    assert meter.record() == {"comm_bytes": {"all_reduce": 46, "all_gather": 40, "reduce_scatter": 40,
                                             "broadcast": 32, "total": 158},
                              "comm_bus_bytes": {"all_reduce": 46, "all_gather": 20, "reduce_scatter": 20,
                                                 "broadcast": 16, "total": 102}}  # (N-1)/N, all-reduce twice
    assert meter.last.calls == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}
    assert (dist.all_reduce, c10d.all_gather_single, dist.reduce_scatter_tensor) == originals
    with meter.step():
        dist.all_reduce(torch.ones(1))
    summary = meter.summary()
    assert summary["steps"] == 2 and not summary["same_every_step"] and summary["differing_steps"] == [2]


def test_ring_bytes_per_rank():
    step = StepComm()
    step.add("all_reduce", 300, 3)  # 2 (N-1)/N
    step.add("all_gather", 300, 3)  # (N-1)/N
    step.add("reduce_scatter", 300, 3)
    step.add("broadcast", 300, 2)
    assert step.bus == {"all_reduce": 400, "all_gather": 200, "reduce_scatter": 200, "broadcast": 150}
    assert step.total == 1200 and step.bus_total == 950


def test_a_group_of_one_counts_nothing(group):
    """Issue 38 item 18: zero2 on one process all-reduces over its one rank; metrics.jsonl counted 277,512
    bytes a step while the run's summary said 0 sent. Nothing leaves the rank: both say 0."""
    meter = CommMeter(True)
    with meter.step():
        dist.all_reduce(torch.ones(10))
    assert meter.record() == {"comm_bytes": {"total": 0}, "comm_bus_bytes": {"total": 0}}


def test_switched_off_counts_nothing(group):
    meter = CommMeter(False)
    with meter.step():
        dist.all_reduce(torch.ones(10))
    assert meter.record() == {} and meter.summary() is None


def test_ddp_buckets_counted_through_the_comm_hook(group, tiny, monkeypatch):
    """DDP's reducer all-reduces in C++; with train.measure_comm the strategy's hook makes it visible:
    every fp32 gradient once per step, and the update is the one without the hook (the group taken for
    one of 2 ranks, as above)."""
    from zerodp.config import load_config
    from zerodp.telemetry import comm

    monkeypatch.setattr(comm, "_group_size", lambda group: 2)
    from zerodp.models import build_model, param_count
    from zerodp.strategies import RunContext, make_strategy
    from zerodp.trainer.loop import train_step

    weights = []
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    for measure in (True, False):
        torch.manual_seed(0)
        cfg = load_config(None, tiny + [f"train.measure_comm={str(measure).lower()}"])
        strategy = make_strategy("ddp")
        strategy.setup(build_model(cfg.model, device="meta"), RunContext(cfg, 0, 1, 0, torch.device("cpu"), 2))
        meter = CommMeter(True)
        with meter.step():
            train_step(strategy, [(x, x), (x, x)], 1e-3, torch.device("cpu"))
        counted = meter.record().get("comm_bytes", {}).get("all_reduce", 0)
        assert counted == (4 * param_count(cfg.model) if measure else 0)
        weights.append(strategy.full_state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
