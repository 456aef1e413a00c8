"""Every config error message, pinned; overrides; batch arithmetic; the LR schedule."""

from __future__ import annotations

import math
import re

import pytest

from zerodp.config import Config, load_config
from zerodp.errors import ConfigError
from zerodp.optim.schedules import lr_at


def write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides_are_typed(tmp_path):
    cfg = load_config(write(tmp_path, "train:\n  max_steps: 7\n"), [
        "optim.lr=3e-4", "train.precision=bf16", "model.bias=false",
        "strategy.deepspeed.zero_optimization.stage3_max_live_parameters=1e6"])
    assert cfg.train.max_steps == 7
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.train.precision == "bf16" and cfg.model.bias is False
    assert cfg.strategy.deepspeed == {"zero_optimization": {"stage3_max_live_parameters": 1e6}}


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    # YAML 1.1 reads 3e-4 as a string; zerodp accepts it as the number it obviously is.
    assert load_config(write(tmp_path, "optim:\n  lr: 3e-4\n")).optim.lr == 3e-4


@pytest.mark.parametrize("text, message", [
    ("train:\n  max_step: 5\n", r"unknown key 'train.max_step' in .*c.yaml; did you mean 'train.max_steps'\?"),
    ("trian:\n  max_steps: 5\n", r"unknown key 'trian' in .*c.yaml; did you mean 'train'\?"),
    ("train:\n  max_steps: five\n", r"train.max_steps in .*c.yaml must be an integer, got 'five'"),
    ("model:\n  bias: 1\n", r"model.bias in .*c.yaml must be true or false, got 1"),
    ("optim:\n  lr: fast\n", r"optim.lr in .*c.yaml must be a number, got 'fast'"),
    ("optim:\n  lr: -0.1\n", r"optim.lr=-0.1 must be positive \(a learning rate such as 3e-4\)"),
    ("optim:\n  lr: 1.0e-3\n  min_lr: 1.0e-2\n", r"optim.min_lr=0.01 is above optim.lr=0.001; set min_lr <= lr"),
    ("optim:\n  beta2: 1.5\n", r"optim.beta2=1.5 must be in \[0, 1\)"),
    ("strategy:\n  name: zero4\n",
     r"strategy.name='zero4' is not one of single \| ddp \| zero1 \| zero2 \| zero3 \| fsdp \| auto; "
     r"did you mean 'zero3'\?"),
    ("strategy:\n  name: FSDP\n", r"strategy.name='FSDP' is not one of .*; did you mean 'fsdp'\?$"),  # any case
    ("train:\n  precision: BF16\n", r"train.precision='BF16' is not one of fp32 \| bf16 \| fp16; did you mean "
                                      r"'bf16'\?"),
    ("train:\n  precision: fp8\n", r"train.precision='fp8' is not one of fp32 \| bf16 \| fp16"),
    ("train:\n  deterministic: maybe\n", r"train.deterministic in .*c.yaml must be true or false, got 'maybe'"),
    ("train:\n  global_batch_size: 10\n  micro_batch_size: 4\n",
     r"train.global_batch_size=10 is not a multiple of train.micro_batch_size=4"),
    ("model:\n  n_embd: 100\n  n_head: 3\n",
     r"model.n_embd=100 is not divisible by model.n_head=3; choose n_head among the divisors of n_embd \(e.g. 2\)"),
    ("model:\n  dropout: 1.0\n", r"model.dropout=1.0 must be in \[0, 1\)"),
    ("model:\n  activation_checkpointing: partial\n",
     r"^model.activation_checkpointing='partial' is not one of off \| selective \| full$"),
    ("model:\n  activation_checkpointing: selectiv\n",
     r"^model.activation_checkpointing='selectiv' is not one of off \| selective \| full; did you mean 'selective'\?$"),
    ("model:\n  activation_checkpointing: 1\n",
     r"^model.activation_checkpointing in .*c.yaml must be true, false or a mode's name, got 1$"),
    ("model:\n  loss_chunks: -2\n",
     r"^model.loss_chunks=-2 must be 0 \(the whole logits\), a number of chunks or auto$"),
    ("model:\n  loss_chunks: many\n", r"^model.loss_chunks in .*c.yaml must be an integer or auto, got 'many'$"),
    ("train:\n  out_dir: ''\n", r"train.out_dir is empty"),
    ("- a\n- b\n", r"must be a mapping of sections"),
    ("train: 5\n", r"section 'train' in .*c.yaml must be a mapping of keys, got 5"),
    ("data:\n  token_dtype: int8\n", r"data.token_dtype='int8' must be 'uint16' or 'uint32'"),
    ("checkpoint:\n  keep_last: 0\n", r"checkpoint.keep_last=0 must be positive"),
    ("optim:\n  schedule: wsd2\n",
     r"^optim.schedule='wsd2' is not one of cosine \| linear \| wsd; did you mean 'wsd'\?$"),
    ("optim:\n  schedule: wsd\n  decay_shape: sqrt\n",
     r"^optim.decay_shape='sqrt' is not one of linear \| 1-sqrt; did you mean '1-sqrt'\?$"),
    ("optim:\n  schedule: wsd\n  decay_fraction: 0\n",
     r"^optim.decay_fraction=0.0 must be in \(0, 1\] \(0.2 decays over the last fifth of the steps\)$"),
    ("optim:\n  decay_shape: 1-sqrt\n", r"^optim.decay_shape='1-sqrt' applies to optim.schedule=wsd, not cosine "
                                        r"\(remove the key or set optim.schedule=wsd\)$"),
    ("optim:\n  schedule: linear\n  decay_fraction: 0.1\n", r"^optim.decay_fraction=0.1 applies to "
                                                             r"optim.schedule=wsd, not linear"),
])
def test_config_errors(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_missing_file_and_yaml_syntax(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml not found; pass a path such as configs/tiny.yaml"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError,
                       match=r"YAML syntax error in .*c.yaml at line \d+, column \d+: expected ',' or ']'"):
        load_config(write(tmp_path, "train:\n  max_steps: [1, 2\n"))


def test_nested_deepspeed_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "strategy:\n  deepspeed:\n"),
                      ["strategy.deepspeed.zero_optimization.stage3_prefetch_bucket_size=5e7"])
    assert cfg.strategy.deepspeed == {"zero_optimization": {"stage3_prefetch_bucket_size": 50_000_000}}
    with pytest.raises(ConfigError, match=r"strategy.deepspeed.zero_optimization is 5, not a mapping, so "
                                          r"strategy.deepspeed.zero_optimization.stage cannot be set inside it"):
        load_config(None, ["strategy.deepspeed.zero_optimization=5", "strategy.deepspeed.zero_optimization.stage=3"])
    (tmp_path / "latin1.yaml").write_bytes("train:\n  out_dir: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml is not UTF-8 text; save the config as UTF-8 YAML"):
        load_config(tmp_path / "latin1.yaml")


