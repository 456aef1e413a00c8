"""The planner's head, loss and checkpointing modes (zerodp/planner/activations.py), pinned on the Llama 3.2 1B
shape at micro batch 4 x 2048 in bf16 on one H200, where the first GPU run measured the same module in a
hand-written loop (autocast, fused AdamW, the whole logits): 47.1 GB (43.8 GiB) at the allocator's peak
eager (issue 39). The planner's peak for that run (its total less the CUDA context, which the allocator
does not see) is within 10% of it; the chunked loss, selective and full checkpointing each take their
share off, and the search chooses among them."""

from __future__ import annotations

import pytest

from zerodp.planner.activations import Checkpointing, head_loss_bytes
from zerodp.planner.choose import choose
from zerodp.planner.hardware import Cluster, gpu_preset
from zerodp.planner.memory import Layout, Workload, estimate
from zerodp.planner.models import preset

MEASURED_EAGER = 47.1e9  # single, whole logits, eager: torch.cuda.max_memory_allocated on one H200
GB = 1e9


def peak(strategy: str, chunks, mode: str) -> float:
    m, c = preset("llama3.2-1b"), Cluster(gpu=gpu_preset("h200"))
    e = estimate(m, Layout(strategy, c, Workload(4, 2048, "bf16", loss_chunks=chunks), activation_checkpointing=mode))
    return (e.total_bytes - e.overhead_bytes) / GB


def test_the_1b_peak_with_the_whole_logits_is_within_10_percent_of_the_measured_one():
    assert abs(peak("single", 0, "off") * GB / MEASURED_EAGER - 1) < 0.10
    assert peak("single", 0, "off") == pytest.approx(47.36, abs=0.01)


@pytest.mark.parametrize("strategy,rows", [
    #            whole: off, selective, full      chunked (auto: 16 chunks): off, selective, full
    ("single", ((47.36, 38.78, 32.07), (36.92, 28.35, 21.63))),
    ("fsdp", ((47.15, 40.55, 33.84), (36.15, 29.55, 22.84))),
    ("zero3", ((49.62, 43.02, 36.31), (38.62, 32.02, 25.31))),
])
def test_the_1b_rows(strategy, rows):
    for chunks, row in zip((0, "auto"), rows):
        got = tuple(round(peak(strategy, chunks, mode), 2) for mode in ("off", "selective", "full"))
        assert got == row, (strategy, chunks, got)
    # the chunked loss takes the logits' 12 bytes each (1.05e9 of them) off the peak: the issue's goal is 5 GB
    assert rows[0][0] - rows[1][0] > 10


def test_head_and_loss_bytes():
    m = preset("llama3.2-1b")
    tokens, V, h = 4 * 2048, 128256, 2048
    assert head_loss_bytes(m, tokens, "bf16", 0) == 12 * tokens * V
    # 16 chunks of 512 tokens: a chunk's bf16 logits, fp32 copy and bf16 gradient; under autocast the weight
    # cast to bf16; its fp32 gradient; the hidden states' gradient (fp32 under autocast, else bf16)
    assert head_loss_bytes(m, tokens, "bf16", "auto", autocast=True) == 512 * V * 8 + V * h * 6 + tokens * h * 4
    assert head_loss_bytes(m, tokens, "bf16", 4) == 2048 * V * 8 + V * h * 4 + tokens * h * 2
    # in fp32 the chunk's logits, their fp32 form and their gradient are one tensor
    assert head_loss_bytes(m, tokens, "fp32", 8) == 1024 * V * 4 + V * h * 4 + tokens * h * 4


def test_the_step_time_of_each_mode():
    m, c = preset("llama3.2-1b"), Cluster(gpu=gpu_preset("h200"))
    steps = {mode: estimate(m, Layout("single", c, Workload(4, 2048, "bf16"), activation_checkpointing=mode)).step_s
             for mode in ("off", "selective", "full")}
    assert steps["full"] / steps["off"] == pytest.approx(4 / 3)
    assert steps["selective"] / steps["off"] == pytest.approx(1 + 0.1 / 3)


def test_the_search_chooses_the_mode_with_the_micro_batch():
    """With a global batch the search tries every micro batch under off, selective and full; at equal
    predicted speed the least recomputation and the largest micro batch win, and the sentence names the
    micro batch each other mode allows."""
    m, c = preset("llama3.2-1b"), Cluster(gpu=gpu_preset("h200"))
    plan = choose(m, c, Workload(1, 2048, "bf16", loss_chunks=0), global_batch=64)
    modes = {e.activation_checkpointing for e in plan.search["single"]}
    assert modes == {"off", "selective", "full"}
    assert plan.choice == "single" and plan.activation_checkpointing == "off" and plan.micro_batch == 8
    sentence = next(r for r in plan.reasons if r.startswith("Micro batch"))
    assert "; checkpointing off; selective: micro batch 16 at most" in sentence
    assert "; full: micro batch 16 at most" in sentence  # the whole logits, 12 bytes each, fill the GPU
    assert Checkpointing(True) == "full" and not Checkpointing(False) and Checkpointing("selective").rank == 1


def test_plan_flags_for_the_loss_and_the_modes():
    """`zerodp plan --loss-chunks N|auto` and `--activation-checkpointing off|selective|full|on`; a bad value is
    one line."""
    from tests.unit.test_planner import parse
    from zerodp.errors import UserError
    from zerodp.planner.cli import build

    base = ["--model", "llama3.2-1b", "--gpu", "h200", "--micro-batch", "4", "--seq-len", "2048"]
    whole = build(parse(*base, "--loss-chunks", "0", "--activation-checkpointing", "selective"))
    assert whole.workload.loss_chunks == 0 and whole.activation_checkpointing == "selective"
    assert "activation checkpointing: selective, loss: whole logits\n" in whole.table()
    on = build(parse(*base, "--activation-checkpointing", "on"))
    assert on.workload.loss_chunks == "auto" and on.activation_checkpointing == "full"
    with pytest.raises(UserError, match=r"^--loss-chunks 'many' must be 0 \(the whole logits\), a number of chunks "
                                        r"or auto$"):
        build(parse(*base, "--loss-chunks", "many"))
