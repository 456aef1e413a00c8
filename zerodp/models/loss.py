"""The LM head and its loss (`LMHead`): the logits, or the summed cross-entropy of the targets, over the
whole logits at once or in chunks of tokens (`model.loss_chunks`, zerodp.models.chunking).

At a large vocabulary the logits dominate a step's memory: Llama 3's 128,256 logits per token at micro
batch 4 x 2048 are 1.05e9 values, 2.1 GB in bf16, 4.2 GB again as the fp32 the loss is taken in, and as
much for their gradient. The chunked loss (`ChunkedHeadLoss`, Liger's and torchtitan's idea in plain
PyTorch) computes, one chunk of tokens at a time in the forward pass, the chunk's logits, its loss and
the gradients of that loss with respect to the hidden states and the head weight, then drops the
logits: at most one chunk's exist at once, and the backward only scales the kept gradients by the
loss's gradient. No matmul is done twice (a recomputing loss would redo the head's forward).

The loss is computed inside the head module's forward so that ZeRO-3's and FSDP's gather hooks around
the module see its weight used (a tied head is the embedding's weight: the hooks gather it as for the
whole logits)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""A target that is not one (a loss mask's 0): F.cross_entropy's default ignore_index."""


class LMHead(nn.Linear):
    """nn.Linear(n_embd, vocab, bias=False) whose forward also takes the targets: `head(x)` is the logits
    (..., V), `head(x, targets)` the sum of the cross-entropy over the targets that are not IGNORE_INDEX,
    a 0-d fp32 tensor, in `chunks` chunks of tokens (0: the whole logits). Parameter names and layout are
    nn.Linear's."""

    def __init__(self, n_embd: int, vocab_size: int, chunks: int | str = 0):
        super().__init__(n_embd, vocab_size, bias=False)
        self.chunks = chunks
        """model.loss_chunks: a count or auto (zerodp.models.chunking.loss_chunks)."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)  # (..., V)
        from zerodp.models.chunking import loss_chunks

        x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)  # (N, C), (N,)
        chunks = loss_chunks(self.chunks, x.size(0), self.out_features, self.in_features)
        if chunks == 0:
            logits = super().forward(x)  # (N, V)
            return F.cross_entropy(logits.float(), targets, reduction="sum")
        return ChunkedHeadLoss.apply(x, self.weight, targets, chunks, torch.is_grad_enabled())


def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed cross-entropy of a chunk's logits (n, V) at `targets` (n,), the gradient of that sum with
    respect to the logits in their dtype (fp32 for fp16 logits: not yet multiplied by the loss scale, its
    small values would flush to zero in fp16's range), or None without `grad`): softmax - one-hot, zero on
    the rows whose target is IGNORE_INDEX."""
    z = logits.float()                                       # (n, V): the loss is taken in fp32
    lse = torch.logsumexp(z, dim=-1)                         # (n,)
    valid = targets != IGNORE_INDEX
    safe = targets.masked_fill(~valid, 0)[:, None]           # (n, 1)
    loss = ((lse - z.gather(1, safe).squeeze(1)) * valid).sum()
    if not grad:
        return loss, None
    z.sub_(lse[:, None]).exp_()                              # softmax, in place
    z.scatter_add_(1, safe, torch.full_like(safe, -1, dtype=z.dtype))
    z.mul_(valid[:, None])
    return loss, z if logits.dtype == torch.float16 else z.to(logits.dtype)


class ChunkedHeadLoss(torch.autograd.Function):
    """sum over tokens of cross_entropy(x @ weight.T, targets), x (N, C), weight (V, C), targets (N,), in
    `chunks` chunks of tokens; the gradients are computed chunk by chunk in the forward pass (in the
    logits' dtype, as linear's backward would, the weight's summed in fp32) and scaled in the backward.
    Under autocast the matmuls run in the autocast dtype, as the whole head's do."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int,
                grad_enabled: bool) -> torch.Tensor:
        want_x, want_w = grad_enabled and x.requires_grad, grad_enabled and weight.requires_grad
        grads = want_x or want_w
        total = torch.zeros((), device=x.device, dtype=torch.float32)
        grad_x = torch.empty_like(x) if want_x else None                                # (N, C)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if want_w else None  # (V, C)
        w = None
        N = x.size(0)
        for i in range(chunks):
            a, b = N * i // chunks, N * (i + 1) // chunks
            xc = x[a:b]                                      # (n, C)
            logits = F.linear(xc, weight)                    # (n, V), in the autocast dtype if any
            loss, g = _chunk_loss(logits, targets[a:b], grads)
            total += loss
            del logits
            if g is None:
                continue
            if w is None:
                w = weight.to(g.dtype)                       # (V, C), cast once for every chunk
            with torch.autocast(x.device.type, enabled=False):  # in g's dtype, as cast above
                if want_x:
                    grad_x[a:b] = g @ w                      # (n, C)
                if want_w:
                    grad_w += (g.t() @ xc.to(g.dtype)).float()  # (V, C)
        ctx.save_for_backward(*(t for t in (grad_x, grad_w) if t is not None))
        ctx.have = (want_x, want_w)
        ctx.dtypes = (x.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        want_x, want_w = ctx.have
        gx = next(saved) * grad_total.to(ctx.dtypes[0]) if want_x else None
        gw = (next(saved) * grad_total).to(ctx.dtypes[1]) if want_w else None
        return gx, gw, None, None, None
