"""What every architecture's model shares: the forward pass over blocks (with activation
checkpointing), the loss, generation, and the names of tied weights. A family implements `embed`,
`run_block`, `head`, `blocks` and `reset_parameters`; the loop and the strategies see only this."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class DecoderLM(nn.Module):
    cfg: object
    """The model section it was built from (`zerodp.config.ModelConfig`)."""
    arch: object
    """Its `zerodp.models.arch.Arch`: names, shapes and counts."""

    RESIDUAL_PROJECTIONS: tuple[str, ...] = ()
    """Name suffixes of the weights that write into the residual stream."""

    def reset_parameters(self) -> None:
        """GPT-2's init for every family: N(0, 0.02) matrices, the residual projections scaled by
        1/sqrt(2 * n_layer); norm weights 1, biases 0."""
        import math

        for name, p in self.named_parameters():
            if name.endswith(self.RESIDUAL_PROJECTIONS):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.arch.n_layer))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm / RMSNorm weight
                nn.init.ones_(p)

    def tied_weights(self) -> dict[str, str]:
        """alias -> stored name for weights shared by two modules (the tied head), as checkpoints record."""
        return self.arch.tied_weights()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Return the mean cross-entropy over all tokens if targets are given, else the logits (B, T, V)."""
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks():
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(self.run_block, block, x, use_reentrant=False)
            else:
                x = self.run_block(block, x)
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, top_k: int = 50) -> torch.Tensor:
        for _ in range(new_tokens):
            logits = self(idx[:, -self.arch.block_size :])[:, -1, :].float() / temperature  # (B, V)
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx
