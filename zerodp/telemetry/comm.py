"""Communication per optimizer step, measured: the bytes each rank hands to every collective issued
inside a training step, by kind, and the ring bus bytes they imply.

Every engine's collectives are seen, without changing what they send:

* DeepSpeed (deepspeed.comm) and FSDP2 (_fsdp_collectives) call the `torch.distributed` collective
  functions, looked up when they call them: while a step is measured (`CommMeter.step`), those functions
  are wrapped by counting ones, in `torch.distributed` and in `distributed_c10d` (where the deprecated
  names such as `all_gather_into_tensor` forward to `all_gather_single`); a collective that calls another
  is counted once, at the outermost call. DTensor's functional collectives (FSDP2's gradient norm) are
  wrapped the same way in `torch.distributed._functional_collectives`.
* DDP's reducer all-reduces its buckets in C++, out of sight: with train.measure_comm zerodp's DDP
  strategy registers a comm hook that does what the reducer does (scale the bucket by 1/N, all-reduce
  it) through `torch.distributed.all_reduce`, and is counted like the rest.

Sizes come from numel * element_size: nothing waits for the device. What `bytes` holds per kind is the
collective's full tensor (the all-reduced tensor, the all-gather's output, the reduce-scatter's input, the
broadcast tensor; nothing for a group of one rank, where nothing is sent), and `bus` the bytes each rank
sends in a ring over a group of N ranks: all-reduce 2(N-1)/N x size, reduce-scatter and all-gather
(N-1)/N x size, broadcast and reduce (a pipelined chain: every rank but one sends the tensor once)
(N-1)/N x size, averaged over the ranks (docs/memory_model.md, "Communication per step"). `PlanCheck`
holds the planner's prediction for the run beside them.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

BUS_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0, "reduce": 1.0,
              "all_to_all": 1.0}
"""Bus bytes = factor x (N-1)/N x size."""


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sum(ts) -> int:
    return sum(_nbytes(t) for t in ts or ())


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _funcol_group_size(group) -> int:
    """Ranks of a functional collective's group: a ProcessGroup, a (mesh, dim) pair, a list of ranks or a name."""
    from torch.distributed._functional_collectives import _resolve_group_name

    return c10d._resolve_process_group(_resolve_group_name(group)).size()


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


# name -> (kind, size(args, kwargs, n) in bytes, index and name of the group argument). Sizes as the
# module docstring defines them; the list forms (all_gather, reduce_scatter) count their N pieces.
_C10D = {
    "all_reduce": ("all_reduce", lambda a, k, n: _nbytes(_arg(a, k, 0, "tensor")), 2),
    "all_reduce_coalesced": ("all_reduce", lambda a, k, n: _sum(_arg(a, k, 0, "tensors")), 2),
    "broadcast": ("broadcast", lambda a, k, n: _nbytes(_arg(a, k, 0, "tensor")), 2),
    "reduce": ("reduce", lambda a, k, n: _nbytes(_arg(a, k, 0, "tensor")), 3),
    "all_gather": ("all_gather", lambda a, k, n: n * _nbytes(_arg(a, k, 1, "tensor")), 2),
    "all_gather_single": ("all_gather", lambda a, k, n: _nbytes(_arg(a, k, 0, "output_tensor")), 2),
    "all_gather_into_tensor": ("all_gather", lambda a, k, n: _nbytes(_arg(a, k, 0, "output_tensor")), 2),
    "_all_gather_base": ("all_gather", lambda a, k, n: _nbytes(_arg(a, k, 0, "output_tensor")), 2),
    "all_gather_coalesced": ("all_gather", lambda a, k, n: n * _sum(_arg(a, k, 1, "input_tensor_list")), 2),
    "reduce_scatter": ("reduce_scatter", lambda a, k, n: _sum(_arg(a, k, 1, "input_list")), 3),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k, n: _nbytes(_arg(a, k, 1, "input")), 3),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k, n: _nbytes(_arg(a, k, 1, "input")), 3),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k, n: _nbytes(_arg(a, k, 1, "input")), 3),
    "all_to_all_single": ("all_to_all", lambda a, k, n: _nbytes(_arg(a, k, 1, "input")), 4),
}
_FUNCOL = {
    "all_reduce": ("all_reduce", lambda a, k, n: _nbytes(_arg(a, k, 0, "self")), 2),
    "all_reduce_coalesced": ("all_reduce", lambda a, k, n: _sum(_arg(a, k, 0, "self")), 2),
    "all_gather_tensor": ("all_gather", lambda a, k, n: n * _nbytes(_arg(a, k, 0, "self")), 2),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k, n: _nbytes(_arg(a, k, 0, "self")), 3),
    "broadcast": ("broadcast", lambda a, k, n: _nbytes(_arg(a, k, 0, "self")), 2),
}


