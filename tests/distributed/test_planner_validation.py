"""The planner against reality: per-rank bytes of parameters, gradients and optimizer state that each
engine really holds (`strategy.state_bytes()`, 2 ranks, gloo) within 5% of `zerodp.planner`'s
prediction for the same config, in bf16 and fp32. Run with -s to see the table.

    .venv/bin/python -m pytest -q -s tests/distributed/test_planner_validation.py

The MoE rows (/moe) run a qwen3_moe of 8 experts, 2 per token (P = 1,690,368, every expert held).
The model (P = 1,612,800) is big enough that fixed overheads (AdamW's step counters, alignment) are
well under 1%. Its vocabulary is 64 rather than 256 because DeepSpeed's zero1/2 gradient partition
holds whole the parameter that straddles the partition boundary (here the tied embedding): 1.6% of a
rank's share with V = 64, 5.4% with V = 256 (docs/memory_model.md, "Validated against the engines").
"""

from __future__ import annotations

import torch

from tests.support.harness import run_distributed
from zerodp.config import load_config
from zerodp.strategies.catalog import CATALOG

WORLD = 2
STRATEGIES = tuple(name for name, s in CATALOG.items() if not s.single_process)
PRECISIONS = ("bf16", "fp32")
TOLERANCE = 0.05
MODEL = [
    "model.n_layer=2", "model.n_head=4", "model.n_embd=256", "model.block_size=64", "model.vocab_size=64",
    "train.micro_batch_size=2", "train.global_batch_size=8",  # 2 micro batches per step at world 2
    "strategy.bucket_size_mb=1",  # DeepSpeed's reduce buckets small next to the model
    # ZeRO-3 would otherwise keep parameters under 1e5 elements gathered (the embeddings here)
    "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0",
]
MOE = [  # a qwen3_moe in place of MODEL's dense model: 8 experts of width 256, 2 per token (P = 1,690,368)
    "model.arch=qwen3_moe", "model.n_kv_head=2", "model.n_embd=128", "model.moe.num_experts=8",
    "model.moe.num_experts_per_tok=2", "model.moe.moe_intermediate_size=256",
]
MOE_STRATEGIES = ("ddp", "zero3", "fsdp")
# state_bytes key -> MemoryEstimate fields it is compared with
COMPARED = {
    "params": ("params_bytes", "persistent_bytes"),  # zero3's persistent parameters: kept whole
    "grads": ("grads_bytes",),
    "optim": ("optimizer_bytes", "engine_master_bytes"),  # DeepSpeed counts its fp32 master copy under optim
    "unsharded_grads": ("unsharded_grads_bytes",),  # fsdp only
}


def overrides(strategy: str, precision: str, defer: bool = False, persistence: bool = False,
              moe: bool = False) -> list[str]:
    """MODEL as `strategy` runs it; `persistence`: at DeepSpeed's default stage3_param_persistence_threshold;
    `moe`: with MOE's mixture of experts."""
    model = [o for o in MODEL if not persistence or "persistence_threshold" not in o] + (MOE if moe else [])
    return model + [f"strategy.name={strategy}", f"train.precision={precision}",
                    f"strategy.fsdp_defer_grad_reduce={str(defer).lower()}"]


def measure_states(cfg, rank: int, world: int, local_rank: int, device) -> dict[str, int]:
    """One full optimizer step of `cfg`'s strategy (AdamW's state exists only after it), then the next
    step's micro batches, calling state_bytes() after each backward. Returns the per-key peak over those
    calls: ZeRO-1 holds its full gradients and FSDP its unsharded ones between micro batches, the sharded
    ones after the last."""

    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy

    accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * world)
    torch.manual_seed(0)
    strategy = make_strategy(cfg.strategy.name)
    strategy.setup(build_model(cfg.model, device="meta"), RunContext(cfg, rank, world, local_rank, device, accum))
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.block_size))
    peak: dict[str, int] = {}
    for step in range(2):
        for i in range(accum):
            with strategy.micro_step(is_last=i == accum - 1):
                with strategy.autocast():
                    loss = strategy.model(x, x)
                strategy.backward(loss)
            if step == 1:
                for key, value in strategy.state_bytes().items():
                    peak[key] = max(peak.get(key, 0), value)
        strategy.step(1e-3)
    return peak


def measure_worker(runs: list[list[str]]) -> list[dict]:
    """On every rank, per (strategy, precision, defer[, persistence, moe]): measure_states of its config."""
    from zerodp.distributed.process_group import init_distributed

    env = init_distributed("cpu")
    return [measure_states(load_config(None, overrides(name, precision, defer, *rest)), env.rank,
                           env.world_size, env.local_rank, env.device)
            for name, precision, defer, *rest in runs]


