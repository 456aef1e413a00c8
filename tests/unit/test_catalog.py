"""The strategy catalog (zerodp/strategies/catalog.py) is the one list of strategies: the classes declare
what it says, config validation and the registry take their names from it, the planner's rows follow
it, and no code outside zerodp/strategies/ tells strategies apart by comparing a name with a literal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zerodp.config import load_config
from zerodp.errors import ConfigError, UserError
from zerodp.planner import Cluster, Workload, gpu_preset
from zerodp.planner.rows import layouts
from zerodp.strategies import make_strategy
from zerodp.strategies.catalog import CATALOG, STATES, planned, spec

ROOT = Path(__file__).resolve().parents[2] / "zerodp"


def _names_a_strategy(node: ast.AST) -> bool:
    """A string literal that is a strategy's name or a planner row of it ('fsdp+offload', 'zero3+zero++')."""
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split("+")[0] in CATALOG


def name_comparisons(source: str) -> list[int]:
    """Lines where a value is compared with a strategy-name literal: ==, !=, is, `in ("zero1", ...)`, or a
    `case "fsdp":`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [o for o in operands if _names_a_strategy(o)]
            literals += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts
                         if _names_a_strategy(e)]
            if literals:
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _names_a_strategy(node.value):
            lines.append(node.lineno)
    return lines


def test_no_strategy_name_is_compared_outside_the_strategies():
    found = [f"{f.relative_to(ROOT.parent)}:{line}" for f in sorted(ROOT.rglob("*.py"))
             if ROOT / "strategies" not in f.parents for line in name_comparisons(f.read_text())]
    assert not found, ("these compare a strategy's name with a literal; read a field of "
                       "zerodp.strategies.catalog instead:\n" + "\n".join(found))


def test_the_scan_finds_a_name_comparison():
    source = ('a = s == "fsdp"\nb = "zero1" != s\nc = s in ("ddp", "x")\nd = r.name not in ["zero3+zero++"]\n'
              'match s:\n    case "single":\n        pass\n'
              'ok = s == "auto" or s.layout == "deepspeed" or k == "zero_optimization" or s == 3')
    assert name_comparisons(source) == [1, 2, 3, 4, 6]


@pytest.mark.parametrize("name", list(CATALOG))
def test_each_class_declares_what_the_catalog_says(name):
    s, strategy = CATALOG[name], make_strategy(name)
    assert (strategy.name, strategy.layout, strategy.gathers_in_forward) == (s.name, s.layout, s.gathers_in_forward)
    assert getattr(strategy, "stage", s.zero_stage) == s.zero_stage  # DeepSpeed's stage is the catalog's
    assert s.layout in ("canonical", "deepspeed", "dcp")
    assert s.gathers_in_forward == ("params" in s.shards)  # only sharded parameters are gathered


def test_what_each_strategy_shards():
    assert {name: s.shards for name, s in CATALOG.items()} == {
        "single": (), "ddp": (), "zero1": ("optimizer",), "zero2": ("grads", "optimizer"),
        "zero3": STATES, "fsdp": STATES}


def test_config_and_registry_take_their_names_from_the_catalog():
    names = " | ".join(CATALOG)
    assert names == "single | ddp | zero1 | zero2 | zero3 | fsdp"
    for name in (*CATALOG, "auto"):
        assert load_config(None, [f"strategy.name={name}"]).strategy.name == name
    with pytest.raises(ConfigError, match=rf"strategy.name='zero4' is not one of {names} \| auto; did you mean"):
        load_config(None, ["strategy.name=zero4"])
    with pytest.raises(UserError, match=f"strategy 'zero4' is not available; choose one of {names}"):
        make_strategy("zero4")
    with pytest.raises(ValueError, match="unknown strategy 'auto'"):
        spec("auto")


def test_the_planner_rows_follow_the_catalog():
    """Planner order, hybrid rows on several nodes, offload rows last (less offloaded first); on one GPU
    ddp runs as single."""
    two_nodes = Cluster(gpu=gpu_preset("h100"), gpus_per_node=8, nodes=2)
    assert [x.name for x in layouts(two_nodes, Workload())] == [
        "ddp", "zero1", "zero2", "fsdp", "zero3", "fsdp+hybrid", "zero3+zero++", "zero2+offload_optimizer",
        "zero3+offload_optimizer", "fsdp+offload", "zero3+offload_optimizer+offload_params"]
    one = Cluster(gpu=gpu_preset("h100"), gpus_per_node=1, nodes=1)
    assert [x.name for x in layouts(one, Workload())][:2] == ["single", "zero1"]
    assert [s.name for s in planned()] == ["ddp", "zero1", "zero2", "fsdp", "zero3"]


def test_a_single_process_strategy_refuses_a_process_group():
    import torch

    from zerodp.trainer.loop import resolve_strategy

    one = [name for name, s in CATALOG.items() if s.single_process]
    assert one == ["single"]
    with pytest.raises(UserError, match="strategy.name=single cannot run on 2 processes; use ddp"):
        resolve_strategy(load_config(None, ["strategy.name=single"]), 2, torch.device("cpu"))
    cfg = load_config(None, ["strategy.name=single", "train.micro_batch_size=1"])
    assert resolve_strategy(cfg, 1, torch.device("cpu")) == (cfg, None)
