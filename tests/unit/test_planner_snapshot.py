"""The host memory of checkpoint.async_save in `zerodp plan`: one copy of what each rank's save writes,
on the node of rank 0, by hand arithmetic for each layout (zerodp/planner/snapshot.py)."""

from __future__ import annotations

import json
import math

from zerodp.cli.commands import main

P = 8_030_261_248  # llama3-8b (the planner's preset)


def plan(capsys, *argv) -> dict:
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--nodes", "2", "--hbm", "80GB", "--json",
                 *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_snapshot_host_memory_per_node_by_layout(capsys):
    got = plan(capsys, "--async-save")
    assert got["params"] == P and got["async_save"] is True
    rows = {r["name"]: r["async_save_host_bytes_per_node"] for r in got["strategies"]}
    shard = 12 * math.ceil(P / 16)  # fp32 master (or parameter) shard + two AdamW moments, 16 ranks
    assert rows["ddp"] == 12 * P  # rank 0 writes the whole: fp32 weights and both moments
    assert rows["zero1"] == rows["zero2"] == 8 * shard + 2 * P  # + rank 0's bf16 module file
    assert rows["zero3"] == rows["zero3+zero++"] == 8 * shard  # the module file holds placeholders only
    assert rows["fsdp"] == 8 * shard
    assert rows["fsdp+hybrid"] == 8 * 12 * math.ceil(P / 8)  # HSDP shards within the node: 12P per node
    assert rows["zero3+offload_optimizer"] == rows["zero3"]  # offloading moves states, not what is saved
    fp32 = {r["name"]: r["async_save_host_bytes_per_node"] for r in plan(capsys, "--precision", "fp32")["strategies"]}
    assert fp32["zero2"] == 8 * shard + 4 * P and fp32["fsdp"] == 8 * shard


def test_the_table_shows_the_column_only_with_async_save(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--hbm", "80GB", "--async-save"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(x for x in lines if x.startswith("strategy "))
    assert header.split()[-2:] == ["cpu/node", "async/node"]
    ddp = next(x for x in lines if x.startswith("ddp "))
    assert ddp.split()[-1] == f"{12 * P / 1e9:.1f}" == "96.4"
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--hbm", "80GB"]) == 0
    assert "async/node" not in capsys.readouterr().out


def test_a_config_with_async_save_shows_it(capsys):
    assert main(["plan", "--config", "configs/tiny.yaml", "checkpoint.async_save=true", "--gpus", "2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["async_save"] is True
    assert {r["name"]: r["async_save_host_bytes_per_node"] for r in got["strategies"]}["ddp"] == 12 * got["params"]
