"""The end-of-run sample: a few tokens generated through the trained, still sharded model.

Generation runs on every rank through `strategy.model`, the module the training loop calls (the DDP
wrapper, the DeepSpeed engine, the FSDP-wrapped model), so under zero3 and fsdp each forward gathers
one block at a time exactly as training did: nothing after training needs more memory than training
did (no full fp32 copy of the weights on any rank). Every rank must therefore run the same forward
calls in the same order: each step's token is drawn on every rank from the same seeded generator and
then broadcast from rank 0, so the ranks' sequences, and so their forwards, never diverge.

Decoding keeps a key/value cache (zerodp.models.common.KVCache): the prompt runs once, then each new
token alone through every block, attending to the cached keys and values, instead of re-running the
whole sequence per token. Under zero3 and fsdp each token still gathers every block once (the cache
saves the compute over the sequence and its activations, not the gathers). Once the sequence is longer
than block_size, each token re-runs the last block_size tokens from position 0, without a cache, as
`generate` does; `cache=False` decodes that way throughout (the reference the cached path is tested
against: the same greedy tokens).

Sampling is DecoderLM.generate's (temperature 0.8, top-k 50, one multinomial draw per token, on the
CPU from a generator seeded with train.seed): the same weights give the same tokens as `generate`
on one process after `torch.manual_seed(train.seed)` (tests/distributed/test_sample.py).

Text: for a `zerodp prepare` folder the sample is decoded with the tokenizer meta.json names (after its
sha256 is checked; a tokenizer gone or changed gives the ids with a note saying why) and the prompt is
the end-of-text token (the start of a new document), or "The" encoded when there is none; otherwise
bytes for a byte-level vocabulary, else token ids.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerodp.config import Config
from zerodp.config.sources import primary_source
from zerodp.data.batches import prepared_meta
from zerodp.distributed.process_group import DistEnv

TEMPERATURE = 0.8
TOP_K = 50


def tokenizer_of(meta: dict):
    """(the `tokenizers.Tokenizer` a prepare meta.json names, None) when its file is there with the
    recorded sha256; else (None, why not)."""
    rec = meta.get("tokenizer") or {}
    path = Path(rec.get("path") or "")
    if not rec.get("path") or not path.is_file():
        return None, f"tokenizer {rec.get('path')} not found"
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != rec.get("sha256"):
        return None, f"tokenizer {path} changed since zerodp prepare (sha256 differs)"
    from tokenizers import Tokenizer

    return Tokenizer.from_str(data.decode("utf-8")), None


def prompt_tokens(cfg: Config) -> list[int]:
    """For a prepared folder its end-of-text token (else "The" encoded, else token 0); `def ` as bytes
    for a byte-level (or larger) vocabulary; else token 0."""
    meta = prepared_meta(primary_source(cfg.data))
    if meta is not None:
        if meta.get("eot_id") is not None:
            return [int(meta["eot_id"])]
        tok, _ = tokenizer_of(meta)
        return (tok.encode("The", add_special_tokens=False).ids if tok is not None else None) or [0]
    return list(b"def ") if cfg.model.vocab_size >= 256 else [0]


def decode(cfg: Config, tokens: list[int]) -> str:
    """Text via a prepared folder's tokenizer; text for a byte-level sample; else the token ids
    separated by spaces (for a prepared folder after a line saying why the tokenizer was not used)."""
    meta = prepared_meta(primary_source(cfg.data))
    if meta is not None:
        tok, why = tokenizer_of(meta)
        if tok is not None:
            return tok.decode(tokens, skip_special_tokens=False)
        return f"({why}: token ids)\n" + " ".join(map(str, tokens))
    if cfg.model.vocab_size >= 256 and max(tokens) < 256:
        return bytes(tokens).decode("utf-8", errors="replace")
    return " ".join(map(str, tokens))


def next_token(logits: torch.Tensor, generator: torch.Generator, temperature: float = TEMPERATURE,
               top_k: int = TOP_K) -> torch.Tensor:
    """One draw from the last position's logits (B, V) on the CPU: temperature, then top-k (0: the whole
    vocabulary); temperature 0 takes the most likely token. (B, 1)"""
    if temperature <= 0:
        return logits.float().cpu().argmax(dim=-1, keepdim=True)
    logits = logits.float().cpu() / temperature
    v, _ = torch.topk(logits, min(top_k or logits.size(-1), logits.size(-1)))
    logits[logits < v[:, [-1]]] = -float("inf")
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def next_logits(model, idx: torch.Tensor, kv, block: int, device: torch.device):
    """(logits (1, T, V), the cache to pass next) for the sequence `idx` (1, T) on the CPU: with a
    KVCache `kv` the prompt, then only the newest token; past block_size tokens (or without a cache) the
    last block_size tokens from position 0, re-run for each new token, the cache then dropped."""
    if kv is not None and idx.shape[1] > block:
        kv = None
    if kv is None:
        return model(idx[:, -block:].to(device)), None
    return model(idx[:, kv.pos:].to(device), cache=kv), kv


def generate_tokens(strategy, cfg: Config, env: DistEnv, new_tokens: int, temperature: float = TEMPERATURE,
                    cache: bool = True) -> list[int]:
    """Collective: the prompt and `new_tokens` tokens generated through `strategy.model` on every rank
    (temperature 0: greedy), with a key/value cache unless `cache` is False.

    Eval mode, no gradients, the strategy's autocast; the module's train/eval mode is restored after."""
    from zerodp.models.common import KVCache

    model = strategy.model
    was_training = model.training
    generator = torch.Generator().manual_seed(cfg.train.seed)
    idx = torch.tensor([prompt_tokens(cfg)], dtype=torch.long)  # (1, T) on the CPU
    block = cfg.model.block_size
    broadcast = dist.is_initialized() and dist.get_world_size() > 1
    kv = KVCache(cfg.model.n_layer) if cache else None
    model.eval()
    try:
        for _ in range(new_tokens):
            with strategy.autocast():
                logits, kv = next_logits(model, idx, kv, block, env.device)
            token = next_token(logits[:, -1, :], generator, temperature)  # (1, 1)
            if broadcast:  # a CPU tensor: gloo carries it beside nccl
                dist.broadcast(token, src=0)
            idx = torch.cat([idx, token], dim=1)
    finally:
        model.train(was_training)
    return idx[0].tolist()


def sample(strategy, cfg: Config, env: DistEnv) -> str:
    """Collective: generate cfg.train.sample_tokens tokens from the trained weights through the
    (sharded) model on every rank; every rank returns the same text (rank 0 prints it)."""
    return decode(cfg, generate_tokens(strategy, cfg, env, cfg.train.sample_tokens))
