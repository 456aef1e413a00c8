"""The DeepSpeed config zerodp generates for ZeRO (buckets per stage, gradient dtypes, timers off) and the
planner's bytes for the same buckets and gradients: one rule (zerodp.planner.buckets), pinned on both sides."""

from __future__ import annotations

import pytest

from tests.conftest import TINY
from zerodp.config import load_config
from zerodp.errors import UserError
from zerodp.planner.buckets import bucket_bytes
from zerodp.planner.hardware import Cluster, gpu_from_device_name
from zerodp.planner.memory import Layout, Workload, estimate
from zerodp.planner.models import spec_from_model_config
from zerodp.planner.traffic import collectives
from zerodp.strategies.deepspeed_config import deepspeed_config

LLAMA_1B = ["model.arch=llama", "model.n_layer=16", "model.n_embd=2048", "model.n_head=32", "model.n_kv_head=8",
            "model.vocab_size=128256", "model.block_size=1024", "model.intermediate_size=8192"]


def zero_section(over: list[str], stage: int) -> dict:
    return deepspeed_config(load_config(None, over), stage, grad_accum_steps=4, world_size=8)


def test_buckets_follow_deepspeed_per_stage():
    # zero1/2: DeepSpeed's default 5e8 elements (runtime/zero/config.py), for a 1.2B model under it
    for stage in (1, 2):
        z = zero_section(LLAMA_1B, stage)["zero_optimization"]
        assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 500_000_000, z
    # zero3: hidden^2 and 0.9 hidden^2, DeepSpeed's autotuner for stage 3 (autotuning/autotuner.py)
    z = zero_section(LLAMA_1B, 3)["zero_optimization"]
    largest = 128256 * 2048  # the embedding: ZeRO-3's reduce bucket is at least the largest parameter
    assert z["reduce_bucket_size"] == max(2048**2, largest) and z["stage3_prefetch_bucket_size"] == int(0.9 * 2048**2)
    assert "allgather_bucket_size" not in z and "stage3_param_persistence_threshold" not in z
    # a model smaller than 5e8 elements: the bucket is the model's size (even), never more
    z = zero_section(TINY, 2)["zero_optimization"]
    P = spec_from_model_config(load_config(None, TINY).model).params
    assert z["reduce_bucket_size"] == P + P % 2 < 500_000_000
    # strategy.bucket_size_mb set: MiB over the element size, every stage
    for stage in (1, 2, 3):
        z = zero_section(TINY + ["strategy.bucket_size_mb=4", "train.precision=bf16"], stage)["zero_optimization"]
        assert z["reduce_bucket_size"] == z["allgather_bucket_size"] == 4 * 2**20 // 2


def test_bf16_reduces_in_fp32_unless_asked_and_timers_are_off():
    for stage in (1, 2, 3):
        ds = zero_section(TINY + ["train.precision=bf16"], stage)
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
        assert ds["bf16"]["enabled"] is True and ds["bf16"]["check_grad_overflow"] is False
        assert ds["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
        assert ds["wall_clock_breakdown"] is False and ds["flops_profiler"] == {"enabled": False}
        fast = zero_section(TINY + ["train.precision=bf16", "strategy.grad_reduce_dtype=bf16"], stage)
        assert fast["data_types"] == {"grad_accum_dtype": "bf16"} and fast["communication_data_type"] == "bf16"
    for precision in ("fp32", "fp16"):  # nothing to choose in fp32; fp16 keeps DeepSpeed's loss-scaled path
        ds = zero_section(TINY + [f"train.precision={precision}"], 2)
        assert "data_types" not in ds and "communication_data_type" not in ds
    # the user may turn DeepSpeed's timers back on; the dtypes are zerodp's own key
    ds = zero_section(TINY + ["strategy.deepspeed.timers.throughput.enabled=true"], 1)
    assert ds["timers"]["throughput"]["enabled"] is True
    with pytest.raises(UserError, match=r"communication_data_type.*strategy\.grad_reduce_dtype"):
        zero_section(TINY + ["train.precision=bf16", "strategy.deepspeed.communication_data_type=bf16"], 2)


def test_grad_reduce_dtype_is_checked():
    from zerodp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"strategy\.grad_reduce_dtype='fp16' is not one of fp32 \| bf16"):
        load_config(None, TINY + ["strategy.grad_reduce_dtype=fp16"])


def _row(strategy: str, **workload) -> tuple:
    model = spec_from_model_config(load_config(None, LLAMA_1B).model)
    gpu, _ = gpu_from_device_name("NVIDIA H100 80GB HBM3", 80 * 2**30)
    layout = Layout(strategy, Cluster(gpu=gpu, gpus_per_node=8, nodes=1), Workload(4, 1024, "bf16", 4, **workload))
    return model, estimate(model, layout), collectives(model, layout)


def test_planner_buffers_and_traffic_follow_the_config():
    model, _, _ = _row("zero1")
    P, h, n, L = model.params, model.hidden, 8, model.largest_param
    # the buckets: zero1 as BF16_Optimizer (fp32 flat copies of at most 5e8), zero2 two bf16 buckets of
    # 5e8, zero3 one fp32 bucket of hidden^2; bf16 reduction: zero1/2 two buckets of 2 bytes, zero3 one
    expected = {("zero1", "fp32"): 4 * min(P, 500_000_000), ("zero2", "fp32"): 2 * 500_000_000 * 2,
                ("zero3", "fp32"): 4 * max(h * h, L), ("zero1", "bf16"): 2 * 500_000_000 * 2,
                ("zero2", "bf16"): 2 * 500_000_000 * 2, ("zero3", "bf16"): 2 * max(h * h, L)}
    for (strategy, dtype), nbytes in expected.items():
        _, row, parts = _row(strategy, grad_reduce_dtype=dtype)
        assert row.bucket_bytes == nbytes, (strategy, dtype)
        stage = int(strategy[-1])
        assert bucket_bytes(stage, h, P, "bf16", dtype, False, largest_param=L) == nbytes
    # the gradients: fp32 accumulation costs zero1 a full 4P buffer, zero2/3 double their 2P/N partition
    for strategy, extra in (("zero1", 4 * P), ("zero2", 2 * -(-P // n)), ("zero3", 2 * -(-P // n))):
        _, fp32, parts32 = _row(strategy, grad_reduce_dtype="fp32")
        _, bf16, parts16 = _row(strategy, grad_reduce_dtype="bf16")
        assert fp32.grads_bytes - bf16.grads_bytes == extra, strategy
        reduce32 = [x.sent for x in parts32 if "gradients" in x.what]
        reduce16 = [x.sent for x in parts16 if "gradients" in x.what]
        assert reduce32 == pytest.approx([2 * x for x in reduce16]), strategy  # fp32 reduction: twice the bytes
