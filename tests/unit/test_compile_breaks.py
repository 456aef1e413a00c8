"""train.compile's graph breaks, counted by dynamo (torch._dynamo.utils.counters) on a one-rank gloo
group in this process: compiling each block's forward leaves the hooks on the block (FSDP2's, zerodp's
unsharded-size measurement, whose storage data_ptr dynamo cannot trace) outside the compiled code, so
a step breaks no graph; compiling the module's whole call, hooks included, breaks at zerodp's hook.
fsdp compiles before it shards (activation checkpointing, compile, shard, as torchtitan does). The
numbers of compiled runs: tests/distributed/test_compile.py."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from zerodp.config import load_config
from zerodp.models import build_model, compile_blocks
from zerodp.strategies import RunContext, make_strategy


def _fsdp(tiny, *extra):
    cfg = load_config(None, tiny + ["strategy.name=fsdp", *extra])
    strategy = make_strategy("fsdp")
    strategy.setup(build_model(cfg.model, device="meta"), RunContext(cfg, 0, 1, 0, torch.device("cpu"), 1, 1))
    return strategy


def _breaks_in_two_steps(strategy) -> dict:
    torch._dynamo.reset()
    counters.clear()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        strategy.backward(strategy.model(x, x))
        strategy.step(1e-3)
    return {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "reasons": list(counters["graph_break"])}


def test_compiled_block_forwards_break_no_graph_under_fsdp(tiny, group):
    strategy = _fsdp(tiny, "train.grad_noise_scale=true")  # both of zerodp's FSDP hooks registered
    assert compile_blocks(strategy.model, backend="eager") == len(strategy.model.blocks())
    got = _breaks_in_two_steps(strategy)
    assert got["breaks"] == 0, got["reasons"]
    assert got["graphs"] >= 1  # the blocks did compile


def test_compiling_the_whole_module_call_breaks_at_zerodps_hook(tiny, group):
    """The contrast: Module.compile (the module's __call__, hooks and all) after fully_shard."""
    strategy = _fsdp(tiny)
    for block in strategy.model.blocks():
        block.compile(backend="eager")
    got = _breaks_in_two_steps(strategy)
    assert got["breaks"] >= 1 and any("data_ptr" in r for r in got["reasons"]), got["reasons"]


def test_fsdp_compiles_each_block_before_sharding_it(tiny, group):
    strategy = _fsdp(tiny, "train.compile=true")
    blocks = strategy.model.blocks()
    assert all("forward" in vars(b) for b in blocks)  # compiled (lazily: nothing is built until called)
    assert compile_blocks(strategy.model) == 0  # the loop's call after setup leaves them as they are
    assert all(type(b).__name__.startswith("FSDP") for b in blocks)  # sharded after compiling