def predictions(strategy: str, precision: str, defer: bool, persistence: bool = False, moe: bool = False):
    """The planner's row for `strategy`, through the same entry point as `strategy: auto`."""
    from zerodp.planner import plan_for_training

    cfg = load_config(None, overrides(strategy, precision, defer, persistence, moe))
    plan = plan_for_training(cfg, WORLD, 64 * 2**30, "cpu")
    return next(e for e in plan.estimates if e.strategy == strategy)


def test_state_bytes_match_the_planner_within_5_percent():
    from zerodp.models import param_count
    from zerodp.planner import spec_from_model_config

    cfg = load_config(None, overrides("ddp", "bf16"))
    P = param_count(cfg.model)
    assert spec_from_model_config(cfg.model).params == P
    moe = load_config(None, overrides("ddp", "bf16", moe=True))
    assert spec_from_model_config(moe.model).params == param_count(moe.model)
    assert spec_from_model_config(moe.model).active_params < 0.6 * param_count(moe.model)  # 2 of 8 experts
    # + fsdp deferring its reduce-scatter to the last micro batch: 4P of unsharded fp32 gradients; + a
    # mixture of experts (every expert held, whatever the routing) in the same world
    runs = [(s, p, False) for p in PRECISIONS for s in STRATEGIES] + [("fsdp", "bf16", True)] \
        + [(s, "bf16", False, False, True) for s in MOE_STRATEGIES]
    measured = run_distributed("tests.distributed.test_planner_validation:measure_worker", WORLD, {"runs": runs})

    lines = [f"P = {P:,} parameters, world {WORLD}; bytes per rank (rank 0 / rank 1) vs planner "
             f"(* = strategy.fsdp_defer_grad_reduce)",
             f"{'strategy':<10}{'prec':<6}{'state':<16}{'rank 0':>12}{'rank 1':>12}{'planner':>12}{'x P':>7}"
             f"{'error':>8}"]
    failures = []
    for r, (strategy, precision, defer, *rest) in enumerate(runs):
        e = predictions(strategy, precision, defer, *rest)
        precision += "*" if defer else ""
        strategy += "/moe" if rest else ""
        for key, fields in COMPARED.items():
            predicted = sum(getattr(e, f) for f in fields)
            got = [m[r].get(key) for m in measured]
            if not got[0] and predicted == 0:
                continue  # a state this engine does not have, and the planner agrees
            error = max(abs(g - predicted) for g in got) / max(predicted, 1)
            lines.append(f"{strategy:<10}{precision:<6}{key:<16}{got[0]:>12,}{got[1]:>12,}{predicted:>12,}"
                         f"{predicted / P:>7.2f}{error:>8.2%}")
            if error > TOLERANCE:
                failures.append(f"{strategy} {precision} {key}: measured {got}, planner {predicted}")
        if strategy.startswith("zero"):  # shown, not asserted: buckets exist only during backward
            lines.append(f"{strategy:<10}{precision:<6}{'buckets (info)':<16}{measured[0][r]['buckets']:>12,}"
                         f"{measured[1][r]['buckets']:>12,}{e.bucket_bytes:>12,}")
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures)


def test_zero3_persistent_parameters_are_predicted_within_3_percent():
    """Issue 38 item 9: at DeepSpeed's default stage3_param_persistence_threshold (1e5 elements) every
    parameter at most that size stays gathered, whole, beside its partition; the planner predicted the
    partitions alone (a tiny model: 1.607 MiB predicted, 4.821 MiB measured, +200%). Here the embeddings,
    attention output projections, biases and norms (171,008 of the 1,612,800 elements) persist: the
    partitions alone are 17% under what the engine holds."""
    runs = [("zero3", p, False, True) for p in PRECISIONS]
    measured = run_distributed("tests.distributed.test_planner_validation:measure_worker", WORLD, {"runs": runs})
    for r, (_, precision, _, _) in enumerate(runs):
        e = predictions("zero3", precision, False, persistence=True)
        predicted = e.params_bytes + e.persistent_bytes
        assert e.persistent_bytes > 0.15 * e.params_bytes  # what the partitions alone leave out
        got = [m[r]["params"] for m in measured]
        print(f"\nzero3 {precision} params at the default persistence threshold: measured {got}, planner {predicted}")
        assert all(abs(g - predicted) <= 0.03 * predicted for g in got), (precision, got, predicted)


def offload_worker(runs: list[list[str]]) -> list[dict]:
    """On every rank, per list of overrides (on MODEL): measure_states of that config."""
    from zerodp.distributed.process_group import init_distributed

    env = init_distributed("cpu")
    return [measure_states(load_config(None, MODEL + extra), env.rank, env.world_size, env.local_rank, env.device)
            for extra in runs]


