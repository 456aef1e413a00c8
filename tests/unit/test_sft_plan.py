"""Nothing in the memory model changes with loss masks: `zerodp plan --config` of the fine-tuning config
gives the same rows with the conversations' masked folder (packed or not) as with unmasked data of the
same vocabulary (docs/memory_model.md). The mask changes which tokens are targets, not any tensor's size."""

from __future__ import annotations

import json

from tests.support.sampler_workers import write_prepared
from zerodp.cli.commands import main

SFT = ["model.arch=llama", "model.n_layer=4", "model.n_embd=128", "model.n_head=4", "model.n_kv_head=2",
       "model.intermediate_size=384", "model.block_size=128", "model.vocab_size=256", "strategy.name=zero3",
       "data.document_masking=true"]


def plan(capsys, *overrides) -> dict:
    assert main(["plan", "--config", "configs/sft-llama.yaml", *SFT, *overrides, "model.hf_config=null",
                 "model.init_from=null", "--gpus", "8", "--hbm", "80GB", "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # the whole plan: its rows (strategies), choice, reasons


def test_plan_rows_are_the_same_with_and_without_the_loss_mask(tmp_path, capsys):
    masked = write_prepared(tmp_path / "sft", [40] * 300, [40] * 30, targets=[0.3, 0.0, 1.0])
    plain = write_prepared(tmp_path / "plain", [40] * 300, [40] * 30)
    base = plan(capsys, f"data.source={plain}")
    assert len(base["strategies"]) >= 6 and base["strategy"]
    assert plan(capsys, f"data.source={masked}") == base
    assert plan(capsys, f"data.source={masked}", "data.packing=false") == base
