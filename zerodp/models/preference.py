"""Preference losses (train.objective=dpo): each pair's loss and rewards from the sequence log-probabilities
of its chosen and rejected completions under the policy and the reference, as TRL 1.16 computes them
(DPOTrainer._compute_loss for sigmoid and ipo, CPOTrainer.cpo_loss for simpo; tests/unit/test_preference_loss.py
holds zerodp's to trl's own code at 1e-6).

With s = the completion's summed token log-prob, n its tokens, pi the policy, ref the reference, beta > 0:

    sigmoid  d = (s_pi(c) - s_ref(c)) - (s_pi(r) - s_ref(r))
             loss = -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)   (eps: label_smoothing, cDPO)
    ipo      d = (s_pi(c) - s_ref(c)) / n(c) - (s_pi(r) - s_ref(r)) / n(r)
             loss = (d - 1 / (2 beta))^2
    simpo    d = s_pi(c) / n(c) - s_pi(r) / n(r) - gamma / beta                  (no reference)
             loss = -(1 - eps) log sigmoid(beta d) - eps log sigmoid(-beta d)

Rewards are beta (s_pi - s_ref) per completion for sigmoid and ipo, beta s_pi / n for simpo; TRL's logged
logps/chosen and logps/rejected are s_pi (sigmoid, ipo) and s_pi / n (simpo). TRL 1.16's DPO sigmoid takes
label_smoothing and leaves it out; zerodp applies it as above (the conservative-DPO form, which TRL's CPO
sigmoid computes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)

IGNORE_INDEX = -100


def completion_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's targets (B,) fp32, their count (B,) fp32) from logits (B, T, V) and
    targets (B, T), IGNORE_INDEX where a token is no completion's."""
    valid = targets != IGNORE_INDEX                                    # (B, T)
    logp = torch.log_softmax(logits.float(), dim=-1)                   # (B, T, V)
    token = logp.gather(-1, targets.masked_fill(~valid, 0)[..., None]).squeeze(-1)  # (B, T)
    return (token * valid).sum(dim=1), valid.sum(dim=1).float()


def pair_losses(loss: str, beta: float, label_smoothing: float, gamma: float,
                policy: torch.Tensor, reference: torch.Tensor | None, tokens: torch.Tensor):
    """(loss per pair (P,), chosen rewards (P,), rejected rewards (P,), chosen logps (P,), rejected logps (P,))
    from the rows' summed completion log-probs `policy` (2P,) and `reference` (2P,) (None for simpo) and
    their completion token counts `tokens` (2P,); rows alternate chosen, rejected."""
    pc, pr = policy[0::2], policy[1::2]                                 # (P,)
    nc, nr = tokens[0::2].clamp(min=1), tokens[1::2].clamp(min=1)
    if loss in REFERENCE_FREE:
        ac, ar = pc / nc, pr / nr
        d = beta * (ac - ar - gamma / beta)
        losses = -F.logsigmoid(d) * (1 - label_smoothing) - F.logsigmoid(-d) * label_smoothing
        return losses, beta * ac.detach(), beta * ar.detach(), ac.detach(), ar.detach()
    rc, rr = reference[0::2], reference[1::2]
    lc, lr = pc - rc, pr - rr                                           # the log-ratios (P,)
    if loss == "sigmoid":
        d = beta * (lc - lr)
        losses = -F.logsigmoid(d) * (1 - label_smoothing) - F.logsigmoid(-d) * label_smoothing
    elif loss == "ipo":
        losses = (lc / nc - lr / nr - 1 / (2 * beta)) ** 2
    else:
        raise AssertionError(f"dpo.loss {loss!r} passed validation")
    return losses, beta * lc.detach(), beta * lr.detach(), pc.detach(), pr.detach()


SIMPO_GAMMA = 0.5
"""dpo.simpo_gamma's value when unset: TRL's CPOConfig default."""

STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
         "logps/rejected")
"""The per-step metrics, TRL's names: each the mean over the global batch's pairs."""


def batch_loss(dpo, policy: torch.Tensor, reference: torch.Tensor | None, tokens: torch.Tensor, pairs: int,
               chosen_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this micro batch's share of the step's loss, a 0-d tensor; the sums over its pairs of STATS (6,)).

    The step's loss is the mean of `pair_losses` over the `pairs` pairs of the global batch, plus
    dpo.rpo_alpha times the mean negative log-prob of the global batch's `chosen_tokens` chosen completion
    tokens (RPO; TRL's "sft" loss term): each micro batch contributes its sums over those global counts,
    so no world size, micro batch or accumulation changes the step's loss. `dpo`: the config's dpo section."""
    gamma = SIMPO_GAMMA if dpo.simpo_gamma is None else dpo.simpo_gamma
    losses, rc, rr, lc, lr = pair_losses(dpo.loss, dpo.beta, dpo.label_smoothing, gamma, policy, reference, tokens)
    loss = losses.sum() / pairs
    if dpo.rpo_alpha:
        loss = loss - dpo.rpo_alpha * policy[0::2].sum() / max(chosen_tokens, 1)
    stats = torch.stack([rc.sum(), rr.sum(), (rc - rr).sum(), (rc > rr).float().sum(), lc.sum(), lr.sum()])
    return loss, stats