def test_offloaded_states_match_the_planner_host_with_host():
    """Under strategy.offload_optimizer (and zero3's offload_params) state_bytes puts what DeepSpeed keeps in
    host memory under "offloaded", beside the planner's offloaded_bytes, and what stays on the device under
    params, grads and optim, beside the planner's device figures: each within 5%. Before, the host's states
    were counted as the device's (zero2 fp32: optimizer state predicted 0, measured 4.821 MiB)."""
    from zerodp.planner.training import estimate_for_run

    runs = [["strategy.name=zero2", "train.precision=bf16", "strategy.offload_optimizer=true"],
            ["strategy.name=zero3", "train.precision=fp32", "strategy.offload_optimizer=true",
             "strategy.offload_params=true"]]
    measured = run_distributed("tests.distributed.test_planner_validation:offload_worker", WORLD, {"runs": runs})
    failures = []
    for r, extra in enumerate(runs):
        e = estimate_for_run(load_config(None, MODEL + extra), WORLD, 64 * 2**30, "cpu")
        planned = {"offloaded": e.offloaded_bytes, "params": e.params_bytes + e.persistent_bytes,
                   "grads": e.grads_bytes, "optim": e.optimizer_bytes + e.engine_master_bytes}
        for key, predicted in planned.items():
            got = [m[r][key] for m in measured]
            print(f"{' '.join(extra)} {key}: measured {got}, planner {predicted:,}")
            if any(abs(g - predicted) > TOLERANCE * max(predicted, 2**20) for g in got):
                failures.append(f"{extra} {key}: measured {got}, planner {predicted}")
    assert not failures, "\n".join(failures)


def reference_worker(runs: list[list[str]]) -> list[dict]:
    """On every rank, per (strategy, precision): the live DPO reference's state_bytes() (zerodp.trainer.objective's
    frozen copy, set up as a DPO run sets it up) after one of its forwards, summed over every key."""
    from types import SimpleNamespace

    from zerodp.distributed.process_group import init_distributed
    from zerodp.trainer.objective import _frozen_copy

    env = init_distributed("cpu")
    out = []
    for name, precision in runs:
        cfg = load_config(None, overrides(name, precision))
        accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * env.world_size)
        reference = _frozen_copy(cfg, SimpleNamespace(rank=env.rank, world_size=env.world_size,
                                                      local_rank=env.local_rank, device=env.device,
                                                      local_world_size=env.world_size), accum)
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.block_size))
        with torch.no_grad(), reference.autocast():
            reference.model(x, None)
        out.append({k: v for k, v in reference.state_bytes().items() if isinstance(v, int)})
    return out


def test_a_live_dpo_reference_holds_what_the_planner_says_within_5_percent():
    """dpo.reference=live's frozen copy, set up as a DPO run sets it up and run forward once, per strategy and
    precision: each of its state_bytes() keys against zerodp.planner.preference.reference_states (DeepSpeed's
    optimizer keeps an fp32 master partition, 'optim', for a model it never steps). ddp's reducer buckets
    (4P, predicted) are not tensors state_bytes() reaches."""
    import dataclasses

    from zerodp.planner import estimate, spec_from_model_config
    from zerodp.planner.preference import reference_states
    from zerodp.planner.training import _cluster, _layout, workload_from_config

    runs = [(s, p) for p in PRECISIONS for s in STRATEGIES]
    measured = run_distributed("tests.distributed.test_planner_validation:reference_worker", WORLD, {"runs": runs})
    keys = {"params": "params", "optim": "master", "grads": "grads", "buckets": "buckets"}
    lines, failures = [f"{'strategy':<10}{'prec':<6}{'state':<10}{'rank 0':>12}{'rank 1':>12}{'planner':>12}"], []
    for r, (strategy, precision) in enumerate(runs):
        cfg = load_config(None, overrides(strategy, precision))
        layout = _layout(cfg, _cluster(WORLD, 64 * 2**30, "cpu", None)[0], workload_from_config(cfg, WORLD))
        layout = dataclasses.replace(layout, workload=dataclasses.replace(layout.workload, objective="dpo",
                                                                          dpo_reference="live"))
        model = spec_from_model_config(cfg.model)
        predicted = reference_states(model, layout, "live")
        assert estimate(model, layout).reference_bytes == sum(predicted.values())
        for key, planned in keys.items():
            got = [m[r].get(key, 0) for m in measured]
            if key not in measured[0][r] and strategy == "ddp" and key == "buckets":
                continue  # the reducer's, not reached by state_bytes
            if not got[0] and predicted[planned] == 0:
                continue
            lines.append(f"{strategy:<10}{precision:<6}{key:<10}{got[0]:>12,}{got[1]:>12,}{predicted[planned]:>12,}")
            if max(abs(g - predicted[planned]) for g in got) > TOLERANCE * max(predicted[planned], 1):
                failures.append(f"{strategy} {precision} {key}: measured {got}, planner {predicted[planned]}")
    print("\n" + "\n".join(lines))
    assert not failures, "\n".join(failures)
