"""The reference every strategy must match: one process, plain torch.optim.AdamW, the global batch.

LLAMA: the overrides (on top of conftest's TINY) of the small llama the strategy tests train: 2 layers,
4 query heads sharing 2 key/value heads (GQA), SwiGLU width 64, an untied head."""

from __future__ import annotations

import torch

from zerodp.config import Config
from zerodp.data.batches import TokenBatches, load_tokens
from zerodp.models import build_model
from zerodp.optim import param_groups
from zerodp.optim.schedules import lr_at

WEIGHT_TOLERANCE = 5e-5
"""Largest |weight difference| from the reference after a few steps at the tiny config's lr of 1e-2
(losses still agree to 1e-5). Adam divides each update by sqrt(v): where the exact gradient is zero
(the attention key bias: softmax ignores a constant added to every score of a query), the rounding
noise of another summation order is normalised into steps of up to the learning rate. Measured up to
3.2e-5 (ddp at world 2, 10 steps); how much depends on the draw of the initial weights. A wrong
gradient or a lost update moves weights by 1e-3 and more. tests/distributed/test_equivalence.py runs at lr 1e-3
and holds every weight to 1e-5."""

LLAMA = ["model.arch=llama", "model.n_layer=2", "model.n_embd=32", "model.n_head=4", "model.n_kv_head=2",
         "model.intermediate_size=64", "model.tie_embeddings=false"]


def reference_run(cfg: Config, extra_loss=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train on the full global batch of every step in one forward/backward; return losses and weights.
    `extra_loss(model, data, step)`, when given, is added to what is backpropagated after the forward (an
    MoE's balance loss: tests.support.moe_workers.moe_reference); the losses returned stay the LM loss."""
    torch.manual_seed(cfg.train.seed)  # as the loop does
    model = build_model(cfg.model, cfg.train.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(param_groups(model, cfg), lr=lr_at(cfg, 0), betas=(o.beta1, o.beta2), eps=o.eps)
    data = TokenBatches(load_tokens(cfg), cfg, "train")
    G = cfg.train.global_batch_size
    losses = []
    for step in range(cfg.train.max_steps):
        # (x, y), or (x, y, doc_ids) under document masking; with dropout, the rows' keys (zerodp.models.dropout)
        keys = {"dropout_keys": data.dropout_keys(step, range(G))} if data.dropout_seed is not None else {}
        loss = model(*data.rows(data.offsets(step, G)), **keys)
        (loss if extra_loss is None else loss + extra_loss(model, data, step)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip > 0 else float("inf"))
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
