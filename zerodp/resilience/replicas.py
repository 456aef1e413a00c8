"""Replica checks: state every rank holds the same copy of is hashed on each rank's device and the
hashes compared across the ranks, so that a rank whose copy went wrong (a flipped bit, a faulty device:
silent data corruption) is named before it is saved, instead of training on, wrong, unseen.

What is compared, by what the strategy's catalog entry says it shards (zerodp.strategies.catalog):
the module's parameters where parameters are not sharded (ddp: the fp32 weights; zero1/zero2: the
engine's working weights, 16-bit or fp32), the AdamW moments where optimizer state is not sharded
(ddp), and the data order (the step and train.seed it is a function of, with the global batch).
Sharded state (zero3, fsdp: parameters, gradients and moments) is not compared across shards: each
rank holds its own shard, and the parameters the forward gathers are the same on every rank by
construction (a bit flipped in a shard reaches every rank's gathered copy alike), so a comparison of
gathered copies only sees a fault of the gather itself; no cheap hook is taken for that
(docs/operations.md). What they compare instead (GatheredHashes): the parameters each rank's forward
gathered, hashed on the steps a check will follow, since a rank whose gathered copy is wrong (a bad
receive, device memory) computes wrong gradients that the reduction spreads into every shard.
HSDP (fsdp with strategy.hybrid_shard) holds each shard once per replica group:
each rank's shards of the parameters and moments are compared with the ranks that hold the same
shards in the other replica groups (a column of the (replicate, shard) device mesh).

A tensor's hash is the sum of its elements' bits read as integers (int16 or int32 views, summed in
int64, wrapping): flipping bit k of one element moves the sum by exactly 2^k, which is never 0 modulo
2^64, so any single flipped bit shows. One int64 per tensor, stacked, one all-gather per check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerodp.errors import PeerFailure
from zerodp.strategies.catalog import CATALOG

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatch(PeerFailure):
    """A rank's copy of replicated state differs from the other ranks'; the message names it (exit 1)."""


def bits_hash(t: torch.Tensor) -> torch.Tensor:
    """0-d int64 on t's device: the sum of t's elements read as integers of their width (wrapping)."""
    flat = t.detach().reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()]).sum(dtype=torch.int64)


def replicated_tensors(strategy, spec_name: str) -> dict[str, torch.Tensor]:
    """The tensors every rank of a replica group (`replica_groups`) holds the same copy of under strategy
    `spec_name`, by name: 'param/<name>' where parameters are not sharded, 'exp_avg/<name>' and
    'exp_avg_sq/<name>' where the optimizer's state is not; under HSDP this rank's shards of both; {}
    where everything is sharded once."""
    spec = CATALOG.get(spec_name)
    if spec is None or spec.single_process:
        return {}
    if "params" in spec.shards:
        return _replica_shards(strategy) if _hybrid_mesh(strategy) is not None else {}
    module = getattr(strategy, "module", None)
    if module is None:
        return {}
    out = {f"param/{n}": p for n, p in module.named_parameters()}
    optimizer = getattr(strategy, "optimizer", None)
    if "optimizer" not in spec.shards and optimizer is not None:
        for n, p in module.named_parameters():
            for kind in ("exp_avg", "exp_avg_sq"):
                if torch.is_tensor(v := optimizer.state.get(p, {}).get(kind)):
                    out[f"{kind}/{n}"] = v
    return out


def _hybrid_mesh(strategy):
    """The (replicate, shard) device mesh of an HSDP model's parameters, or None."""
    model = getattr(strategy, "model", None)
    first = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    mesh = getattr(first, "device_mesh", None)
    return mesh if mesh is not None and mesh.mesh_dim_names == ("replicate", "shard") else None


