"""train.objective=dpo: what a micro batch of preference pairs costs (`Preference`), the reference model it
is measured against, and the step's metrics under TRL's names. The loop calls it where an SFT run calls the
model (zerodp.trainer.loop.train_step); the formulas are zerodp.models.preference's.

A micro batch holds whole pairs (rows 2i and 2i+1: chosen, rejected; zerodp.data.samples.PairIndex, and
config validation keeps train.micro_batch_size even). Its loss is its pairs' sum over the global batch's
pair count, times the step's micro batch count P (world x accumulation), which the strategies' mean over
the P micro batches (1/accumulation in the backward, the mean over ranks in the gradient reduction) undoes:
the step minimises the mean over the global batch's pairs at every world size and split.

The reference (dpo.reference):
- live: a frozen copy of the starting weights (model.init_from, or the seed's) set up by a second
  instance of the run's strategy, in eval mode and under no_grad, never stepped and never saved; a resumed
  run rebuilds it from the same weights. Under zero3 and fsdp the strategy shards it as it shards the
  policy; its optimizer holds no state (never stepped).
- adapters-off (model.lora): the policy itself with every adapter's scaling set to 0 for the reference's
  forward: exactly the base (base + 0 * B A), no copy.
- none (simpo).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from zerodp.config.validation import dpo_reference
from zerodp.models.preference import STATS, batch_loss, completion_logps
from zerodp.trainer.records import log


def make_objective(cfg, env, grad_accum: int):
    """None for train.objective=sft (the loop calls the model), else the `Preference` objective."""
    if cfg.train.objective != "dpo":
        return None
    return Preference(cfg, env, grad_accum)


class Preference:
    """objective(model, batch, micro_batches, **keyed) -> this micro batch's loss (0-d); the sums of STATS
    of each step's pairs are kept on this rank until `metrics` reduces them."""

    def __init__(self, cfg, env, grad_accum: int):
        self.cfg, self.env, self.mode = cfg, env, dpo_reference(cfg)
        self.reference = _frozen_copy(cfg, env, grad_accum) if self.mode == "live" else None
        log(env, self.describe())
        self.sums: dict[int, torch.Tensor] = {}
        """step done -> the sums of STATS (6,) over this rank's pairs of that step."""

    def describe(self) -> str:
        """The start-up line: the loss and what the reference holds."""
        d = self.cfg.dpo
        what = {None: "no reference (simpo)",
                "adapters-off": "the reference is the base with the adapters off (no copy)"}.get(self.mode)
        if self.mode == "live":
            held = self.reference.state_bytes().get("params", 0)
            what = (f"the reference is a frozen copy of the starting weights under {self.cfg.strategy.name}, "
                    f"{held / 2**20:.1f} MiB on rank 0 beside the policy (never stepped or saved)")
        return f"train.objective=dpo: loss {d.loss}, beta {d.beta:g}; {what}"

    def __call__(self, model, batch: tuple, micro_batches, **keyed) -> torch.Tensor:
        x, y, rest = batch[0], batch[1], batch[2:]
        # the reference first: what the policy's forward leaves on the model (a mixture of experts' aux_loss,
        # which the loop adds) is then the policy's, also where the reference is the policy with adapters off
        reference = self.reference_logps(model, batch) if self.mode else None
        policy, tokens = completion_logps(model(x, None, *rest, **keyed), y)   # (B,), (B,)
        loss, stats = batch_loss(self.cfg.dpo, policy, reference, tokens, micro_batches.pairs,
                                 micro_batches.chosen_tokens)
        done = micro_batches.step + 1
        self.sums[done] = self.sums.get(done, 0) + stats
        return loss * micro_batches.parts

    @torch.no_grad()
    def reference_logps(self, model, batch: tuple) -> torch.Tensor:
        """The rows' summed completion log-probs (B,) under the reference, in eval mode (no dropout)."""
        x, y, rest = batch[0], batch[1], batch[2:]
        net = self.reference.model if self.mode == "live" else model
        was = net.training
        net.eval()
        try:
            with adapters_off(net) if self.mode == "adapters-off" else contextlib.nullcontext():
                return completion_logps(net(x, None, *rest), y)[0]
        finally:
            net.train(was)

    @torch.no_grad()
    def evaluate(self, strategy, val_data, cfg, env) -> dict[str, float]:
        """Collective: the validation pairs' loss and metrics, every rank together: "val_loss" (the step's
        loss, over the validation set's pairs and chosen tokens) and "val_" + each of STATS. The set is
        zerodp.trainer.validate's (micro batches i < train.eval_batches of the val split, shared out among
        the ranks), whole pairs since the micro batch is even."""
        from zerodp.trainer.validate import rank_batches

        micro, model, d = cfg.train.micro_batch_size, strategy.model, self.cfg.dpo
        pair_only = type(d)(**{**vars(d), "rpo_alpha": 0.0})
        sums = torch.zeros(3 + len(STATS), dtype=torch.float64)  # pair-loss sum, chosen NLL sum, chosen tokens
        model.eval()
        try:
            for i in rank_batches(cfg.train.eval_batches, env.rank, env.world_size):
                batch = tuple(t.to(env.device) for t in val_data.rows(val_data.offsets(0 if i is None else i, micro)))
                with strategy.autocast():
                    policy, tokens = completion_logps(model(batch[0], None, *batch[2:]), batch[1])
                    reference = self.reference_logps(model, batch) if self.mode else None
                if i is None:  # a forward every rank runs as often (a sharded model's collectives), no pairs
                    continue
                loss, stats = batch_loss(pair_only, policy, reference, tokens, 1, 1)
                sums += torch.cat([torch.stack([loss, -policy[0::2].sum(), tokens[0::2].sum()]), stats]).double().cpu()
        finally:
            model.train()
        if dist.is_initialized():
            dist.all_reduce(sums)
        pairs = cfg.train.eval_batches * micro // 2
        loss = sums[0] / pairs + d.rpo_alpha * sums[1] / sums[2].clamp(min=1)
        return {"val_loss": float(loss), **{f"val_{k}": round(float(v) / pairs, 6) for k, v in zip(STATS, sums[3:])}}

    def metrics(self, steps: list[int], device) -> list[dict[str, float]]:
        """Collective: each of `steps`' STATS, the mean over its global batch's pairs (one all-reduce)."""
        sums = torch.stack([torch.as_tensor(self.sums.pop(s, torch.zeros(len(STATS))), dtype=torch.float32,
                                            device=device) for s in steps])   # (steps, 6)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        pairs = self.cfg.train.global_batch_size // 2
        return [{k: round(v / pairs, 6) for k, v in zip(STATS, row)} for row in sums.tolist()]


@contextlib.contextmanager
def adapters_off(model):
    """Every LoRA adapter of `model` scaled by 0 (its forward is then exactly the base's), restored after."""
    saved = [(m, m.scaling) for m in model.modules() if hasattr(m, "lora_B") and hasattr(m, "scaling")]
    try:
        for m, _ in saved:
            m.scaling = 0.0
        yield
    finally:
        for m, scaling in saved:
            m.scaling = scaling


def _frozen_copy(cfg, env, grad_accum: int):
    """A second instance of the run's strategy holding the starting weights (model.init_from, or the seed's,
    as zerodp.trainer.loop.set_up starts the policy): the live reference, never stepped."""
    from zerodp.checkpoint import store
    from zerodp.models import build_model
    from zerodp.strategies import RunContext, make_strategy

    torch.manual_seed(cfg.train.seed)
    reference = make_strategy(cfg.strategy.name)
    reference.setup(build_model(cfg.model, device="meta"), RunContext(
        cfg, env.rank, env.world_size, env.local_rank, env.device, grad_accum, env.local_world_size))
    if cfg.model.init_from:
        store.init_from(reference, cfg.model.init_from)
    reference.model.eval()
    return reference
