"""What every architecture's model shares: the forward pass over blocks (with activation checkpointing:
zerodp.models.recompute), the loss (the head's: zerodp.models.loss), generation (and its key/value cache,
`KVCache`), the names of tied weights, and the initial weights. A family implements `embed(idx, start,
positions)`, `run_block(block, x, kv, mask)`, `head(x, targets=None)` (the final norm, then its
`zerodp.models.loss.LMHead`), `blocks` and names its `RESIDUAL_PROJECTIONS`; the loop and the strategies
see only this. Document masking (`doc_ids`) is zerodp.models.docmask's; dropout is keyed by the rows
(`dropout_keys`), the position, the feature and the site, whatever the layout (zerodp.models.dropout).

Initial weights do not depend on the layout: parameter `name`'s initial values are a pure function of
(train.seed, name), cut in blocks of INIT_BLOCK elements of the flattened parameter, each block drawn
from its own generator seeded by (seed, name, block index). A rank that keeps elements [start, stop) of a
parameter (a ZeRO-3 partition, an FSDP shard) draws only the blocks that overlap them, and gets exactly
the values one process holding the whole model has there (`DecoderLM.initial_values`)."""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerodp.models import docmask, dropout, recompute
from zerodp.models.lora_spec import adapter_shapes, lora_spec
from zerodp.models.loss import IGNORE_INDEX

INIT_BLOCK = 1 << 20
"""Elements per independently seeded block of a parameter's initial values."""


