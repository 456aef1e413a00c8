"""Every DeepSpeed default that changes the numerics or the host syncs is set in the config zerodp writes,
and DeepSpeed's own parser reads back the value zerodp chose (issue 39: DeepSpeed 0.19 turned
bf16.check_grad_overflow on and made gradient_clipping 1.0 by default)."""

from __future__ import annotations

import pytest

from zerodp.config import load_config
from zerodp.strategies.deepspeed_config import deepspeed_config


def _parsed(precision: str, stage: int, *extra: str):
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_config("configs/tiny.yaml", [f"train.precision={precision}", "train.global_batch_size=8",
                                            "train.micro_batch_size=8", *extra])
    written = deepspeed_config(cfg, stage, 1, 1)
    return written, DeepSpeedConfig(written)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_defaults_that_change_numerics_or_syncs_are_written_and_read_back(precision, stage):
    written, ds = _parsed(precision, stage, "optim.grad_clip=0.5")
    assert ds.gradient_clipping == 0.5  # DeepSpeed's own default is 1.0
    assert written["prescale_gradients"] is False and ds.prescale_gradients is False
    assert written["gradient_predivide_factor"] == 1.0 and ds.gradient_predivide_factor == 1.0
    assert written["gradient_allreduce_op"] == "mean" and ds.gradient_allreduce_op == "mean"
    assert written["torch_autocast"] == {"enabled": False} and ds.torch_autocast_enabled is False
    assert written["managed_gradient_accumulation"] is True and ds.managed_gradient_accumulation is True
    bf16 = ds.bfloat16_config
    assert bf16.enabled is (precision == "bf16")
    assert written["bf16"]["check_grad_overflow"] is False and bf16.check_grad_overflow is False  # a sync a step
    assert bf16.immediate_grad_update is False and bf16.bf16_master_weights_and_grads is False
    assert bf16.bf16_optimizer_states is False
    fp16 = ds.float16_config
    assert fp16.enabled is (precision == "fp16")
    assert written["fp16"]["auto_cast"] is False and fp16.auto_cast is False
    assert fp16.fp16_master_weights_and_grads is False
    if precision == "fp16":
        assert (fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
                fp16.consecutive_hysteresis, fp16.min_loss_scale) == (0, 16, 2000, 1, False, 1)
    zero = ds.zero_config
    pinned = {"compute_grad_norm": True, "reduce_scatter": True, "allgather_partitions": True,
              "use_multi_rank_bucket_allreduce": True, "round_robin_gradients": False,
              "load_from_fp32_weights": True, "enable_sanity_checks": False,
              "zero_quantized_nontrainable_weights": False}
    for key, value in pinned.items():
        assert written["zero_optimization"][key] == value and getattr(zero, key) == value, key
    assert zero.stage == stage


def test_a_user_key_still_overrides_a_pinned_one():
    written, ds = _parsed("bf16", 2, "strategy.deepspeed={zero_optimization: {round_robin_gradients: true}}")
    assert written["zero_optimization"]["round_robin_gradients"] is True and ds.zero_config.round_robin_gradients