def _replica_shards(strategy) -> dict[str, torch.Tensor]:
    """HSDP: this rank's shards of the parameters and AdamW moments (each replica group holds the same)."""
    optimizer, out = getattr(strategy, "optimizer", None), {}
    for n, p in strategy.model.named_parameters():
        out[f"param/{n}"] = p.to_local()
        for kind in ("exp_avg", "exp_avg_sq"):
            v = optimizer.state.get(p, {}).get(kind) if optimizer is not None else None
            if torch.is_tensor(v):
                out[f"{kind}/{n}"] = v.to_local() if hasattr(v, "to_local") else v
    return out


def replica_groups(strategy, world_size: int) -> list[list[int]]:
    """The sets of ranks that hold the same copy of `replicated_tensors`: every rank, or under HSDP each
    column of the (replicate, shard) mesh (the ranks that hold one shard, one in each replica group)."""
    mesh = _hybrid_mesh(strategy)
    if mesh is None:
        return [list(range(world_size))]
    return [column.tolist() for column in mesh.mesh.t()]  # mesh.mesh: (replicas, shard group) ranks


def odd_ones_in(hashes: list[list[int]], groups: list[list[int]]) -> tuple[list[int], list[int], bool]:
    """`odd_ones` of column 0 (the data order) across every rank, and of the other columns within each
    group of ranks that hold the same copy; the rank and column indices are the whole table's."""
    ranks, columns, tied = odd_ones([h[:1] for h in hashes])
    ranks, columns = set(ranks), set(columns)
    for group in groups:
        r, c, no_majority = odd_ones([hashes[k][1:] for k in group])
        ranks.update(group[i] for i in r)
        columns.update(j + 1 for j in c)
        tied = tied or no_majority
    return sorted(ranks), sorted(columns), tied


def odd_ones(hashes: list[list[int]]) -> tuple[list[int], list[int], bool]:
    """(ranks whose hash differs from the majority at some tensor, the tensor indices that differ,
    whether some tensor had no majority); with no majority (two ranks, or a tie) every rank that
    differs from rank 0's is listed with rank 0. ([], [], False) when every rank agrees."""
    ranks, tensors, tied = set(), [], False
    for j in range(len(hashes[0])):
        column = [h[j] for h in hashes]
        if len(set(column)) == 1:
            continue
        tensors.append(j)
        counts = {v: column.count(v) for v in column}
        top = max(counts.values())
        winners = [v for v, c in counts.items() if c == top]
        if len(winners) == 1:
            ranks.update(r for r, v in enumerate(column) if v != winners[0])
        else:
            ranks.update(r for r, v in enumerate(column) if v != column[0])
            ranks.add(0)
            tied = True
    return sorted(ranks), tensors, tied


class GatheredHashes:
    """Where parameters are sharded (zero3, fsdp): a forward pre-hook on each module that holds parameters
    of its own, registered after the engine's (which gathers them), adds the hash of each gathered
    parameter to a device scalar of its name while armed: on the steps a check follows, so the other
    steps pay nothing but the hook's call. Every rank runs the same forwards, so the sums agree. Not
    under train.compile (a hook that changes between steps would recompile the blocks)."""

    def __init__(self, strategy, device: torch.device):
        self.armed, self.device = False, device
        model = getattr(strategy, "module", None) or strategy.model
        self.sums: dict[str, torch.Tensor] = {}
        for prefix, m in model.named_modules():
            # frozen ones too (a LoRA run's base): gathered as the adapters are, and a wrong copy as harmful
            names = [n for n, _ in m.named_parameters(recurse=False)]
            if names:
                for n in names:
                    self.sums[f"gathered/{prefix + '.' if prefix else ''}{n}"] = torch.zeros((), dtype=torch.int64,
                                                                                             device=device)
                m.register_forward_pre_hook(self._hook(prefix, names))

    def _hook(self, prefix: str, names: list[str]):
        keys = [f"gathered/{prefix + '.' if prefix else ''}{n}" for n in names]

        def hook(module, _args):
            if self.armed:
                with torch.no_grad():
                    for key, n in zip(keys, names):
                        self.sums[key].add_(bits_hash(getattr(module, n)).to(self.device))
        return hook

    def take(self) -> dict[str, torch.Tensor]:
        """The sums since the last take, by name; resets them."""
        out = {k: v.clone() for k, v in self.sums.items()}
        for v in self.sums.values():
            v.zero_()
        return out


