"""Host memory of checkpoint.async_save: one host copy of what each rank's save writes, per node.

A background save copies what a synchronous save would write into host buffers that stay allocated
from one save to the next (zerodp/checkpoint/background.py), so the figure is held for the whole run,
not only while a save is written. What each rank writes, by the strategy's layout (catalog `layout`):

* canonical (single, ddp): rank 0 alone, the full fp32 weights and both AdamW moments: 12P.
* dcp (fsdp): every rank its shard of the fp32 weights and moments, 12P/N (HSDP: N = GPUs per node).
* deepspeed (zero1-3): every rank its fp32 master partition and moments, 12P/N; zero1/2's rank 0 also
  writes the whole module in the compute dtype (2P in bf16, 4P in fp32), zero3's module file holds
  only placeholders.

The node of rank 0 holds the most; that node's figure is the one reported. Pure arithmetic, no torch.
"""

from __future__ import annotations

import math

from zerodp.planner.units import COMPUTE_BYTES
from zerodp.strategies.catalog import spec


def rank_bytes(params: int, strategy: str, shards_over: int, precision: str, rank: int = 0) -> int:
    """Bytes one rank's snapshot holds: `rank` of `shards_over` ranks sharing the sharded states."""
    s = spec(strategy)
    if s.layout == "canonical":
        return 12 * params if rank == 0 else 0
    shard = 12 * math.ceil(params / shards_over)
    module = COMPUTE_BYTES[precision] * params if s.layout == "deepspeed" and s.zero_stage < 3 and rank == 0 else 0
    return shard + module


def host_bytes_per_node(params: int, strategy: str, world_size: int, gpus_per_node: int, precision: str,
                        hybrid: bool = False) -> int:
    """One copy of each rank's checkpoint on the node of rank 0 (`hybrid`: fsdp sharding within a node)."""
    shards_over = gpus_per_node if hybrid and spec(strategy).hybrid_shard else world_size
    return sum(rank_bytes(params, strategy, shards_over, precision, r) for r in range(min(gpus_per_node, world_size)))