def test_override_errors():
    with pytest.raises(ConfigError, match=r"override 'max_steps=5' is not of the form section.key=value"):
        load_config(None, ["max_steps=5"])
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_stepz' in defaults \(with overrides\); "
                                          r"did you mean 'train.max_steps'"):
        load_config(None, ["train.max_stepz=5"])


def test_batch_split_by_world_size():
    cfg = load_config(None, ["train.global_batch_size=12", "train.micro_batch_size=2"])
    assert [cfg.check_batch_split(w) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ConfigError, match=r"train.global_batch_size=12 is not divisible by train.micro_batch_size=2 "
                                          r"x world_size=4 = 8; change micro_batch_size or global_batch_size, or "
                                          r"run on one of \[1, 2, 3, 6\] processes"):
        cfg.check_batch_split(4)


def test_batch_split_is_one_pure_function():
    """`zerodp train`, `zerodp plan --config` and `strategy: auto` share zerodp.config.batch_split."""
    from zerodp.config import batch_split

    cfg = load_config(None, ["train.global_batch_size=480", "train.micro_batch_size=12"])
    for world in range(1, 65):
        try:
            expected = cfg.check_batch_split(world)
        except ConfigError as e:
            with pytest.raises(ConfigError, match=f"^{re.escape(str(e))}$"):
                batch_split(480, 12, world)
        else:
            assert batch_split(480, 12, world) == expected == 40 // world
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=480 is not divisible by train.micro_batch_size=7 "
                                          r"x world_size=1 = 7; change micro_batch_size or global_batch_size "
                                          r"\(no process count up to 64 divides it\)$"):
        batch_split(480, 7, 1)


def test_lr_schedule_warmup_cosine_and_scaling():
    cfg = load_config(None, ["optim.lr=1e-3", "optim.min_lr=1e-4", "optim.warmup_steps=10", "train.max_steps=110"])
    assert lr_at(cfg, 0) == pytest.approx(1e-4)
    assert lr_at(cfg, 9) == pytest.approx(1e-3)
    assert lr_at(cfg, 60) == pytest.approx(1e-4 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-4)
    assert lr_at(cfg, 110) == pytest.approx(1e-4)
    scaled = load_config(None, ["optim.scale_lr_with_batch=true", "optim.base_batch_size=8",
                                "train.global_batch_size=32", "train.micro_batch_size=8", "optim.warmup_steps=0"])
    assert lr_at(scaled, 0) == pytest.approx(4 * scaled.optim.lr)


def test_every_field_is_documented():
    import inspect

    import zerodp.config.schema as c

    src = inspect.getsource(c)
    for section in Config().to_dict().values():
        for key in section:
            assert f"    {key}:" in src


def test_what_you_set_is_told_apart_from_what_was_resolved(tmp_path):
    """Item 12: --dry-run's 'differs from the defaults' listed model.n_kv_head, bias and tie_embeddings,
    which the user never set (gpt2's defaults for keys left null)."""
    from zerodp.config import set_and_resolved, user_settings

    path = write(tmp_path, "model:\n  n_layer: 4\n  n_head: 8\n  n_kv_head: null\ntrain:\n  max_steps: 3e2\n"
                           "strategy:\n  name: auto\n")
    overrides = ["optim.lr=3e-4", "strategy.deepspeed.zero_optimization.stage=2"]
    given = user_settings(path, overrides)
    assert given == {"model.n_layer": 4, "model.n_head": 8, "model.n_kv_head": None, "train.max_steps": 300,
                     "strategy.name": "auto", "optim.lr": 3e-4,
                     "strategy.deepspeed": {"zero_optimization": {"stage": 2}}}
    cfg = load_config(path, overrides)
    cfg.strategy.name = "ddp"  # as strategy: auto would resolve it
    mine, resolved = set_and_resolved(given, cfg)
    # n_layer: 4 is the default; strategy.name=auto is the default too, and what it became is resolved
    assert mine == [("model.n_head", 8), ("optim.lr", 3e-4), ("train.max_steps", 300),
                    ("strategy.deepspeed", {"zero_optimization": {"stage": 2}})]
    assert resolved == [("model.n_kv_head", 8), ("model.bias", True), ("model.tie_embeddings", True),
                        ("strategy.name", "ddp")]
    llama = load_config(path, overrides + ["model.arch=llama"])
    mine, resolved = set_and_resolved(user_settings(path, overrides + ["model.arch=llama"]), llama)
    assert ("model.arch", "llama") in mine
    assert resolved == [("model.n_kv_head", 8), ("model.bias", False), ("model.tie_embeddings", False)]
