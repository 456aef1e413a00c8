"""The end-of-run sample: a few tokens generated from the final weights, printed by rank 0."""

from __future__ import annotations

import torch

from zerodp.config import Config
from zerodp.dist import DistEnv
from zerodp.models import build_model


def sample(strategy, cfg: Config, env: DistEnv) -> str:
    """Generate from the final weights (gathered in full on every rank; printed by rank 0)."""
    weights = strategy.full_state_dict()
    if env.rank != 0:
        return ""
    model = build_model(cfg.model, device="meta")
    model.to_empty(device="cpu")
    model.tie_weights()
    model.load_state_dict(weights, strict=not model.tied_weights())  # a tied alias is not in `weights`
    model.eval()
    prompt = torch.tensor([list(b"def ")], dtype=torch.long) if cfg.model.vocab_size >= 256 else \
        torch.zeros((1, 1), dtype=torch.long)
    torch.manual_seed(cfg.train.seed)
    out = model.generate(prompt, cfg.train.sample_tokens)[0].tolist()
    if cfg.model.vocab_size >= 256 and max(out) < 256:
        return bytes(out).decode("utf-8", errors="replace")
    return " ".join(map(str, out))