@dataclass
class StepComm:
    """One step's collectives on this rank: bytes (full size) and ring bus bytes per kind, and calls."""

    bytes: dict[str, int] = field(default_factory=dict)
    bus: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, group_size: int) -> None:
        if group_size <= 1:  # a collective over one rank moves nothing (zero2 on one process all-reduces)
            return
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1
        bus = BUS_FACTOR[kind] * (group_size - 1) / group_size * nbytes if group_size > 1 else 0
        self.bus[kind] = self.bus.get(kind, 0) + round(bus)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def bus_total(self) -> int:
        return sum(self.bus.values())

    def key(self) -> tuple:
        return tuple(sorted(self.bytes.items())), tuple(sorted(self.calls.items()))


_counting: StepComm | None = None
"""The step being measured, or None: read by every thread (DDP's hook and FSDP2's post-backward run on
autograd's device threads on CUDA)."""
_depth = threading.local()


def _counting_wrapper(fn, kind: str, size, group_index: int, group_size):
    def counted(*args, **kwargs):
        depth = getattr(_depth, "n", 0)
        step = _counting
        if depth == 0 and step is not None:
            n = group_size(_arg(args, kwargs, group_index, "group"))
            step.add(kind, size(args, kwargs, n), n)
        _depth.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n = depth

    counted.__wrapped__ = fn
    return counted


def _targets():
    """(module, name, wrapper) for every collective function the wrappers replace while a step is measured."""
    from torch.distributed import _functional_collectives as funcol

    out, made = [], {}
    for table, modules, group_size in ((_C10D, (dist, c10d), _group_size), (_FUNCOL, (funcol,), _funcol_group_size)):
        for name, (kind, size, group_index) in table.items():
            for module in modules:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                if id(fn) not in made:  # dist.x and c10d.x are one function: one wrapper for both names
                    made[id(fn)] = _counting_wrapper(fn, kind, size, group_index, group_size)
                out.append((module, name, fn, made[id(fn)]))
    return out


