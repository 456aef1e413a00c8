"""Qwen3-MoE's module (`model.arch: qwen3_moe`; spec.py beside it): zerodp's Qwen3 (llama's blocks with
per-head q/k RMSNorm) whose sparse blocks' MLP is a mixture of SwiGLU experts (zerodp.models.moe:
router `gate`, stacked `experts.gate_up_proj` / `experts.down_proj`), as transformers'
Qwen3MoeForCausalLM; the blocks `model.moe.mlp_only_layers` / `decoder_sparse_step` name keep Llama's
dense MLP. Names and layouts are transformers' in memory (its files hold one tensor per expert:
zerodp.convert.experts).

The balance loss (zerodp.models.moe_spec) is computed by the training forward beside the LM loss:
`forward` returns the LM loss, as every family's, and leaves the balance loss on `balance_loss` and the
term to add to it for the backward pass, router_aux_loss_coef x balance, on `aux_loss` (0-d tensors on
the device: nothing is read on the host). The loop adds `aux_loss` where it exists (dense families have
none) and logs `balance_loss` apart."""

from __future__ import annotations

import torch

from zerodp.models.moe import RouterLog, SparseMoeBlock
from zerodp.models.moe_spec import moe_spec
from zerodp.models.qwen3.model import Qwen3


class Qwen3Moe(Qwen3):
    RESIDUAL_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.moe = moe_spec(getattr(cfg, "moe", None))
        self.router_log = RouterLog()
        a = self.arch
        for i, block in enumerate(self.model.layers):
            if a.is_moe_layer(i):  # Llama's dense MLP replaced (on the meta device: nothing allocated)
                block.mlp = SparseMoeBlock(a.n_embd, a.expert_ffn, self.moe, self.router_log)
        self.balance_loss: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, idx, targets=None, doc_ids=None, cache=None, **kwargs):
        """DecoderLM's forward (its keywords, dropout_keys among them); a training forward with targets also
        sets `balance_loss` and `aux_loss`."""
        log = self.router_log
        log.start(recording=targets is not None and self.training)
        try:
            out = super().forward(idx, targets, doc_ids, cache, **kwargs)
        finally:
            log.recording = False
        if log.layers:
            self.balance_loss = log.balance(self.moe.balance)
            self.aux_loss = self.moe.router_aux_loss_coef * self.balance_loss
        else:
            self.balance_loss = self.aux_loss = None
        log.start(recording=False)  # the recorded tensors are the model's now, not the log's
        return out
