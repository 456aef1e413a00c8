"""LoRA on one process, without a process group: what the single strategy holds (the frozen base in 16 bits
under bf16/fp16, the adapters fp32 with AdamW's moments, gradients for the adapters only), the load_full
contract every strategy keeps (every parameter the state holds, frozen or not; an adapter the state lacks
keeps its initial values; AdamW state for the trained ones), the start-up model check (a base model's
weights lack the adapters, a LoRA checkpoint lacks the base), and the base's identity
(zerodp.convert.lora_base: cached per file, a different base refused in one line naming both)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import TINY
from zerodp.checkpoint.store import check_model
from zerodp.config import load_config
from zerodp.convert import lora_base, open_checkpoint
from zerodp.convert.full_state import FullState
from zerodp.errors import UserError
from zerodp.models import arch_of, build_model, param_shapes
from zerodp.models.lora_spec import adapter_shapes, is_adapter, lora_spec
from zerodp.strategies.base import RunContext
from zerodp.strategies.single import SingleStrategy

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def counts(cfg) -> tuple[int, int]:
    """(base parameters, a tied head once; adapter parameters) of cfg's model."""
    base = sum(math.prod(s) for s in param_shapes(cfg.model).values())
    adapters = sum(math.prod(s) for s in adapter_shapes(arch_of(cfg.model), lora_spec(cfg.model.lora)).values())
    return base, adapters


def single(cfg) -> SingleStrategy:
    s = SingleStrategy()
    s.setup(build_model(cfg.model, device="meta"), RunContext(cfg, 0, 1, 0, torch.device("cpu"), 1))
    return s


def one_step(s: SingleStrategy, cfg) -> dict:
    """Forward and backward one batch, then the bytes held before the step (gradients live), then step."""
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.block_size))
    with s.micro_step(True), s.autocast():
        loss = s.model(x, x)
    s.backward(loss)
    before = s.state_bytes()
    s.step(1e-2)
    return before


@pytest.mark.parametrize("precision, base_bytes", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_single_holds_the_frozen_base_at_the_precision_and_trains_the_adapters(precision, base_bytes):
    cfg = load_config(None, TINY + LORA + [f"train.precision={precision}"])
    base, adapters = counts(cfg)
    s = single(cfg)
    start = {n: p.detach().clone() for n, p in s.model.named_parameters()}
    for n, p in s.model.named_parameters():
        assert p.requires_grad == is_adapter(n), n
        assert p.dtype == (torch.float32 if is_adapter(n) else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                                 "fp16": torch.float16}[precision]), (n, p.dtype)
    assert s.model.lm_head.weight is s.model.transformer.wte.weight  # still tied, one tensor
    held = one_step(s, cfg)
    assert held["params"] == base_bytes * base + 4 * adapters
    assert held["grads"] == 4 * adapters  # the adapters' gradients, none for the base
    assert held["optim"] == 0  # AdamW's moments are made by the first step
    after = s.state_bytes()
    n_adapters = sum(1 for n in start if is_adapter(n))
    assert after["optim"] == 8 * adapters + 4 * n_adapters  # exp_avg, exp_avg_sq (fp32) and a step each
    assert after["grads"] == 0
    moved = [n for n, p in s.model.named_parameters() if not torch.equal(p, start[n])]
    assert moved and all(is_adapter(n) for n in moved), moved  # B moved off 0 (A too); the base did not
    assert set(s.optimizer.state) == {p for n, p in s.model.named_parameters() if is_adapter(n)}
    full = s.full_state_dict()
    assert all(t.dtype == torch.float32 for t in full.values()) and len(full) == len(start)


