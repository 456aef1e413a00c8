"""train.compile=true: every strategy at world 2, each transformer block compiled by torch.compile
(inductor: C++ kernels on the CPU), follows the single-process eager trajectory.

Compiled kernels fuse elementwise work and reorder reductions, so the numbers are not bit-equal to eager;
COMPILE_TOLERANCE is what they need on this model (measured: see docs/architecture.md, "Compilation")."""

from __future__ import annotations

from tests.support.harness import run_distributed
from tests.support.reference import reference_run
from zerodp.config import load_config
from zerodp.strategies.catalog import CATALOG

STRATEGIES = [name for name, s in CATALOG.items() if not s.single_process]
MICRO, WORLD, STEPS = 2, 2, 3
COMPILE_TOLERANCE = 1e-5
VARIANTS = {"zero3": ["model.loss_chunks=3", "model.activation_checkpointing=selective"],
            "fsdp": ["model.loss_chunks=3", "model.activation_checkpointing=selective"]}
"""The sharded strategies' rows also run the chunked loss and selective checkpointing around the compiled
blocks."""


def test_compiled_blocks_follow_the_eager_single_process_trajectory(tiny, tmp_path):
    over = tiny + [f"train.global_batch_size={MICRO * WORLD}", f"train.micro_batch_size={MICRO}",
                   f"train.max_steps={STEPS}", "optim.lr=1e-3", "optim.min_lr=1e-4"]
    ref_losses, ref_weights = reference_run(load_config(None, over))
    runs = [{"overrides": over + [f"strategy.name={name}", "train.compile=true", *VARIANTS.get(name, []),
                                  f"train.out_dir={tmp_path / name}"]} for name in STRATEGIES]
    results = run_distributed("tests.support.workers:train_runs", WORLD, {"runs": runs}, timeout=900)[0]
    report, failures = [], []
    for name, got in zip(STRATEGIES, results):
        assert got["strategy"] == name and got["weights"].keys() == ref_weights.keys()
        loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref_losses))
        weight_diff = max((got["weights"][k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        report.append(f"compiled {name:6s} world={WORLD}: max |loss diff| {loss_diff:.2e}, "
                      f"max |param diff| {weight_diff:.2e}")
        if loss_diff >= COMPILE_TOLERANCE or weight_diff >= COMPILE_TOLERANCE:
            failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "\n".join(failures)