class ReplicaCheck:
    """Compares the ranks' replicated state every train.check_replicas_every steps (and before every
    save: a checkpoint is never written from a state that failed the check)."""

    def __init__(self, cfg, env, strategy):
        self.every, self.env, self.strategy = cfg.train.check_replicas_every, env, strategy
        self.spec_name, self.seed, self.batch = cfg.strategy.name, cfg.train.seed, cfg.train.global_batch_size
        self.last = None
        """The step of the last check, which all ranks passed."""
        spec = CATALOG.get(self.spec_name)
        sharded = spec is not None and "params" in spec.shards and _hybrid_mesh(strategy) is None  # HSDP: replicas
        self.gathered = (GatheredHashes(strategy, env.device)
                         if self.active() and sharded and not cfg.train.compile else None)

    def arm(self, step: int, saving: bool) -> None:
        """Before step `step` (1-based): hash what its forwards gather when a check may follow it."""
        if self.gathered is not None:
            self.gathered.armed = self.due(step, saving)

    def active(self) -> bool:
        return self.every > 0 and self.env.world_size > 1

    def due(self, step: int, saving: bool) -> bool:
        return self.active() and (saving or self.last is None or step - self.last >= self.every)

    def check(self, step: int, saving: bool) -> dict:
        """Collective when due: compare the ranks' hashes after `step` (1-based). {} when not due or all
        agree; else {"replica_mismatch": {...}} for the step's record (then call `stop`)."""
        if not self.due(step, saving):
            return {}
        last_good, self.last = self.last, step
        tensors = (self.gathered.take() if self.gathered is not None
                   else replicated_tensors(self.strategy, self.spec_name))
        names = ["data_order", *tensors]
        device = self.env.device
        order = torch.tensor([step * 1_000_003 + self.seed * 7919 + self.batch], dtype=torch.int64, device=device)
        hashes = [bits_hash(t).to(device) for t in tensors.values()]  # offloaded moments hash on the host
        mine = torch.cat([order, torch.stack(hashes)]) if tensors else order
        gathered = [torch.empty_like(mine) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine)
        groups = replica_groups(self.strategy, self.env.world_size)
        ranks, differing, tied = odd_ones_in([g.tolist() for g in gathered], groups)
        if not ranks:
            return {}
        hosts = self.env.hosts
        return {"replica_mismatch": {"step": step, "ranks": ranks, "hosts": [hosts[r] for r in ranks],
                                     "tensors": [names[j] for j in differing], "no_majority": tied,
                                     "last_agreed": last_good}}

    def stop(self, found: dict) -> None:
        """Raise ReplicaMismatch for a check's finding (the run then stops before any save)."""
        if not found:
            return
        m = found["replica_mismatch"]
        who = ", ".join(f"rank {r} on {h}" for r, h in zip(m["ranks"], m["hosts"]))
        shown = ", ".join(m["tensors"][:5]) + (f" and {len(m['tensors']) - 5} more" if len(m["tensors"]) > 5 else "")
        no_majority = " (no majority: the ranks listed disagree)" if m["no_majority"] else ""
        since = f" (they agreed after step {m['last_agreed']})" if m["last_agreed"] is not None else ""
        raise ReplicaMismatch(
            f"replica check after step {m['step']}{since}: {who} hold(s) replicated state that differs from the other "
            f"ranks'{no_majority}: {shown}; silent data corruption or a faulty device: the run stopped before "
            f"saving, so the newest checkpoint is the last good one; replace or exclude that host and rerun the "
            f"same command to resume from it")