def _block_generator(seed: int, name: str, block: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def normal_range(seed: int, name: str, numel: int, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of parameter `name`'s N(0, 1) draws (numel in all), fp32 on the CPU. Each
    overlapping block is drawn whole (torch's CPU normal sampler is not prefix-stable) and sliced."""
    out = torch.empty(stop - start, device="cpu")
    for block in range(start // INIT_BLOCK, (stop - 1) // INIT_BLOCK + 1 if stop > start else 0):
        lo, hi = block * INIT_BLOCK, min((block + 1) * INIT_BLOCK, numel)
        values = torch.randn(hi - lo, generator=_block_generator(seed, name, block), device="cpu")
        a, b = max(lo, start), min(hi, stop)
        out[a - start : b - start] = values[a - lo : b - lo]
    return out


class LayerKV:
    """One block's cached keys and values (B, n_kv_head, S, head_dim), in the compute dtype."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Append this forward's keys and values; return all of them so far and whether the attention is
        causal over them: a prefill (nothing cached before) is, one new token attends to every cached one.
        Several new tokens over a non-empty cache would need a bottom-right causal mask: not used."""
        if self.k is None:
            self.k, self.v = k, v
            return k, v, True
        assert k.shape[2] == 1, "after the prefill the cache takes one token at a time"
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        return self.k, self.v, False


class KVCache:
    """Keys and values of every block for the tokens run so far: generation runs the prompt once (the
    prefill), then each new token alone, attending to the cache, instead of re-running the whole sequence
    per token. Positions continue from `pos`; a sequence longer than block_size cannot continue (the
    caller starts over without a cache: zerodp.trainer.sample)."""

    def __init__(self, n_layer: int):
        self.layers = [LayerKV() for _ in range(n_layer)]
        self.pos = 0
        """Tokens cached so far: the position of the next token."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV | None,
           enable_gqa: bool = False) -> torch.Tensor:
    """Causal SDPA of q over k, v (B, heads, T, hd), through the block's cache `kv` when generating. No
    dropout: attention dropout is zerodp.models.dropout.KeyedDropout.attend's."""
    causal = True
    if kv is not None:
        k, v, causal = kv.extend(k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa)


class DecoderLM(nn.Module):
    cfg: object
    """The model section it was built from (`zerodp.config.ModelConfig`)."""
    arch: object
    """Its `zerodp.models.arch.Arch`: names, shapes and counts."""

    RESIDUAL_PROJECTIONS: tuple[str, ...] = ()
    """Name suffixes of the weights that write into the residual stream."""
    _drops: bool | None = None
    """Whether a KeyedDropout of the model drops (p > 0); None until their sites are named."""

    def initial_values(self, name: str, seed: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements [start, stop) of parameter `name`'s flattened initial fp32 values, on the CPU.

        GPT-2's init for every family: N(0, 0.02) matrices, the residual projections scaled by
        1/sqrt(2 * n_layer); norm weights 1, biases 0; low-rank adapters as zerodp.models.lora_spec says.
        A pure function of (seed, name): identical whatever the strategy, world size or device."""
        shape = self._shapes()[name]
        numel = math.prod(shape)
        stop = numel if stop is None else stop
        if name.endswith(".lora_B.weight"):  # B = 0: step 0 computes the base model
            return torch.zeros(stop - start, device="cpu")
        if name.endswith(".lora_A.weight"):  # (rank, in): PEFT's kaiming-uniform variance, 1 / (3 in)
            return normal_range(seed, name, numel, start, stop).mul_(1.0 / math.sqrt(3 * shape[1]))
        if name.endswith(self.RESIDUAL_PROJECTIONS):
            return normal_range(seed, name, numel, start, stop).mul_(0.02 / math.sqrt(2 * self.arch.n_layer))
        if len(shape) >= 2:
            return normal_range(seed, name, numel, start, stop).mul_(0.02)
        if name.endswith("bias"):
            return torch.zeros(stop - start, device="cpu")
        return torch.ones(stop - start, device="cpu")  # LayerNorm / RMSNorm weight

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        if not hasattr(self, "_param_shapes"):
            self._param_shapes = self.arch.param_shapes()
            spec = lora_spec(getattr(self.cfg, "lora", None))
            if spec is not None:
                self._param_shapes.update(adapter_shapes(self.arch, spec))
        return self._param_shapes

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter of a materialised, unsharded model with its initial values."""
        for name, p in self.named_parameters():
            p.view(-1).copy_(self.initial_values(name, seed))

    def tie_weights(self) -> None:
        """Point each tied alias at its stored parameter again (`to_empty` makes a new tensor per module)."""
        for alias, stored in self.tied_weights().items():
            owner, _, attr = alias.rpartition(".")
            setattr(self.get_submodule(owner), attr, self.get_parameter(stored))

    def tied_weights(self) -> dict[str, str]:
        """alias -> stored name for weights shared by two modules (the tied head), as checkpoints record."""
        return self.arch.tied_weights()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, dropout_keys: torch.Tensor | None = None) -> torch.Tensor:
        """Return the mean cross-entropy over all tokens if targets are given, else the logits (B, T, V).
        With `doc_ids` (B, T), integer and non-decreasing along T (a new value starts a document; a row's
        first token starts one), attention stays within each document and positions restart at 0 at each
        (zerodp.models.docmask): a packed sample computes what its documents alone would. One mask is built
        here, shared by every block. With a `cache` (generation, no gradients, no doc_ids) `idx` continues
        the cached tokens: positions start at cache.pos, each block attends to its cached keys and values
        and appends idx's. `dropout_keys` (B,) int64: each row's dropout key in training
        (zerodp.models.dropout.row_keys of its global-batch row; drawn from torch's generator when not
        given); ignored outside training or without dropout."""
        keys = self._row_keys(idx, dropout_keys)
        start = cache.pos if cache is not None else 0
        if doc_ids is None:
            x, extra = self.embed(idx, start), ()  # (B, T, C)
        else:
            assert cache is None and doc_ids.shape == idx.shape, "doc_ids: (B, T) like idx, without a cache"
            x = self.embed(idx, 0, docmask.document_positions(doc_ids))
            kind = docmask.kernel(self.cfg.document_attention, x.device, self.cfg.dropout if self.training else 0.0)
            extra = (None, docmask.document_mask(doc_ids, kind, docmask.compute_dtype(x)))  # (kv, mask)
        recomputed = recompute.checkpoint_options(self.cfg.activation_checkpointing) if self.training else None
        for i, block in enumerate(self.blocks()):
            if recomputed is not None:  # the keys are set inside what is recomputed: the same masks again
                x = checkpoint(self._run_keyed, keys, block, x, *extra, use_reentrant=False, **recomputed)
            elif extra:
                x = self._run_keyed(keys, block, x, *extra)
            else:
                x = self._run_keyed(keys, block, x, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.pos += idx.shape[1]
        if targets is None:
            return self.head(x)  # (B, T, V)
        # The mean over the target tokens: y is IGNORE_INDEX (-100) where a loss mask says the token is no
        # target. Summed (by the head: whole or in chunks, zerodp.models.loss) and divided by the count (at
        # least 1, without a host sync) rather than F.cross_entropy's mean, which is NaN for a micro batch
        # without targets: that one adds 0.
        total = self.head(x, targets)
        return total / (targets != IGNORE_INDEX).sum().clamp(min=1)

    def _run_keyed(self, keys: torch.Tensor | None, block: nn.Module, x: torch.Tensor, *args) -> torch.Tensor:
        with dropout.rows(keys):
            return self.run_block(block, x, *args)

    def _row_keys(self, idx: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor | None:
        """The rows' dropout keys (B,) on idx's device, or None where nothing drops (eval, p = 0)."""
        if self._drops is None:  # once: the sites' names are the model's own, whatever wraps it later
            self._drops = dropout.name_sites(self)
        if not (self.training and self._drops):
            return None
        if given is None:  # a caller without the data's keys (not the loop): random, as torch's dropout
            return torch.randint(0, dropout.MASK32 + 1, idx.shape[:1], device=idx.device)
        assert given.shape == idx.shape[:1], f"dropout_keys {tuple(given.shape)} for rows {tuple(idx.shape)}"
        return given.to(idx.device)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, top_k: int = 50) -> torch.Tensor:
        for _ in range(new_tokens):
            logits = self(idx[:, -self.arch.block_size :])[:, -1, :].float() / temperature  # (B, V)
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx
