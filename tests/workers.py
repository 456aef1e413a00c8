"""Functions run on every rank by tests.harness.run_distributed."""

from __future__ import annotations

from zerodp.config import load_config
from zerodp.train import train


def train_runs(runs: list[dict]) -> list[dict]:
    """Train several configs in turn in one process group: [{"overrides": [...], "fresh": bool}]."""
    results = []
    for run in runs:
        cfg = load_config(run.get("config"), run["overrides"])
        summary = train(cfg, fresh=run.get("fresh", True), return_weights=True)
        results.append({"losses": [summary["losses"][k] for k in sorted(summary["losses"])],
                        "weights": summary["weights"], "state_bytes": summary["state_bytes"],
                        "strategy": summary["strategy"]})
    return results
