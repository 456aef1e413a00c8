"""checkpoint.async_save: background saves write the same files as synchronous ones, which DeepSpeed's
zero_to_fp32 (zero3) and torch's dcp_to_torch_save (fsdp) read alike. Faults during a background save:
tests/distributed/test_async_faults.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_distributed

STRATEGIES = ["ddp", "zero1", "zero3", "fsdp"]


def run(tiny, name):
    """Saves at steps 2 and 4: step 2's is written in the background while steps 3-4 train and published by a
    later step, step 4's (the last) is published before the run ends, after waiting for step 2's."""
    return [*tiny, f"strategy.name={name}", "train.global_batch_size=8", "train.max_steps=4",
            "checkpoint.every=2", "checkpoint.keep_last=3"]


def dcp_state(ckpt, target):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "dcp", target)
    return torch.load(target, weights_only=False)


def same_content(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            same_content(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same_content(x, y, f"{where}/{i}")
    elif isinstance(a, (int, float, str, bool, type(None))):
        assert a == b, where


@pytest.mark.parametrize("name", STRATEGIES)
def test_background_save_writes_the_synchronous_files(tiny, tmp_path, name):
    ranks = run_distributed("tests.support.async_workers:sync_and_async", 2,
                            {"overrides": run(tiny, name), "out": str(tmp_path)})
    sync, bg = ranks[0]["sync"], ranks[0]["async"]
    assert sorted(bg["manifests"]) == ["step_00000002", "step_00000004"]
    for step, files in sync["manifests"].items():  # every file, bit for bit (sha256), meta.json apart
        assert sorted(bg["manifests"][step]) == sorted(files)
        differ = [f for f in files if f != "trainer.json" and bg["manifests"][step][f] != files[f]]
        for f in [f for f in differ if f.endswith(".pt")]:  # DeepSpeed's pickles: the same tensors and values
            same_content(torch.load(tmp_path / "sync/checkpoints" / step / f, weights_only=False),
                         torch.load(tmp_path / "async/checkpoints" / step / f, weights_only=False), f)
            differ.remove(f)
        if name == "fsdp":  # torch's own converter reads both folders alike (DCP's pickled metadata may differ)
            read = {mode: dcp_state(tmp_path / mode / "checkpoints" / step, tmp_path / f"{mode}.pt")
                    for mode in ("sync", "async")}
            assert read["async"]["model"] and read["async"]["optim"], sorted(read["async"])
            same_content(read["sync"], read["async"], step)
            differ = [f for f in differ if f != "dcp/.metadata"]
        assert differ == [], (step, differ)
    if name == "zero3":  # DeepSpeed's own reader of the folder written while training went on
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        same_content(*(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / mode / "checkpoints/step_00000002"),
                                                                tag="deepspeed") for mode in ("sync", "async")), "fp32")
    for k, v in sync["weights"].items():
        assert torch.equal(bg["weights"][k], v), k
