"""Keyed dropout: every mask zerodp applies is a pure function of (train.seed, the optimizer step, the
sample's row in the global batch, the position along the sequence, the feature, the site), never of the
rank, the world size, the micro batch, the accumulation or of how a strategy uses torch's random stream.

torch's dropout draws from a generator: a row's mask then depends on what was drawn before it (the rows
ahead of it in its micro batch, the micro batches before, ZeRO-3's and activation checkpointing's own
draws), so one process and N processes drop different units. Here each element's keep bit is a hash:

    row key   = hash(seed, step, global row)      `row_keys`, where the data knows the row (zerodp.data.batches)
    h         = hash(row key, site)               per row; site: hash of the dropout module's name
    h         = hash(h, index) along each further dimension (position, feature; for attention probabilities
                head, query position, key position)
    keep      = h >= p * 2**32, kept values scaled by 1 / (1 - p)

The hash is a 32-bit integer finaliser (lowbias32) on int64 tensors whose values stay below 2**32, its
multiplications split in 16-bit halves so that no product overflows: pure tensor ops, the same bits on
the CPU, on CUDA and under torch.compile, and recomputed identically by activation checkpointing.

`DecoderLM.forward` takes the rows' keys (`dropout_keys`, (B,) int64) and holds them for the blocks it
runs (`rows`); each `KeyedDropout` module reads them there. A context rather than an argument: a LoRA
adapter's dropout sits inside an nn.Linear that the attention calls as `q_proj(x)`. The keys are set
inside the function activation checkpointing recomputes, so its second forward sees the same keys.
Without `dropout_keys` a training forward draws the rows' keys from torch's generator (one draw per
forward): random as torch's dropout is, but no longer a function of the layout."""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), int64, without an int64 overflow: c in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons' integer hash): a bijection of [0, 2**32) that scatters every input bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: int, step: int, rows) -> torch.Tensor:
    """The dropout key (int64 in [0, 2**32), on the CPU) of global-batch rows `rows` (integers) of
    optimizer step `step` of a run seeded `seed`."""
    rows = torch.as_tensor(rows, dtype=torch.int64)
    h = mix32(torch.tensor(seed & MASK32, dtype=torch.int64)) ^ ((seed >> 32) & MASK32)
    h = mix32(mix32(h) ^ (step & MASK32))
    return mix32(h ^ (rows & MASK32))


def drops(model_cfg) -> bool:
    """Whether the model section `model_cfg` trains with dropout (model.dropout or model.lora.dropout):
    whether training batches carry their rows' keys."""
    lora = model_cfg.lora if isinstance(getattr(model_cfg, "lora", None), dict) else {}
    return model_cfg.dropout > 0 or bool(lora.get("dropout"))


def site_id(name: str) -> int:
    """A dropout site's id: a 32-bit hash of its module's name (`model.layers.0.mlp.drop`)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")


CHUNK = 1 << 24
"""Elements whose int64 hashes are computed at once: a larger mask (attention probabilities, (B, heads,
T, T)) is hashed a slice of its second dimension at a time, so the transient int64 tensors stay near
CHUNK x 8 bytes each rather than 8 bytes per element of the whole mask."""


def keep_mask(keys: torch.Tensor, shape: torch.Size, p: float, site: int) -> torch.Tensor:
    """The keep bits (bool, `shape`, on keys' device) for rows keyed `keys` (shape[0],): element
    (b, i, j, ...) kept unless hash(keys[b], site, i, j, ...) falls below p * 2**32."""
    assert keys.shape == shape[:1], f"dropout keys {tuple(keys.shape)} for a tensor {tuple(shape)}"
    threshold = min(int(p * 2**32), MASK32)
    h = mix32(mix32(keys) ^ site)  # (B,)
    if len(shape) == 1:
        return h >= threshold
    h = mix32(h[:, None] ^ torch.arange(shape[1], device=keys.device))  # (B, n1)
    rest = math.prod(shape[2:])
    step = max(1, CHUNK // max(1, shape[0] * rest))  # slices of the second dimension hashed at once
    if step >= shape[1]:
        return _hash_rest(h, shape[2:]) >= threshold
    out = torch.empty(shape, dtype=torch.bool, device=keys.device)
    for a in range(0, shape[1], step):
        out[:, a : a + step] = _hash_rest(h[:, a : a + step], shape[2:]) >= threshold
    return out


def _hash_rest(h: torch.Tensor, dims: torch.Size) -> torch.Tensor:
    for n in dims:
        h = mix32(h[..., None] ^ torch.arange(n, device=h.device))  # (..., n)
    return h


def keyed_dropout(x: torch.Tensor, p: float, keys: torch.Tensor, site: int) -> torch.Tensor:
    """x with the elements `keep_mask` drops zeroed and the rest scaled by 1 / (1 - p); x's rows are
    keys' rows (x: (B, ...), keys: (B,))."""
    if p == 0:
        return x
    keep = keep_mask(keys, x.shape, p, site)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


class _Rows:
    keys: torch.Tensor | None = None
    """The (B,) row keys of the blocks running now (`rows`)."""


_ROWS = _Rows()


@contextmanager
def rows(keys: torch.Tensor | None):
    """Hold `keys` (B,) for the KeyedDropout modules that run inside (None: the model drops nothing)."""
    before, _ROWS.keys = _ROWS.keys, keys
    try:
        yield
    finally:
        _ROWS.keys = before


class KeyedDropout(nn.Module):
    """Dropout with probability `p` at site `site` (set by `name_sites` from the module's name), keyed by
    the rows' keys `rows` holds. Off outside training and at p = 0."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.site: int | None = None

    def active(self) -> bool:
        return self.training and self.p > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active():
            return x
        return keyed_dropout(x, self.p, self._keys(), self.site)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Causal attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) (each kv head serving nh / nkv
        consecutive query heads) with this dropout on the attention probabilities, keyed by (row, head,
        query position, key position): softmax(q k^T / sqrt(hd) + mask) computed explicitly, where SDPA's
        dropout_p would draw from torch's generator. `mask`: an additive (B, 1, T, T) document mask
        (zerodp.models.docmask, causal already), or None for causal attention."""
        B, nh, T, hd = q.shape
        if k.shape[1] != nh:
            k = k.repeat_interleave(nh // k.shape[1], dim=1)  # (B, nh, T, hd)
            v = v.repeat_interleave(nh // v.shape[1], dim=1)
        scores = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(hd))  # (B, nh, T, T)
        if mask is None:
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, -math.inf)
        else:
            scores = scores + mask.float()
        probs = self(F.softmax(scores, dim=-1).to(q.dtype))  # (B, nh, T, T)
        return probs @ v  # (B, nh, T, hd)

    def _keys(self) -> torch.Tensor:
        keys = _ROWS.keys
        assert keys is not None and self.site is not None, "KeyedDropout runs inside DecoderLM.forward"
        return keys

    def extra_repr(self) -> str:
        return f"p={self.p}"


def name_sites(model: nn.Module) -> bool:
    """Give every KeyedDropout of `model` its site (`site_id` of its name in `model`); whether one drops
    (p > 0)."""
    found = False
    for name, module in model.named_modules():
        if isinstance(module, KeyedDropout):
            module.site = site_id(name)
            found = found or module.p > 0
    return found