def test_load_full_copies_what_the_state_holds(tmp_path):
    """A base model's weights (no adapters) fill the frozen base; the adapters keep their initial values;
    then a LoRA checkpoint's tensors (adapters and moments, no base) fill the adapters and AdamW."""
    cfg = load_config(None, TINY + LORA + ["train.precision=bf16"])
    donor = build_model(load_config(None, TINY).model, seed=7)
    save_file({n: p.detach().contiguous() for n, p in donor.named_parameters()}, tmp_path / "base.safetensors")
    s = single(cfg)
    initial = {n: p.detach().clone() for n, p in s.model.named_parameters() if is_adapter(n)}
    with open_checkpoint(tmp_path / "base.safetensors") as source:
        s.load_full(FullState(source, with_optimizer=False))
    for n, p in s.model.named_parameters():
        if is_adapter(n):
            assert torch.equal(p, initial[n]), n
        else:
            assert torch.equal(p, donor.get_parameter(n).detach().to(torch.bfloat16)), n
    assert not s.optimizer.state
    # a LoRA checkpoint's layout: adapters and their AdamW state only
    adapters = {n: torch.full(p.shape, 0.5) for n, p in s.model.named_parameters() if is_adapter(n)}
    moments = {f"{n}/{k}": torch.full(t.shape, v) for n, t in adapters.items()
               for k, v in (("exp_avg", 0.1), ("exp_avg_sq", 0.2))}
    ckpt = tmp_path / "lora"
    ckpt.mkdir()
    save_file(adapters, ckpt / "model.safetensors")
    save_file(moments, ckpt / "optim.safetensors")
    (ckpt / "optim.json").write_text('{"step": {' + ", ".join(f'"{n}": 3' for n in adapters) + '}, "extra": {}}')
    from zerodp.convert.zerodp_ckpt import ZerodpSource

    (ckpt / "meta.json").write_text('{"format_version": 1, "step": 3, "files": {}}')
    with ZerodpSource(ckpt) as source:
        state = FullState(source, with_optimizer=True)
        assert state.with_optimizer
        s.load_full(state)
    for n, p in s.model.named_parameters():
        if is_adapter(n):
            assert torch.equal(p, adapters[n]), n
            st = s.optimizer.state[p]
            assert float(st["step"]) == 3 and torch.equal(st["exp_avg"], torch.full(p.shape, 0.1)), n
        else:
            assert torch.equal(p, donor.get_parameter(n).detach().to(torch.bfloat16)), n  # untouched


def test_start_check_takes_a_base_without_adapters_and_a_lora_checkpoint_without_base(tmp_path):
    cfg = load_config(None, TINY + LORA)
    model_cfg = cfg.to_dict()["model"]
    shapes = param_shapes(cfg.model)
    adapters = adapter_shapes(arch_of(cfg.model), lora_spec(cfg.model.lora))
    everything = {**shapes, **adapters}
    donor = build_model(load_config(None, TINY).model, seed=7)
    save_file({n: p.detach().contiguous() for n, p in donor.named_parameters()}, tmp_path / "base.safetensors")
    ok = check_model(tmp_path / "base.safetensors", model_cfg, everything, may_lack=list(adapters))
    assert ok.problem is None and not ok.has_optimizer
    strict = check_model(tmp_path / "base.safetensors", model_cfg, everything)
    assert "of this model's parameters are missing there" in strict.problem
    save_file({n: torch.zeros(s) for n, s in adapters.items()}, tmp_path / "adapters.safetensors")
    assert check_model(tmp_path / "adapters.safetensors", model_cfg, everything, may_lack=list(shapes)).problem is None
    # a checkpoint of the base model records its model section, without model.lora: the base check lets
    # that key differ, a resume's does not
    full = tmp_path / "full"
    full.mkdir()
    save_file({n: p.detach().contiguous() for n, p in donor.named_parameters()}, full / "model.safetensors")
    recorded = {"model": load_config(None, TINY).to_dict()["model"]}
    (full / "meta.json").write_text(json.dumps({"format_version": 1, "step": 0, "files": {}, "config": recorded}))
    assert check_model(full, model_cfg, everything, may_lack=list(adapters), free=("lora",)).problem is None
    assert "model.lora not set there (every weight trained), set here" in check_model(
        full, model_cfg, everything, may_lack=list(adapters)).problem
    # adapters are no base model
    wrong = check_model(tmp_path / "adapters.safetensors", model_cfg, everything, may_lack=list(adapters))
    assert f"{len(shapes)} of this model's parameters are missing there" in wrong.problem