class CommMeter:
    """Measures the collectives of each training step (`with meter.step(): train_step(...)`).

    With `enabled` False every method is a no-op and the record holds nothing."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and dist.is_initialized()
        self.last: StepComm | None = None
        self.steps = 0
        self.distinct: dict[tuple, int] = {}
        """Each distinct step (bytes and calls per kind) -> the first step it was seen at."""
        self._targets = _targets() if self.enabled else []

    @contextlib.contextmanager
    def step(self):
        global _counting
        if not self.enabled:
            yield
            return
        counts = StepComm()
        for module, name, _, wrapper in self._targets:
            setattr(module, name, wrapper)
        _counting = counts
        try:
            yield
        finally:
            _counting = None
            for module, name, fn, _ in self._targets:
                setattr(module, name, fn)
        self.steps += 1
        self.distinct.setdefault(counts.key(), self.steps)
        self.last = counts

    def record(self) -> dict:
        """Fields for the step's metrics.jsonl record: comm_bytes and comm_bus_bytes, by kind and total."""
        if self.last is None:
            return {}
        c = self.last
        return {"comm_bytes": {**c.bytes, "total": c.total}, "comm_bus_bytes": {**c.bus, "total": c.bus_total}}

    def summary(self) -> dict | None:
        """The run's figures per step (the last step's), the number of steps measured, and whether every
        step sent the same; None when not measured."""
        if self.last is None:
            return None
        return {**self.record(), "comm_calls": dict(self.last.calls), "steps": self.steps,
                "same_every_step": len(self.distinct) == 1, "differing_steps": sorted(self.distinct.values())[1:]}


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class PlanCheck:
    """The planner's estimate for exactly this run (zerodp.planner.estimate_for_run), shown at the start,
    and at the end beside what the run measured: communication per step, per-rank state bytes and,
    on CUDA, the peak of torch's allocator."""

    def __init__(self, cfg, world_size: int, device_memory_bytes: int, device_name: str):
        from zerodp.planner.training import estimate_for_run

        self.cfg, self.world_size = cfg, world_size
        self.estimate = estimate_for_run(cfg, world_size, device_memory_bytes, device_name)

    def prediction(self) -> str:
        """One line: the run as the planner sees it, and what it predicts per step and per rank."""
        from zerodp.planner.activations import loss_line, loss_setting
        from zerodp.planner.models import spec_from_model_config

        e, t, m = self.estimate, self.cfg.train, self.cfg.model
        spec = spec_from_model_config(m)  # the head's widths, as the model has them (an hf_config's too)
        loss = (loss_line(m.loss_chunks, t.micro_batch_size * m.block_size, spec.vocab_size, spec.hidden)
                + loss_setting(m.loss_chunks))
        return (f"plan for this run: {e.name} on {self.world_size} rank(s), micro batch {t.micro_batch_size}, "
                f"{t.precision}, activation checkpointing {e.activation_checkpointing}, loss: {loss}: "
                f"comm/step {_mib(e.comm_bytes)} sent per rank, model states {_mib(_planned_states(e))} and "
                f"{_mib(e.total_bytes)} in all per rank, step {e.step_s:.3g}s")

    def compare(self, comm: dict | None, held: dict[str, int], device: torch.device, peaks=None,
                reference: dict[str, int] | None = None) -> dict:
        """Predicted beside measured, each {"predicted", "measured"}: "comm_bus_bytes" (the last step's,
        when measured), per-rank "params", "grads" and "optim" bytes (`held`: strategy.state_bytes()
        after the first step, when gradients may already be freed) and, on CUDA, the allocator's peaks
        (`peaks`, zerodp.telemetry.memory.Peaks): "startup_peak_allocated_bytes" and the training
        steps' "peak_allocated_bytes" (without `peaks`: the peak since the process started); with a DPO
        run's live reference (`reference`: its strategy's state_bytes()), "reference": what it holds
        on the device (zerodp.planner.preference; ddp's reducer buckets, which no tensor there reaches, left
        out of both)."""
        e = self.estimate
        out = {}
        if comm is not None:
            out["comm_bus_bytes"] = {"predicted": e.comm_bytes, "measured": comm["comm_bus_bytes"]["total"]}
        planned = {"params": e.params_bytes + e.persistent_bytes, "grads": e.grads_bytes + e.unsharded_grads_bytes,
                   "optim": e.optimizer_bytes + e.engine_master_bytes}  # DeepSpeed's fp32 master is under optim
        held = dict(held)
        if e.offloaded_bytes and "offloaded" not in held:  # a strategy whose state_bytes keeps no host key
            # offloads all three (fsdp's CPUOffloadPolicy: parameter shards, gradients, moments)
            held["offloaded"] = sum(held.get(k, 0) for k in planned)
            held.update({k: 0 for k in planned})
        out.update({k: {"predicted": v, "measured": held.get(k, 0)} for k, v in planned.items()})
        if e.offloaded_bytes or held.get("offloaded"):  # host memory beside host memory, device beside device
            out["offloaded"] = {"predicted": e.offloaded_bytes, "measured": held.get("offloaded", 0)}
        if reference is not None or e.reference_bytes:
            reached = sum(v for k, v in (reference or {}).items() if k not in ("offloaded", "unsharded_peak"))
            out["reference"] = {"predicted": e.reference_bytes - e.reference_unreached_bytes, "measured": reached}
        if device.type == "cuda":  # what the allocator saw: everything the planner counts but the CUDA context
            if peaks is not None:
                out["startup_peak_allocated_bytes"] = {"predicted": e.startup_bytes - e.overhead_bytes,
                                                       "measured": peaks.startup_bytes}
            out["peak_allocated_bytes"] = {"predicted": e.total_bytes - e.overhead_bytes,
                                           "measured": peaks.train_bytes if peaks is not None
                                           else torch.cuda.max_memory_allocated(device)}
        return out

    @staticmethod
    def report(compared: dict) -> str:
        """The end-of-run lines: predicted vs measured, with the measurement's error relative to the plan."""
        names = {"comm_bus_bytes": "comm/step sent per rank", "params": "parameters per rank",
                 "grads": "gradients per rank", "optim": "optimizer state per rank",
                 "startup_peak_allocated_bytes": "allocated at the start-up peak per rank",
                 "peak_allocated_bytes": "peak allocated per rank",  # the steps' (benchmarks read this line)
                 "reference": "DPO reference per rank"}
        lines = ["predicted vs measured:"]
        offload = "offloaded" in compared
        if offload:  # the three states as the device holds them, the rest in their own line
            names.update({k: names[k] + " on the device" for k in ("params", "grads", "optim")})
            names["offloaded"] = "offloaded to host memory per rank"
        for key, v in compared.items():
            predicted, measured = v["predicted"], v["measured"]
            if key == "grads" and not measured and predicted:
                lines.append(f"  {names[key]}: predicted {_mib(predicted)} at the peak, freed between steps")
            elif not predicted:  # no percentage of nothing
                lines.append(f"  {names[key]}: predicted none, measured "
                             + (f"{_mib(measured)}: not in the plan" if measured else "none"))
            else:
                lines.append(f"  {names[key]}: predicted {_mib(predicted)}, measured {_mib(measured)} "
                             f"({(measured - predicted) / predicted:+.1%})")
        return "\n".join(lines)


def _planned_states(e) -> int:
    """Parameters, gradients and optimizer state (with DeepSpeed's fp32 master) the planner puts on a rank."""
    return (e.params_bytes + e.persistent_bytes + e.grads_bytes + e.optimizer_bytes + e.engine_master_bytes
            + e.unsharded_grads_bytes)
