"""The sampler's test support: prepared folders written with numpy (what `zerodp prepare` writes, without a
tokenizer: documents of chosen lengths, each ending in the separator), and the rank function that trains
and records the tokens each rank's micro batches held."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EOT = 1


def write_prepared(folder: Path, train_docs: list[int], val_docs: list[int], vocab: int = 256, seed: int = 0,
                   sha256: str = "a" * 64, index: bool = True, targets: list[float] | None = None) -> Path:
    """A prepared folder whose documents have the given lengths (separator included): document d of a
    split holds tokens 2 + (d + i) % (vocab - 2) and ends in EOT. `index=False`: as prepared before the
    document index existed (no .idx files, none in meta.json). `targets`: a loss mask (train.mask,
    val.mask, as `zerodp prepare --chat` writes), document d's last round(targets[d % len] * length)
    tokens its targets (0: none, as a conversation's user turns; 1: all)."""
    folder.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, lengths in (("train", train_docs), ("val", val_docs)):
        docs = [np.append(2 + (d + np.arange(n - 1)) % (vocab - 2), EOT) for d, n in enumerate(lengths)]
        tokens = np.concatenate(docs).astype(np.uint16) if docs else np.zeros(0, np.uint16)
        tokens.tofile(folder / f"{split}.bin")
        splits[split] = {"file": f"{split}.bin", "documents": len(lengths), "tokens": len(tokens)}
        if targets is not None:
            masks = [(np.arange(n) >= n - round(targets[d % len(targets)] * n)).astype(np.uint8)
                     for d, n in enumerate(lengths)]
            (np.concatenate(masks) if masks else np.zeros(0, np.uint8)).tofile(folder / f"{split}.mask")
            splits[split]["mask"] = {"file": f"{split}.mask", "dtype": "uint8", "of": "1 where a token is a target"}
        if index:
            np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64).tofile(folder / f"{split}.idx")
            splits[split]["index"] = {"file": f"{split}.idx", "dtype": "int64", "of": "each document's first token"}
    meta = {"format": "zerodp-prepare", "format_version": 2 if index else 1, "vocab_size": vocab, "dtype": "uint16",
            "tokenizer": {"path": str(folder / "tokenizer.json"), "sha256": sha256}, "eot_id": EOT,
            "eot_token": "<|endoftext|>", "special_tokens": True, "splits": splits,
            "documents": len(train_docs) + len(val_docs), "split_by_tokens": 0,
            "tokens": sum(s["tokens"] for s in splits.values()), "seed": seed}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def record_batches(overrides: list[str], fresh: bool = True) -> dict:
    """Train per `overrides` (`fresh`: from step 0, else resuming from the run's latest checkpoint) and
    return the tokens of every micro batch this rank's loop handed the model, by step, and the run's
    losses: the loop's own batches, recorded where it calls the model."""
    from zerodp.config import load_config
    from zerodp.trainer import loop

    seen: dict[int, list[list[list[int]]]] = {}
    arity: set[int] = set()
    real = loop.model_inputs
    step = {"k": -1, "left": 0}
    cfg = load_config(None, overrides)
    per_step = cfg.train.global_batch_size // _world() // cfg.train.micro_batch_size

    def recording(batch, device, non_blocking=True):
        if non_blocking:  # training's micro batches (evaluation passes non_blocking=False)
            if step["left"] == 0:
                step["k"], step["left"] = step["k"] + 1, per_step
            step["left"] -= 1
            arity.add(len(batch))
            x, y = batch[0], batch[1]  # a row's T + 1 tokens: x and y's last
            seen.setdefault(step["k"], []).append([a + [b[-1]] for a, b in zip(x.tolist(), y.tolist())])
        return real(batch, device, non_blocking)

    loop.model_inputs = recording
    try:
        summary = loop.train(cfg, fresh=fresh)
    finally:
        loop.model_inputs = real
    return {"rows": seen, "losses": summary["losses"], "arity": sorted(arity)}


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1
