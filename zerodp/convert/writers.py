"""Targets: consolidated (optionally sharded) safetensors, and a zerodp checkpoint in the canonical layout.

Both stream: tensors are fetched from the source one at a time and written straight into a file
whose header was laid out first, so memory holds about one tensor whatever the model size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from zerodp.convert.source import MOMENTS, CheckpointSource, TensorInfo, write_safetensors_file
from zerodp.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (HF's decimal units); '10MiB', '123' (bytes) also accepted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r} is not a size; write it like 5GB, 500MB or 10MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in logs and tests
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                disable=None if enabled else True, leave=False)


def _prepare_dir(dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} exists and is a file; choose a new folder for the output")
    if dst.is_dir() and any(dst.iterdir()):
        if not overwrite:
            raise UserError(f"{dst} already exists and is not empty; choose a new folder or pass --overwrite")
        shutil.rmtree(dst)
    dst.mkdir(parents=True, exist_ok=True)


def _source_metadata(source: CheckpointSource) -> dict[str, str]:
    md = {"format": "pt", "zerodp.source": json.dumps(source.describe(), sort_keys=True),
          "zerodp.tied": json.dumps(source.tied(), sort_keys=True)}
    cfg = source.meta.get("config")
    if cfg:
        md["zerodp.config"] = json.dumps(cfg, sort_keys=True)
    return md


def write_safetensors(source: CheckpointSource, dst: str | Path, dtype: str | None = None,
                      max_shard_size: int | None = None, progress: bool = True, overwrite: bool = False) -> list[Path]:
    """Write the source's weights into folder `dst` as `model.safetensors`, or, when they exceed
    `max_shard_size` bytes, as HF's `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`.

    dtype None keeps each tensor's dtype; "fp32" | "bf16" | "fp16" casts floating tensors. A tied
    alias is not written (HF's convention: GPT-2's lm_head.weight is absent and re-tied on load);
    `zerodp.tied` in the metadata records it. The source's description rides in `zerodp.source`."""
    dst = Path(dst)
    target = DTYPES[dtype] if dtype else None
    names = source.param_names()
    infos = {}
    for n in names:
        i = source.info(n)
        infos[n] = TensorInfo(i.shape, target if target is not None and i.dtype.is_floating_point else i.dtype)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        if max_shard_size and shards[-1] and size + infos[n].nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += infos[n].nbytes
    _prepare_dir(dst, overwrite)
    metadata = _source_metadata(source)

    def fetch(n: str) -> torch.Tensor:
        t = source.get(n)
        return t.to(infos[n].dtype) if t.dtype != infos[n].dtype else t

    total = sum(i.nbytes for i in infos.values())
    written = []
    with _progress(total, "convert", progress) as bar:
        if len(shards) == 1:
            path = dst / "model.safetensors"
            write_safetensors_file(path, shards[0], infos, fetch, metadata, bar.update)
            return [path]
        k = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            path = dst / f"model-{i:05d}-of-{k:05d}.safetensors"
            write_safetensors_file(path, shard, infos, fetch, metadata, bar.update)
            weight_map.update(dict.fromkeys(shard, path.name))
            written.append(path)
    index = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
    (dst / INDEX).write_text(json.dumps(index, indent=1))
    return written + [dst / INDEX]


def write_zerodp(source: CheckpointSource, dst: str | Path, step: int | None = None, progress: bool = True,
                 overwrite: bool = False) -> Path:
    """Write `dst` as a zerodp checkpoint folder in the canonical layout (strategy "single", world size 1):
    model.safetensors (fp32 weights), optim.safetensors (fp32 exp_avg / exp_avg_sq, where the source
    has them), optim.json (AdamW step per parameter), trainer.json and meta.json with its manifest.
    zerodp.checkpoint.verify() accepts the result; `step` overrides the source's training step."""
    from zerodp.checkpoint import FORMAT_VERSION, sha256_file

    dst = Path(dst)
    names = source.param_names()
    infos = {n: TensorInfo(source.info(n).shape, torch.float32) for n in names}
    moments = [n for n in names if all(source.has(n, k) for k in MOMENTS)]
    m_names = [f"{n}/{k}" for n in moments for k in MOMENTS]
    m_infos = {f"{n}/{k}": infos[n] for n in moments for k in MOMENTS}
    train_step = step if step is not None else source.step()
    _prepare_dir(dst, overwrite)
    metadata = _source_metadata(source)
    total = sum(i.nbytes for i in infos.values()) + sum(i.nbytes for i in m_infos.values())
    with _progress(total, "convert", progress) as bar:
        write_safetensors_file(dst / "model.safetensors", names, infos,
                               lambda n: source.get(n).float(), metadata, bar.update)
        write_safetensors_file(dst / "optim.safetensors", m_names, m_infos,
                               lambda key: source.get(*key.rsplit("/", 1)).float(), metadata, bar.update)
    steps = {}
    for n in moments:
        s = source.step(n)
        steps[n] = float(s if s is not None else (train_step or 0))
    (dst / "optim.json").write_text(json.dumps({"step": steps, "extra": {}}))
    trainer = dict(getattr(source, "trainer", {}) or {})
    trainer["step"] = int(train_step or 0)
    (dst / "trainer.json").write_text(json.dumps(trainer, indent=1))
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(dst.iterdir())}
    meta = {
        "strategy": "single", "world_size": 1, "layout": "canonical",
        "precision": source.meta.get("precision", "fp32"),
        "config": source.meta.get("config") or {},
        "params": {n: {"shape": list(infos[n].shape), "dtype": "float32"} for n in names},
        "tied": source.tied(),
        "converted_from": source.describe(),
        "torch_version": torch.__version__,
        "format_version": FORMAT_VERSION, "step": int(train_step or 0), "files": files,
    }
    tmp = dst / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, dst / "meta.json")  # written last, as zerodp's own save does
    return dst
