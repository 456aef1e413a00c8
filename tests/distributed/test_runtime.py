"""The runtime on real process groups: subgroups keep the run's timeout; every strategy's step returns
its figures on the device the loop stacks them on."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.harness import ROOT, run_distributed


def test_hsdp_and_hpz_subgroups_get_the_runs_timeout():
    # The harness's default group has init_distributed's 600 s; a subgroup made without a timeout gets
    # gloo's default, 30 minutes (what HSDP's mesh and hpZ's groups had).
    results = run_distributed("tests.support.runtime_workers:subgroup_timeouts", 4, {"timeout_s": 123})
    for r in results:
        assert r["world"] == 600 and r["plain_new_group"] == 1800, r
        assert (r["replicate"], r["shard"], r["shard_size"]) == (123, 123, 2), r
        assert (r["hpz"], r["hpz_size"]) == (600, 2), r


FAKE_SRUN = """#!/usr/bin/env bash
echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-unset} $*" > "$SRUN_SAW"
"""


@pytest.mark.parametrize("given, expected", [({"SLURM_CPUS_PER_TASK": "32"}, "32"),
                                             ({"SLURM_CPUS_PER_TASK": "32", "SRUN_CPUS_PER_TASK": "8"}, "8"),
                                             ({}, "unset")])
def test_slurm_script_hands_the_tasks_cpus_to_srun(tmp_path, given, expected):
    # Slurm is not installed here: srun and scontrol are stand-ins on PATH; the script itself runs in bash
    # with the variables sbatch sets. srun must see the job's CPUs per task (Slurm >= 22.05 no longer
    # passes --cpus-per-task to it), and a value the user exported for srun is kept.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    # one line per write, as scontrol prints a long node list: the script must read it whole (pipefail)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nfor n in $(seq 1 20000); do echo node$n; done\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SRUN_SAW=str(tmp_path / "saw"), SLURM_JOB_NODELIST="node[1-2]",
               SLURM_NNODES="2", SLURM_JOB_ID="7", SLURM_GPUS_PER_NODE="8", **given)
    r = subprocess.run(["bash", "launchers/slurm.sbatch", "configs/gpt2-124m.yaml"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    saw = (tmp_path / "saw").read_text()
    assert saw.startswith(f"SRUN_CPUS_PER_TASK={expected} python -m zerodp.distributed.launcher --nnodes 2 "), saw
    assert "--rdzv-endpoint node1:29400" in saw, saw


def test_every_strategys_step_returns_its_figures_on_the_declared_device(tiny):
    # What the loop stacks at a sync point (zerodp.telemetry.step_metrics.fetch_interval): the loss, the
    # grad norm and the local gradient norm, 0-d tensors on strategy.ctx.device (DeepSpeed's ZeRO optimizer
    # keeps its norm a tensor too; a float only after a skipped step). fsdp with offload keeps its gradient
    # shards in host memory: on a GPU its norm was a CPU tensor beside the loss on the device, and
    # torch.stack failed at the first sync point.
    common = tiny + ["train.grad_noise_scale=true", "train.precision=fp32"]
    strategies = [["strategy.name=ddp"], ["strategy.name=zero1"], ["strategy.name=zero2"], ["strategy.name=zero3"],
                  ["strategy.name=fsdp"], ["strategy.name=fsdp", "strategy.offload_optimizer=true"],
                  ["strategy.name=fsdp", "strategy.offload_params=true", "strategy.reshard_after_forward=false"]]
    results = run_distributed("tests.support.runtime_workers:step_output_devices", 2,
                              {"runs": [common + s for s in strategies]})
    for rank in results:
        for s, r in zip(strategies, rank):
            what = f"{' '.join(s)}: {r}"
            assert r["loss"] == r["declared"] == "cpu", what
            assert r["grad_norm"] in (r["declared"], "float"), what
            assert r["local_sq"] == r["declared"], what  # every strategy measures it at 2 ranks, 3 micro batches
            assert all(shape == () for shape in r["shapes"]), what
            assert all(v == v and v > 0 for v in r["stacked"]), what  # finite, positive: real figures
    assert [r["grad_norm"] for r in results[0]] == ["cpu"] * len(strategies)
    alone = run_distributed("tests.support.runtime_workers:step_output_devices", 1,
                            {"runs": [common + ["strategy.name=single"]]})[0][0]
    assert alone["loss"] == alone["grad_norm"] == alone["declared"] == "cpu", alone
    assert alone["local_sq"] in ("cpu", "None"), alone  # measured only where the micro batch is smaller


def test_a_run_reports_its_start_up_and_training_peaks(tiny, tmp_path):
    overrides = tiny + ["strategy.name=single", "train.max_steps=2", f"train.out_dir={tmp_path}"]
    r = run_distributed("tests.support.runtime_workers:train_memory", 1, {"overrides": overrides}, fresh=True)[0]
    m = r["memory"]
    assert m["measure"] == "peak_rss", m  # a CPU: no allocator peak; the process's peak RSS, reset after start-up
    assert 50 * 2**20 < m["startup_peak_bytes"] < 8 * 2**30 and 50 * 2**20 < m["train_peak_bytes"] < 8 * 2**30, m
    assert "peak_allocated_bytes" not in r["planned"], r  # set against the plan on CUDA only
