"""benchmarks/gpu_checks.py: on a machine without a GPU it says so and exits 0; its verdicts (one line a
check, exit 1 on any failure) are pure functions, checked here. The checks themselves need GPUs."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.gpu_checks import GIB, Result, exit_code, same_losses, summary, within
from tests.support.harness import ROOT, base_env


def test_without_a_gpu_it_says_so_and_exits_0():
    r = subprocess.run([sys.executable, "benchmarks/gpu_checks.py"], cwd=ROOT, env=base_env(1),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["gpu_checks: no usable GPU on this machine (CUDA_VISIBLE_DEVICES, a CPU "
                                     "build of torch or no driver): nothing to check"], r.stdout


def test_one_line_per_check_and_exit_1_on_any_failure():
    passed, failed = Result("resume fsdp bf16", True, "2 losses bit-identical"), Result("memory zero3", False, "x")
    assert passed.line() == "PASS resume fsdp bf16: 2 losses bit-identical"
    assert failed.line() == "FAIL memory zero3: x"
    assert exit_code([passed, passed]) == 0
    assert exit_code([passed, failed, passed]) == 1
    assert exit_code([]) == 1, "no check ran: not a pass"
    assert summary([passed, failed, passed]) == "gpu_checks: 2 passed, 1 failed"


def test_losses_compare_bit_for_bit_or_within_a_tolerance():
    assert same_losses("c", [1.0, 2.0], [1.0, 2.0]).line() == "PASS c: 2 losses bit-identical"
    off = same_losses("c", [1.0, 2.0 + 1e-7], [1.0, 2.0])
    assert not off.ok and off.detail.startswith("loss 1 is 2.0000001, expected 2.0"), off.detail
    assert same_losses("c", [1.0, 2.0 + 1e-7], [1.0, 2.0], 1e-4).ok
    assert not same_losses("c", [1.0, 2.1], [1.0, 2.0], 1e-4).ok
    assert not same_losses("c", [float("nan")], [float("nan")], 1e-4).ok, "NaN never matches"
    short = same_losses("c", [1.0], [1.0, 2.0])
    assert not short.ok and short.detail == "1 losses against 2"


def test_memory_figures_pass_only_within_their_limits():
    ok = within("memory fsdp bf16", [("after setup", 1 * GIB, 2 * GIB), ("sample", 2 * GIB, 2 * GIB)])
    assert ok.line() == "PASS memory fsdp bf16: after setup 1.00 GiB <= 2.00 GiB; sample 2.00 GiB <= 2.00 GiB"
    over = within("memory zero3 bf16", [("after setup", 1 * GIB, 2 * GIB), ("training", 3 * GIB, 2.5 * GIB)])
    assert not over.ok and over.detail.endswith("training 3.00 GiB > 2.50 GiB")


# ---- the new verdicts, the check list, and one group end to end on 2 CPU processes --------------------

def test_bf16_bands_are_read_from_the_strategies_doc():
    from benchmarks.gpu.verdicts import band_between, bf16_bands

    bands = bf16_bands((ROOT / "docs" / "strategies.md").read_text())
    # the 'tested <' bounds of the precision table's row, per column (ddp / single, zero1/2/3, fsdp)
    assert bands == {"ddp": 0.001, "single": 0.001, "zero1": 0.01, "zero2": 0.01, "zero3": 0.01, "fsdp": 0.03}
    assert band_between("zero2", "ddp", bands) == 0.011
    table = ("| | a / b | z1/2 |\n|---|---|---|\n"
             "| bf16 band vs fp32 reference (8 steps) | < 0.5 | < 0.1 (tested < 0.2) |")
    assert bf16_bands(table) == {"a": 0.5, "b": 0.5, "z1": 0.2, "z2": 0.2}


def test_host_syncs_allow_one_per_sync_point_and_none_between():
    from benchmarks.gpu.verdicts import host_syncs

    ok = host_syncs("s", {10: 1, 15: 1, 20: 1, 3: 7, 21: 9}, 5, 6, 20)  # steps 3 and 21 are outside 6-20
    assert ok.line() == "PASS s: 3 over steps 6-20 (0.20 per step, limit 1/5 = 0.20)"
    assert host_syncs("s", {}, 5, 6, 20).ok
    between = host_syncs("s", {7: 2, 10: 1}, 5, 6, 20, {7: "zero.py:12"})
    assert not between.ok and between.detail.endswith("step 7, not a sync point, synced 2 times at zero.py:12")
    twice = host_syncs("s", {10: 2, 15: 1, 20: 1}, 5, 6, 20)
    assert not twice.ok and twice.detail.endswith("more than one per sync point"), twice.detail


def test_evaluation_needs_its_steps_finite_losses_and_unchanged_training():
    from benchmarks.gpu.verdicts import evaluation

    records = [{"step": s, **({"val_loss": 2.0 + s} if s in (4, 8) else {})} for s in range(1, 9)]
    assert evaluation("e", records, 4, 8, [1.0, 2.0], [1.0, 2.0]).ok
    assert "expected [4, 8]" in evaluation("e", records[:5], 4, 8, [1.0], [1.0]).detail
    nan = [dict(r, val_loss=float("nan")) if "val_loss" in r else r for r in records]
    assert not evaluation("e", nan, 4, 8, [1.0], [1.0]).ok
    changed = evaluation("e", records, 4, 8, [1.0, 2.5], [1.0, 2.0])
    assert not changed.ok and changed.detail.startswith("training changed by evaluation")


def test_hsdp_groups_and_throughput_lines():
    from benchmarks.gpu.verdicts import hsdp_group, throughput

    assert [hsdp_group(w) for w in (1, 2, 3, 4, 6, 8)] == [1, 1, 1, 2, 3, 4]
    got = {"tokens_per_s_per_device": 12345.6, "mfu": 0.412, "step_s": 0.6634, "peak": "20.1 GiB"}
    assert throughput("t", got, True, "p").line() == ("PASS t: 12,346 tokens/s per GPU, MFU 41.2%, step 0.663 s, "
                                                      "peak 20.1 GiB (planned: p)")
    assert not throughput("t", {"error": "OOM"}, True, "p").ok
    skipped = throughput("t", {}, False, "p")
    assert skipped.ok and skipped.detail.startswith("skipped")


def test_the_check_list_prints_without_a_gpu_and_fits_the_budget():
    from benchmarks.gpu.checklist import CHECKS, fits, select

    r = subprocess.run([sys.executable, "benchmarks/gpu_checks.py", "--list"], cwd=ROOT, env=base_env(1),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    names = [c.name for c in CHECKS]
    assert [line.split()[0] for line in lines[:-1]] == names == [
        "compile", "throughput", "resume", "fp16", "offload", "save", "compiled", "features", "equivalence",
        "precision", "hsdp"]
    assert lines[0].split()[:5] == ["compile", "1+", "GPU", "~", "60"]
    one = sum(c.seconds for c in CHECKS if c.gpus == 1)
    assert lines[-1].startswith(f"total on one H200: ~{one} s")
    # 8 minutes of a rental: every one-GPU group but the last (features, 10/10 on the first GPU run) fits
    used, ran = 0, []
    for c in select(None, 1, False):
        if fits(c, used, 480):
            used, ran = used + c.seconds, ran + [c.name]
    assert ran == names[:7], ran
    assert [c.name for c in select(None, 1, False)] == names[:8]
    assert [c.name for c in select("hsdp,save", 1, True)] == ["save", "hsdp"]  # the CPU mode counts as 2
    assert [c.name for c in select("compile,fp16,compiled", 8, True)] == []  # they need CUDA itself
    bad = subprocess.run([sys.executable, "benchmarks/gpu_checks.py", "--only", "nope"], cwd=ROOT, env=base_env(1),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("gpu_checks: no check named nope;"), bad.stderr


def test_a_row_this_zerodp_lacks_is_skipped_and_memory_is_judged_against_the_plan():
    from benchmarks.gpu.one_gpu import accepted, memory_beside_plan
    from benchmarks.gpu.verdicts import exit_code, summary

    assert accepted(["model.n_layer=2"]) is None
    assert "model.no_such_key" in accepted(["model.no_such_key=8"])
    skipped = Result("throughput x", True, "not in this zerodp: ...", skip=True)
    assert skipped.line() == "SKIP throughput x: not in this zerodp: ..."
    ok = Result("a", True, "")
    assert exit_code([ok, skipped]) == 0 and exit_code([skipped]) == 1, "skipped is not a pass"
    assert summary([ok, skipped]) == "gpu_checks: 1 passed, 0 failed, 1 skipped"
    near = memory_beside_plan("m", 47 * GIB, 44 * GIB)
    assert near.ok and near.line() == "PASS m: allocator peak 47.00 GiB, planned 44.00 GiB (+6.8%; band 10%)"
    assert not memory_beside_plan("m", int(43.8 * GIB), int(36.5 * GIB)).ok


def test_the_cpu_mode_runs_groups_one_after_another_within_a_budget(tmp_path):
    """The CPU mode: the groups' code (launch, worker, verdicts) on 2 gloo processes with tiny shapes; each
    group's estimate printed before it, a group past the budget skipped with a line, the lines as JSON."""
    import json

    out = tmp_path / "checks.json"
    r = subprocess.run([sys.executable, "benchmarks/gpu_checks.py", "--device", "cpu", "--tiny", "--only",
                        "offload,save,hsdp", "--budget", "90", "--json", str(out)], cwd=ROOT, env=base_env(1),
                       capture_output=True, text=True, timeout=900)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert lines[0] == "gpu_checks: 2 CPU processes (tiny shapes): offload, save, hsdp; budget 90 s"
    assert lines[1].startswith("gpu_checks: disk: each run's folder under ")
    assert lines[2] == "SKIP offload: ~95 s on one H200 would pass the budget of 90 s (0 s used)", lines[2]
    assert lines[3].startswith("gpu_checks: group save (~70 s on one H200): ")
    assert lines[4].startswith("PASS save llama-1b ddp fp32 (world 2): background save held the loop "), lines[4]
    assert lines[5].startswith("gpu_checks: group save took ")
    assert lines[6].startswith("gpu_checks: group hsdp (~25 s on one H200): ")
    assert lines[7].startswith("PASS hsdp fsdp (world 2, 2 replicas of 1): 8 losses max |diff|")
    assert lines[-1].startswith("gpu_checks: 2 passed, 0 failed, 1 skipped in ")
    got = json.loads(out.read_text())
    assert [(x["group"], x["status"]) for x in got["results"]] == [("offload", "SKIP"), ("save", "PASS"),
                                                                    ("hsdp", "PASS")]
    assert [g["group"] for g in got["groups"]] == ["save", "hsdp"] and got["summary"] == lines[-1]
    again = subprocess.run([sys.executable, "benchmarks/gpu_checks.py", "--device", "cpu", "--tiny", "--json",
                            str(out)], cwd=ROOT, env=base_env(1), capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr == f"gpu_checks: {out} exists; pass a new --json path\n"
