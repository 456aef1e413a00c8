"""Checkpoints that move: read any supported checkpoint as one canonical, streaming view, and write it
as consolidated safetensors, as a Hugging Face model folder or as a zerodp checkpoint (canonical layout).
No DeepSpeed import, no pickled code executed. See docs/checkpoints.md.

    src = open_checkpoint("runs/gpt/checkpoints")      # zerodp (any strategy), DeepSpeed, DCP, safetensors
    for name, kind, tensor in src.iter_tensors(("param", "exp_avg", "exp_avg_sq")): ...
    write_safetensors(src, "export/", dtype="bf16", max_shard_size=parse_size("5GB"))
    write_hf(src, "hf-export/")                          # config.json + HF names and layouts
    write_zerodp(src, "runs/new/checkpoints/step_00001000")

Layer: above config, models and the checkpoint manifest (zerodp.checkpoint.manifest, safe_output);
training's save/load (zerodp.checkpoint.store) and strategies import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zerodp.errors import CheckpointError

if TYPE_CHECKING:
    from zerodp.convert.source import CheckpointSource

# torch is imported only when a reader or writer is used: `zerodp --help` and `zerodp plan` stay instant.
_LAZY = {"KINDS": "source", "CheckpointSource": "source", "TensorInfo": "source",
         "parse_size": "writers", "write_safetensors": "writers", "write_zerodp": "writers", "write_hf": "writers"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"zerodp.convert.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'zerodp.convert' has no attribute {name!r}")

__all__ = ["KINDS", "CheckpointSource", "TensorInfo", "open_checkpoint", "detect_format", "parse_size",
           "write_safetensors", "write_hf", "write_zerodp"]

FORMATS = ("zerodp", "deepspeed", "dcp", "safetensors")


def detect_format(path: str | Path) -> tuple[str, Path]:
    """(format, the path to open) for a checkpoint file or folder; CheckpointError if none fits."""
    from zerodp.checkpoint.manifest import resolve_step_folder as resolve_zerodp_root
    from zerodp.convert.deepspeed_ckpt import find_deepspeed_dir

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint folder or .safetensors file")
    if path.is_file():
        if path.name.endswith((".safetensors", ".index.json")):
            return "safetensors", path
        if path.name == "latest" or path.name == "meta.json":
            return detect_format(path.parent)
        raise CheckpointError(f"{path} is not a format zerodp reads (.safetensors, a safetensors index, or a "
                              f"checkpoint folder: zerodp, DeepSpeed, torch.distributed.checkpoint)")
    step_dir = resolve_zerodp_root(path)
    if step_dir is not None:
        return "zerodp", step_dir
    if (path / ".metadata").is_file():
        return "dcp", path
    if find_deepspeed_dir(path) is not None:
        return "deepspeed", path
    if (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors")):
        return "safetensors", path
    raise CheckpointError(f"{path} is not a checkpoint zerodp recognises: no meta.json or checkpoints/latest "
                          f"(zerodp), *_optim_states.pt (DeepSpeed), .metadata (torch.distributed.checkpoint) or "
                          f"*.safetensors inside")


def open_checkpoint(path: str | Path, verify_deep: bool = False, hash_beside_reads: bool = False,
                    hashing=None) -> CheckpointSource:
    """Open any supported checkpoint. Sizes (and with verify_deep, zerodp's sha256 manifest) are
    checked before any tensor is read; a damaged file raises CheckpointError naming it. With
    hash_beside_reads the sha256 check runs in threads while tensors are read, and
    `source.confirm()` waits for it and raises (the writers call it before publishing). `hashing`: a
    zerodp.checkpoint.manifest.BackgroundVerify already begun on the checkpoint's step folder, used instead
    of a new one."""
    fmt, where = detect_format(path)
    if fmt == "zerodp":
        from zerodp.convert.zerodp_ckpt import ZerodpSource

        return ZerodpSource(where, verify_deep=verify_deep, hash_beside_reads=hash_beside_reads, hashing=hashing)
    if fmt == "deepspeed":
        from zerodp.convert.deepspeed_ckpt import DeepSpeedSource

        return DeepSpeedSource(where)
    if fmt == "dcp":
        from zerodp.convert.dcp_ckpt import DcpSource

        return DcpSource(where)
    from zerodp.convert.experts import stacked
    from zerodp.convert.hf import SafetensorsSource

    return stacked(SafetensorsSource(where))  # an MoE model's per-expert tensors as its stacked parameters
