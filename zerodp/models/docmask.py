"""Document masking: inside a packed sample (documents end to end, each followed by the end-of-text
token) attention never crosses a document boundary and positions restart at 0 at each document, so a
packed sample computes what each of its documents alone would.

    loss = model(x, y, doc_ids)     # doc_ids (B, T) integer, non-decreasing along T: a new value starts
                                    # a document; the first token of a row starts one (maybe cut)

`DecoderLM.forward` builds one mask from doc_ids per forward (`document_mask`) and hands the same
object to every block; each block's attention calls `attend_documents`. The kernel (model.document_attention):

- sdpa: torch's scaled_dot_product_attention with an additive mask (0 where the query may attend, -inf
  elsewhere: causal AND same document), (B, 1, T, T) in the compute dtype. Additive, not boolean: SDPA
  turns a boolean mask into a new float tensor on every call and saves it for backward, one per layer;
  the additive one is saved by reference, once. The CPU kernel, and the fallback.
- flex: torch.nn.attention.flex_attention with a BlockMask from create_block_mask (both compiled on
  CUDA, as torchtitan does): nothing T x T is materialised; the block mask is 8 small int32 tensors
  (zerodp.planner.activations.document_mask_bytes). No dropout, and no backward on the CPU (torch's
  flex_attention._validate_device).
- auto: flex on CUDA when attention dropout is off, else sdpa.

Nothing here syncs with the host: positions come from a running maximum over document starts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from zerodp.errors import ConfigError

FLEX_BLOCK = 128
"""create_block_mask's default block (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)."""

_compiled: dict[str, object] = {}


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (B, T), int64, on doc_ids's device, without a host sync:
    t minus the index of the latest document start at or before t (a start: t = 0 or a new doc id)."""
    B, T = doc_ids.shape
    t = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return t - torch.cummax(torch.where(starts, t, 0), dim=1).values


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def kernel(choice: str, device: torch.device, dropout: float) -> str:
    """'flex' or 'sdpa' for model.document_attention=`choice` on `device` with attention dropout
    `dropout` (0 outside training). Explicit flex where it cannot run raises the ConfigError."""
    if choice == "sdpa":
        return "sdpa"
    if choice == "auto":
        return "flex" if device.type == "cuda" and dropout == 0 and flex_available() else "sdpa"
    assert choice == "flex", choice
    if dropout:
        raise ConfigError(f"model.document_attention=flex has no attention dropout (model.dropout={dropout}); "
                          f"set model.document_attention=sdpa or model.dropout=0")
    if device.type == "cpu" and torch.is_grad_enabled():
        raise ConfigError("model.document_attention=flex: torch's flex attention has no backward on the CPU; "
                          "set model.document_attention=auto or sdpa")
    return "flex"


def _fn(name: str, device: torch.device):
    """flex_attention or create_block_mask: compiled once per process on CUDA (eager they materialise
    the T x T scores or mask), as they are elsewhere (the CPU runs them for tests, without gradients)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = flex_attention if name == "flex_attention" else create_block_mask
    if device.type != "cuda":
        return fn
    if name not in _compiled:
        _compiled[name] = torch.compile(fn)
    return _compiled[name]


def document_mask(doc_ids: torch.Tensor, kind: str, dtype: torch.dtype):
    """What every block's attention takes for these documents: for `kind` sdpa the additive mask
    (B, 1, T, T) in `dtype` (the dtype of q), for flex a BlockMask."""
    B, T = doc_ids.shape
    if kind == "flex":
        def same_document(b, h, q, k):
            return (q >= k) & (doc_ids[b, q] == doc_ids[b, k])

        return _fn("create_block_mask", doc_ids.device)(same_document, B, None, T, T, device=doc_ids.device)
    t = torch.arange(T, device=doc_ids.device)
    allowed = (t[:, None] >= t[None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])  # (B, T, T)
    zero = torch.zeros((), dtype=dtype, device=doc_ids.device)
    return torch.where(allowed, zero, torch.full((), -math.inf, dtype=dtype, device=doc_ids.device))[:, None]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the blocks' q, k, v will have for an embedding output `x`: autocast's, else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def attend_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool = False) -> torch.Tensor:
    """Attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd) under a `document_mask`, without dropout
    (with it: zerodp.models.dropout.KeyedDropout.attend, which takes the sdpa kind's mask). Grouped-query
    heads: flex takes them as they are; SDPA too on the CPU, while on CUDA k and v are repeated (SDPA's
    grouped-query support is the flash and math kernels', and flash takes no mask)."""
    if not isinstance(mask, torch.Tensor):  # a BlockMask
        return _fn("flex_attention", q.device)(q, k, v, block_mask=mask, enable_gqa=gqa)
    if gqa and q.device.type == "cuda":
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    if mask.dtype != q.dtype:  # not expected (compute_dtype): a copy per layer, but correct
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