def test_base_identity_is_hashed_once_and_a_different_base_is_refused(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    donor = build_model(load_config(None, TINY).model, seed=7)
    base = tmp_path / "base.safetensors"
    save_file({n: p.detach().contiguous() for n, p in donor.named_parameters()}, base)
    cfg = load_config(None, TINY + LORA + [f"model.init_from={base}", f"data.cache_dir={cache}"])
    record = lora_base.lora_record(cfg)
    assert record["rank"] == 4 and record["alpha"] == 8.0 and record["targets"] == ["all-linear"]
    assert record["base"]["init_from"] == str(base) and record["base"]["seed"] == cfg.train.seed
    import hashlib

    file_sha = hashlib.sha256(base.read_bytes()).hexdigest()
    assert lora_base.file_sha256(base, cache) == file_sha
    assert (cache / lora_base.CACHE_FILE).is_file()
    # the cached digest is used while size and mtime hold: the file is not read again
    monkeypatch.setattr(hashlib, "sha256", lambda *a: pytest.fail("read again"))
    assert lora_base.file_sha256(base, cache) == file_sha
    monkeypatch.undo()
    lora_base.check_base(tmp_path / "ckpt", record, cfg)  # the same base: passes
    seeded = load_config(None, TINY + LORA)
    seeded_record = lora_base.lora_record(seeded)
    assert seeded_record["base"]["init_from"] is None
    dropout = load_config(None, TINY + LORA + ["model.dropout=0.1"])  # no weight changes
    assert seeded_record["base"] == lora_base.lora_record(dropout)["base"]
    assert seeded_record["base"]["sha256"] != lora_base.lora_record(
        load_config(None, TINY + LORA + ["train.seed=5"]))["base"]["sha256"]
    with pytest.raises(UserError) as e:
        lora_base.check_base(tmp_path / "ckpt", record, seeded)
    line = str(e.value)
    assert "\n" not in line and str(base) in line and f"train.seed={cfg.train.seed}" in line, line
    assert f"set model.init_from to {base}" in line and record["base"]["sha256"][:12] in line, line


def test_the_canonical_checkpoint_holds_the_adapters_and_loads_back(tmp_path):
    """single's save (ddp's too: rank 0's) writes the adapters and their moments by name; its load puts
    them back and leaves the frozen base as it is."""
    cfg = load_config(None, TINY + LORA + ["train.precision=bf16"])
    s = single(cfg)
    one_step(s, cfg)
    s.save(tmp_path)
    adapters = adapter_shapes(arch_of(cfg.model), lora_spec(cfg.model.lora))
    with open_checkpoint(tmp_path / "model.safetensors") as source:
        assert sorted(source.param_names()) == sorted(adapters)
    t = single(cfg)
    base = {n: p.detach().clone() for n, p in t.model.named_parameters() if not is_adapter(n)}
    t.load(tmp_path)
    for n, p in t.model.named_parameters():
        want = s.model.get_parameter(n) if is_adapter(n) else base[n]
        assert torch.equal(p, want), n
        if is_adapter(n):
            assert torch.equal(t.optimizer.state[p]["exp_avg"], s.optimizer.state[s.model.get_parameter(n)]["exp_avg"])


def test_the_start_line_says_what_is_adapted_and_what_trains():
    """Two blocks of width 32, q_proj and v_proj (32 x 32) at rank 4: 4 x (32 + 32) = 256 adapter parameters
    per layer, 4 layers adapted."""
    from zerodp.models.lora_spec import summary

    cfg = load_config(None, ["model.arch=llama", "model.n_layer=2", "model.n_embd=32", "model.n_head=4",
                             "model.lora.rank=4", "model.lora.targets=[q_proj, v_proj]"])
    arch = arch_of(cfg.model)
    line = summary(arch, lora_spec(cfg.model.lora), "bf16")
    assert "LoRA rank 4, alpha 8 (scale 2) on 4 linear layers (q_proj, v_proj): 1,024 adapter parameters" in line
    share = 100 * 1024 / (1024 + arch.param_count())
    assert f"trained ({share:.2f}%), the base's {arch.param_count():,} frozen in bf16" in line, line
