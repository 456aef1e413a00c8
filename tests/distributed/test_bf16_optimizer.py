"""zero1 in bf16 with fp32 accumulation (strategy.grad_reduce_dtype's default) is DeepSpeed's BF16_Optimizer
(engine.py `_do_optimizer_sanity_check`), whose checkpoint files record no zero_stage: trained with a checkpoint
on 2 real CPU ranks, resumed under zero1 and under ddp, converted to safetensors and inspected."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY
from tests.support.harness import run_distributed
from zerodp.cli.commands import main
from zerodp.convert import open_checkpoint

BF16_VS_DDP = 0.01
"""Max |loss(zero, bf16) - loss(ddp, bf16)| per step (docs/strategies.md, "Precision semantics at a glance")."""
RUN = TINY + ["train.global_batch_size=8", "train.precision=bf16", "strategy.name=zero1", "optim.decay_steps=10",
              "checkpoint.every=3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16opt")
    over = {
        "full": RUN + ["train.max_steps=6", f"train.out_dir={tmp / 'full'}"],
        "part": RUN + ["train.max_steps=3", f"train.out_dir={tmp / 'part'}"],
        "resume": {"zero1": RUN + ["train.max_steps=6", f"train.out_dir={tmp / 'zero1'}"],
                   "ddp": RUN + ["train.max_steps=6", "strategy.name=ddp", f"train.out_dir={tmp / 'ddp'}"]},
        "pristine": str(tmp / "pristine"),
    }
    results = run_distributed("tests.support.bf16_optimizer_workers:save_and_resume", 2, over, timeout=900)
    return {"tmp": tmp, "ranks": results}


def checkpoint(runs):
    return next((runs["tmp"] / "pristine" / "checkpoints").glob("step_00000003"))


def test_the_checkpoint_is_bf16_optimizers(runs):
    ckpt = checkpoint(runs)
    osd = torch.load(next((ckpt / "deepspeed").glob("*optim_states.pt")), map_location="cpu", weights_only=False)
    assert "zero_stage" not in osd["optimizer_state_dict"] and osd["ds_config"]["zero_optimization"]["stage"] == 1


def test_resume_under_zero1_is_exact_and_under_ddp_close(runs):
    res = runs["ranks"][0]
    full, part = res["full"], res["part"]
    assert part["losses"] == full["losses"][:3]
    assert res["zero1"]["strategy"] == "zero1" and res["zero1"]["losses"] == full["losses"][3:]  # bit for bit
    assert all(torch.equal(res["zero1"]["weights"][k], full["weights"][k]) for k in full["weights"])
    gap = max(abs(a - b) for a, b in zip(res["ddp"]["losses"], full["losses"][3:]))
    assert res["ddp"]["strategy"] == "ddp" and len(res["ddp"]["losses"]) == 3 and gap < BF16_VS_DDP, gap
    assert runs["ranks"][1]["zero1"]["losses"] == res["zero1"]["losses"]


def test_convert_and_inspect(runs, capsys):
    from safetensors.torch import load_file

    ckpt, saved = checkpoint(runs), runs["ranks"][0]["part"]["weights"]
    src = open_checkpoint(ckpt)
    # what the checkpoint holds is the weights the run had at step 3 (the fp32 master), with AdamW moments
    for name, w in saved.items():
        assert torch.equal(src.get(name, "param").float(), w), name
        assert src.get(name, "exp_avg").shape == w.shape and src.get(name, "exp_avg_sq").min() >= 0, name
        assert src.step(name) == 3
    assert main(["convert", str(ckpt), str(runs["tmp"] / "st"), "--to", "safetensors", "--no-progress"]) == 0
    tensors = {}
    for f in (runs["tmp"] / "st").glob("*.safetensors"):
        tensors.update(load_file(f))
    assert all(torch.equal(tensors[n].float(), w) for n, w in saved.items() if n in tensors)
    assert set(saved) - set(tensors) <= {"lm_head.weight"}  # tied to the embedding
    capsys.readouterr()
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "zero1" in out or "stage 1" in out, out
