"""zerodp's preference losses equal TRL 1.16's own code (fp32, 1e-6): DPOTrainer._compute_loss for sigmoid,
ipo and sigmoid with the RPO term (its "sft" loss type), CPOTrainer.cpo_loss for simpo and for sigmoid with
label smoothing (the conservative-DPO form, which TRL's DPO sigmoid leaves out), on the same per-token
log-probs; the step's loss does not depend on how the pairs are split into micro batches."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from zerodp.models.preference import STATS, batch_loss

P, T = 6, 9


def data(seed=0):
    """(per-token log-probs of the policy and the reference (2P, T), completion masks (2P, T)); rows
    alternate chosen, rejected; completions of 1 to T tokens after a prompt."""
    g = torch.Generator().manual_seed(seed)
    policy = -torch.rand(2 * P, T, generator=g, dtype=torch.float64).float() * 3
    reference = -torch.rand(2 * P, T, generator=g, dtype=torch.float64).float() * 3
    start = torch.randint(0, T - 1, (2 * P,), generator=g)
    mask = (torch.arange(T)[None] >= start[:, None]).float()
    return policy * mask, reference * mask, mask


def dpo_cfg(**kw):
    base = dict(beta=0.1, loss="sigmoid", label_smoothing=0.0, simpo_gamma=None, rpo_alpha=0.0)
    return types.SimpleNamespace(**{**base, **kw})


def zerodp(cfg, policy, reference, mask):
    loss, stats = batch_loss(cfg, policy.sum(1), reference.sum(1), mask.sum(1), P, int(mask[0::2].sum()))
    return loss.item(), dict(zip(STATS, (stats / P).tolist()))


def trl_dpo(loss_types, weights, beta, policy, reference, mask):
    """TRL's DPOTrainer._compute_loss itself, its model's per-token log-probs and the reference's given
    (precompute_ref_log_probs), rows ordered as TRL's batch: every chosen, then every rejected."""
    from trl import DPOTrainer

    order = torch.cat([torch.arange(0, 2 * P, 2), torch.arange(1, 2 * P, 2)])
    policy, reference, mask = policy[order], reference[order], mask[order]
    full = torch.cat([torch.zeros(2 * P, 1), mask], dim=1)  # (2P, T+1): a prompt token, then the completions
    ref = reference.sum(1)
    metrics = defaultdict(lambda: defaultdict(list))
    accel = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    me = types.SimpleNamespace(model=types.SimpleNamespace(training=True), accelerator=accel, aux_loss_enabled=False,
                               ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                               loss_types=loss_types, loss_weights=weights, beta=beta, label_smoothing=0.0,
                               use_weighting=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    outputs = types.SimpleNamespace(log_probs=policy, entropy=torch.zeros_like(policy),
                                    mean_logits=torch.zeros_like(policy), is_top1=torch.zeros_like(policy).bool())
    inputs = {"input_ids": torch.zeros(2 * P, T + 1, dtype=torch.long), "attention_mask": torch.ones(2 * P, T + 1),
              "completion_mask": full, "ref_chosen_logps": ref[:P], "ref_rejected_logps": ref[P:]}
    loss = DPOTrainer._compute_loss(me, lambda **kw: outputs, inputs, False)
    return loss.item(), {k: metrics["train"][k][0] for k in STATS}


def trl_cpo(loss_type, beta, smoothing, gamma, chosen, rejected):
    from trl.experimental.cpo import CPOTrainer

    me = types.SimpleNamespace(alpha=0.0, beta=beta, label_smoothing=smoothing, simpo_gamma=gamma,
                               loss_type=loss_type, accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    losses, rc, rr = CPOTrainer.cpo_loss(me, chosen, rejected)
    return losses.mean().item(), rc, rr


def close(a, b):
    assert a == pytest.approx(b, abs=1e-6, rel=1e-6)


@pytest.mark.parametrize("loss,beta,rpo", [("sigmoid", 0.1, 0.0), ("ipo", 0.5, 0.0), ("sigmoid", 0.3, 0.7)])
def test_sigmoid_ipo_and_rpo_equal_trls_dpo_trainer(loss, beta, rpo):
    policy, reference, mask = data()
    ours, stats = zerodp(dpo_cfg(loss=loss, beta=beta, rpo_alpha=rpo), policy, reference, mask)
    types_, weights = ([loss, "sft"], [1.0, rpo]) if rpo else ([loss], [1.0])
    theirs, their_stats = trl_dpo(types_, weights, beta, policy, reference, mask)
    close(ours, theirs)
    for k in STATS:
        close(stats[k], their_stats[k])
    assert 0 < stats["rewards/accuracies"] < 1  # the data has pairs of both kinds: the metric is checked


def test_label_smoothing_is_conservative_dpo_as_trls_cpo_sigmoid():
    policy, reference, mask = data(1)
    ours, stats = zerodp(dpo_cfg(beta=0.2, label_smoothing=0.1), policy, reference, mask)
    plain, _ = zerodp(dpo_cfg(beta=0.2), policy, reference, mask)
    ratios = (policy - reference).sum(1)  # cpo_loss's logps difference is the log-ratios' here
    theirs, rc, rr = trl_cpo("sigmoid", 0.2, 0.1, 0.0, ratios[0::2], ratios[1::2])
    close(ours, theirs)
    close(stats["rewards/chosen"], rc.mean().item())
    assert abs(ours - plain) > 1e-3  # applied, not ignored


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_simpo_equals_trls_cpo_loss(smoothing):
    policy, reference, mask = data(2)
    ours, stats = zerodp(dpo_cfg(loss="simpo", beta=2.0, simpo_gamma=0.8, label_smoothing=smoothing), policy,
                        reference, mask)
    avg = policy.sum(1) / mask.sum(1)  # TRL's average_log_prob
    theirs, rc, rr = trl_cpo("simpo", 2.0, smoothing, 0.8, avg[0::2], avg[1::2])
    close(ours, theirs)
    close(stats["rewards/chosen"], rc.mean().item())
    close(stats["rewards/rejected"], rr.mean().item())
    close(stats["logps/chosen"], avg[0::2].mean().item())


def test_the_loss_is_the_same_however_the_pairs_are_split():
    policy, reference, mask = data(3)
    cfg = dpo_cfg(beta=0.2, rpo_alpha=0.5)
    whole, _ = batch_loss(cfg, policy.sum(1), reference.sum(1), mask.sum(1), P, int(mask[0::2].sum()))
    parts = [batch_loss(cfg, policy[a:b].sum(1), reference[a:b].sum(1), mask[a:b].sum(1), P,
                        int(mask[0::2].sum()))[0] for a, b in ((0, 2), (2, 8), (8, 12))]
    close(sum(p.item() for p in parts), whole.item())
