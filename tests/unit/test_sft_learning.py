"""The loss mask decides what is learned. On a synthetic instruction set whose answer is a fixed function
of its prompt (a key token -> three answer tokens, from a table), a run with the mask (the answers and
their end-of-turn token the only targets) learns the answers, answer-token loss below 0.2 nats (ln 64 =
4.16 at the start), while its loss on the prompt's tokens is not optimised: it stays above 3/4 of its
start. The same run without the mask learns the prompts as well: their loss falls below half of its
start (the key itself, uniform over 16, keeps it above ln(16)/5 = 0.55). One process, in this process,
the real loop (zerodp.trainer.loop.train) on a real prepared folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY
from zerodp.config import load_config
from zerodp.models import build_model
from zerodp.trainer.loop import train

V, KEYS, CONVERSATIONS = 64, 16, 600
BOS, H1, H2, SEP, EOT = 1, 2, 3, 4, 5  # a user header, a separator, the end of the assistant's turn
TABLE = np.random.default_rng(7).integers(30, V, size=(KEYS, 3))  # key -> its answer
PROMPT, ANSWER = slice(0, 5), slice(5, 9)  # of the 9 targets of [EOT, BOS, H1, H2, key, SEP, a1, a2, a3, EOT]


def conversation(key: int) -> list[int]:
    return [BOS, H1, H2, 10 + key, SEP, *TABLE[key].tolist(), EOT]


def write_folder(folder, masked: bool):
    folder.mkdir()
    keys = np.random.default_rng(0).integers(0, KEYS, size=CONVERSATIONS)
    convs = [conversation(int(k)) for k in keys]
    splits = {}
    for split, part in (("train", convs[:500]), ("val", convs[500:])):
        np.concatenate(part).astype(np.uint16).tofile(folder / f"{split}.bin")
        np.cumsum([0] + [len(c) for c in part[:-1]]).astype(np.int64).tofile(folder / f"{split}.idx")
        splits[split] = {"file": f"{split}.bin", "documents": len(part), "tokens": sum(map(len, part)),
                         "index": {"file": f"{split}.idx", "dtype": "int64", "of": "each conversation's first token"}}
        if masked:  # the answer and its end-of-turn token, as zerodp prepare --chat marks an assistant turn
            np.concatenate([[0] * 5 + [1] * 4 for _ in part]).astype(np.uint8).tofile(folder / f"{split}.mask")
            splits[split]["mask"] = {"file": f"{split}.mask", "dtype": "uint8", "of": "1 where a token is a target"}
    meta = {"format": "zerodp-prepare", "format_version": 2, "vocab_size": V, "dtype": "uint16",
            "tokenizer": {"path": str(folder / "tokenizer.json"), "sha256": "a" * 64}, "eot_id": None,
            "special_tokens": False, "splits": splits, "documents": CONVERSATIONS, "split_by_tokens": 0,
            "tokens": sum(s["tokens"] for s in splits.values()), "seed": 0}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def losses(model) -> tuple[float, float]:
    """Mean loss on the prompt's targets and on the answer's, over every key (each after an EOT)."""
    rows = torch.tensor([[EOT, *conversation(k)] for k in range(KEYS)])
    with torch.no_grad():
        logits = model(rows[:, :-1])
    each = F.cross_entropy(logits.transpose(1, 2), rows[:, 1:], reduction="none")  # (KEYS, 9)
    return each[:, PROMPT].mean().item(), each[:, ANSWER].mean().item()


def run(folder, tmp_path, group) -> dict:
    cfg = load_config(None, [o for o in TINY if not o.startswith("model.vocab_size")] + [
        f"data.source={folder}", "model.n_embd=64", "model.block_size=32", "train.global_batch_size=16",
        "train.micro_batch_size=16", "train.max_steps=80", "optim.lr=1e-2", "optim.min_lr=1e-3",
        "optim.warmup_steps=10", "strategy.name=single", "train.log_every=80", f"train.out_dir={tmp_path}"])
    weights = train(cfg, fresh=True, return_weights=True)["weights"]
    model = build_model(cfg.model, seed=0)
    start = losses(model)
    model.load_state_dict(weights, strict=False)  # a tied head is not listed twice
    return {"start": start, "end": losses(model)}


@pytest.fixture
def runs(tmp_path, group, monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a tiny model: more threads only contend on a shared machine
    torch.set_num_threads(1)
    yield {kind: run(write_folder(tmp_path / kind, kind == "masked"), tmp_path / f"run-{kind}", group)
            for kind in ("masked", "plain")}
    torch.set_num_threads(threads)


def test_a_masked_run_learns_the_answers_and_not_the_prompts(runs):
    (p0, a0), (p, a) = runs["masked"]["start"], runs["masked"]["end"]
    (q0, _), (q, b) = runs["plain"]["start"], runs["plain"]["end"]
    print(f"masked: prompt {p0:.3f} -> {p:.3f}, answer {a0:.3f} -> {a:.3f}; "
          f"unmasked: prompt {q0:.3f} -> {q:.3f}, answer -> {b:.3f}")
    assert p0 == pytest.approx(np.log(V), rel=0.1) and a0 == pytest.approx(np.log(V), rel=0.1)
    assert a < 0.2  # the answers are learned
    assert p > 0.75 * p0  # the prompts are not
    assert q < 0.5 * q0 and q < p - 1.0  # an unmasked run of the same length learns them: the difference
