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
- precomputed: one pass at the start of the run (step 0), under the run's strategy, computes every pair's
  reference log-probs with the starting policy (adapters off under model.lora) and writes them beside the
  prepared data (REFERENCE_FILE, keyed by the reference's sha256, zerodp.convert.lora_base.base_identity,
  and the data's: meta.json's and the splits' sizes); training then holds no reference and looks each
  row's up by its document number. A run that finds the file computed for other weights or data, or
  resumes without it, is refused in one line.
- none (simpo).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from zerodp.config.validation import dpo_reference
from zerodp.errors import UserError
from zerodp.models.preference import STATS, batch_loss, completion_logps
from zerodp.trainer.records import log

REFERENCE_FILE = "reference_logps"
"""DATA/reference_logps.npz (each split's per-document reference log-probs) and .json (what they are of)."""


def make_objective(cfg, env, grad_accum: int, strategy=None, data=(), start: int = 0):
    """None for train.objective=sft (the loop calls the model), else the `Preference` objective; `strategy`,
    `data` (the train and val TokenBatches) and `start` (the run's first step) serve dpo.reference=precomputed."""
    if cfg.train.objective != "dpo":
        return None
    return Preference(cfg, env, grad_accum, strategy, data, start)


class Preference:
    """objective(model, batch, micro_batches, **keyed) -> this micro batch's loss (0-d); the sums of STATS
    of each step's pairs are kept on this rank until `metrics` reduces them."""

    def __init__(self, cfg, env, grad_accum: int, strategy=None, data=(), start: int = 0):
        self.cfg, self.env, self.mode = cfg, env, dpo_reference(cfg)
        self.reference = _frozen_copy(cfg, env, grad_accum) if self.mode == "live" else None
        self.table: dict[str, torch.Tensor] = {}
        """precomputed: split -> each document's reference log-prob (documents,) float64."""
        self._calls = (None, 0)  # (the micro batches in hand, how many of them the objective has seen)
        if self.mode == "precomputed":
            self.table = precomputed(cfg, env, strategy, data, start, self)
        log(env, self.describe())
        self.sums: dict[int, torch.Tensor] = {}
        """step done -> the sums of STATS (6,) over this rank's pairs of that step."""

    @classmethod
    def held(cls, cfg, env, reference=None, table=None) -> Preference:
        """The objective with its reference already in hand, for `evaluate` outside a run (zerodp eval, one
        process): `reference` holds the live reference's `.model`, `table` the precomputed log-probs."""
        self = cls.__new__(cls)
        self.cfg, self.env, self.mode = cfg, env, dpo_reference(cfg)
        self.reference, self.table, self._calls, self.sums = reference, table or {}, (None, 0), {}
        return self

    def describe(self) -> str:
        """The start-up line: the loss and what the reference holds."""
        d = self.cfg.dpo
        what = {None: "no reference (simpo)",
                "adapters-off": "the reference is the base with the adapters off (no copy)",
                "precomputed": "the reference's log-probs precomputed beside the data (no reference held)"
                }.get(self.mode)
        if self.mode == "live":
            held = self.reference.state_bytes().get("params", 0)
            what = (f"the reference is a frozen copy of the starting weights under {self.cfg.strategy.name}, "
                    f"{held / 2**20:.1f} MiB on rank 0 beside the policy (never stepped or saved)")
        return f"train.objective=dpo: loss {d.loss}, beta {d.beta:g}; {what}"

    def __call__(self, model, batch: tuple, micro_batches, **keyed) -> torch.Tensor:
        x, y, rest = batch[0], batch[1], batch[2:]
        # the reference first: what the policy's forward leaves on the model (a mixture of experts' aux_loss,
        # which the loop adds) is then the policy's, also where the reference is the policy with adapters off
        if self.mode == "precomputed":
            held, seen = self._calls
            i = seen if held is micro_batches else 0
            self._calls = (micro_batches, i + 1)
            reference = self.table["train"][micro_batches.documents[i]].to(x.device, torch.float32)
        else:
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
        net = self.reference.model if self.mode == "live" else model  # adapters-off, and the precomputing pass
        was = net.training
        net.eval()
        try:
            with adapters_off(net) if self.cfg.model.lora else contextlib.nullcontext():
                return completion_logps(net(x, None, *rest), y)[0]
        finally:
            net.train(was)
            if self.mode == "live" and hasattr(net, "reshard"):
                # FSDP2 keeps its root unit (embeddings, head) gathered after a forward, for the backward that
                # a frozen copy never runs: left so, the reference would hold them whole for the whole run
                net.reshard()

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
                    if self.mode == "precomputed":
                        docs = val_data.locate(0 if i is None else i, micro).sample
                        reference = self.table["val"][docs].to(policy.device, torch.float32)
                    else:
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


def reference_key(cfg, data) -> dict:
    """What precomputed reference log-probs are of: the reference's weights (base_identity's sha256), the
    model section and precision that compute them, and the prepared data (its meta.json and split sizes)."""
    from zerodp.convert.lora_base import base_identity

    folder = Path(data[0].streams[0].where).parent
    meta = (folder / "meta.json").read_bytes()
    sizes = [os.path.getsize(folder / f"{s}.{k}") for s in ("train", "val") for k in ("bin", "idx", "mask")]
    model = {k: v for k, v in cfg.to_dict()["model"].items() if k not in ("lora", "dropout", "loss_chunks",
                                                                          "activation_checkpointing")}
    reference = hashlib.sha256(json.dumps([base_identity(cfg)["sha256"], model, cfg.train.precision],
                                          sort_keys=True).encode()).hexdigest()
    return {"reference_sha256": reference, "data_sha256": hashlib.sha256(meta + repr(sizes).encode()).hexdigest()}


def stored_table(cfg, data) -> dict[str, torch.Tensor] | None:
    """{split: each document's reference log-prob} from the file beside the data (`data`: TokenBatches of
    it), None when there is none; refused in one line when computed for other weights or data."""
    if not _fresh_table(cfg, data):
        return None
    with np.load(Path(data[0].streams[0].where).parent / f"{REFERENCE_FILE}.npz") as t:
        return {s: torch.from_numpy(t[s]) for s in ("train", "val")}


def check_reference(cfg, start: int, data) -> None:
    """Start-up, before anything is written (zerodp.trainer.preflight): a dpo.reference=precomputed run's file
    beside the data (`data`: its TokenBatches) is of this run's reference and data, and a run that resumes
    (at step `start` > 0) finds one; else one line."""
    if cfg.train.objective != "dpo" or dpo_reference(cfg) != "precomputed":
        return
    if not _fresh_table(cfg, data) and start:
        table_file = Path(data[0].streams[0].where).parent / f"{REFERENCE_FILE}.npz"
        raise UserError(f"dpo.reference=precomputed: {table_file} is not there, and this run resumes at step {start}, "
                        f"whose weights are no longer the reference; start from step 0 (--fresh), which computes "
                        f"them, or use dpo.reference=live")


def _fresh_table(cfg, data) -> bool:
    """Whether the reference log-probs are beside the data; refused in one line when they are of other
    weights or data."""
    folder = Path(data[0].streams[0].where).parent
    meta_file, table_file = folder / f"{REFERENCE_FILE}.json", folder / f"{REFERENCE_FILE}.npz"
    if not (meta_file.is_file() and table_file.is_file()):
        return False
    key, found = reference_key(cfg, data), json.loads(meta_file.read_text())
    changed = [what for what, k in (("the reference model", "reference_sha256"), ("the data", "data_sha256"))
               if found.get(k) != key[k]]
    if changed:
        raise UserError(f"{table_file} holds reference log-probs of other weights or data ({' and '.join(changed)} "
                        f"changed since); move {REFERENCE_FILE}.npz and .json out of {folder} to compute them "
                        f"again at a start from step 0, or use dpo.reference=live")
    return True


def evaluate_checkpoint(cfg, model, val_data, device, autocast, reference=None) -> dict[str, float]:
    """zerodp eval of a train.objective=dpo run, on one process: `Preference.evaluate`'s figures (what the run
    logged as val_loss and val_rewards/...) of `model` over the run's validation pairs, against the run's
    reference: `reference` for a live one (the starting weights, model.init_from's or the seed's), `model`
    with its adapters off, the log-probs precomputed beside the data, or none (simpo)."""
    from types import SimpleNamespace

    env = SimpleNamespace(rank=0, world_size=1, device=device)
    objective = Preference.held(cfg, env)
    if objective.mode == "live":
        assert reference is not None, "a live reference takes the starting weights"
        objective.reference = SimpleNamespace(model=reference.eval())
    elif objective.mode == "precomputed":
        objective.table = stored_table(cfg, [val_data])
        if objective.table is None:
            folder = Path(val_data.streams[0].where).parent
            raise UserError(f"this run's reference log-probs ({REFERENCE_FILE}.npz, dpo.reference=precomputed) are "
                            f"not in {folder}; evaluate on the data folder the run wrote them to (data.source=DIR)")
    return objective.evaluate(SimpleNamespace(model=model, autocast=autocast), val_data, cfg, env)


def precomputed(cfg, env, strategy, data, start: int, objective: Preference) -> dict[str, torch.Tensor]:
    """Collective: {split: each document's reference log-prob} from the file beside the data, or at step 0
    without one, from one pass of the starting policy over every document (written by rank 0)."""
    check_reference(cfg, start, data)  # preflight's check, again: the file may have gone since
    table = stored_table(cfg, data)
    if table is not None:
        return table
    folder = Path(data[0].streams[0].where).parent
    meta_file, table_file = folder / f"{REFERENCE_FILE}.json", folder / f"{REFERENCE_FILE}.npz"
    key = reference_key(cfg, data)
    table = {name: _pass(objective, strategy, batches, cfg, env) for name, batches in zip(("train", "val"), data)}
    if env.rank == 0:
        tmp = folder / f".{REFERENCE_FILE}.tmp.npz"
        np.savez(tmp, **{s: t.numpy() for s, t in table.items()})
        os.replace(tmp, table_file)
        tmp_meta = folder / f".{REFERENCE_FILE}.tmp.json"
        tmp_meta.write_text(json.dumps({**key, "documents": {s: len(t) for s, t in table.items()}}) + "\n")
        os.replace(tmp_meta, meta_file)
    if dist.is_initialized():
        dist.barrier()
    log(env, f"dpo.reference=precomputed: the reference log-probs of {sum(len(t) for t in table.values()):,} "
             f"sequences written to {table_file}")
    return table


@torch.no_grad()
def _pass(objective: Preference, strategy, batches, cfg, env) -> torch.Tensor:
    """Every document's reference log-prob (documents,) float64 of one split, the ranks sharing the micro
    batches (each rank as many forwards: a sharded model's collectives need them)."""
    stream, micro = batches.streams[0], cfg.train.micro_batch_size
    n = len(stream.index) if stream.index is not None else 0
    out = torch.zeros(n, dtype=torch.float64)
    chunks = -(-n // micro)
    per = -(-chunks // env.world_size)
    for c in range(env.rank, per * env.world_size, env.world_size):
        docs = np.arange(c * micro, min((c + 1) * micro, n)) if c < chunks else np.zeros(micro, dtype=np.int64)
        batch = tuple(t.to(env.device) for t in batches.rows(stream.index[docs]))
        with strategy.autocast():
            logps = objective.reference_logps(strategy.model, batch)
        if c < chunks:
            out[docs] = logps.double().cpu()
    if dist.is_initialized():
        dist.all_reduce(out)
    return out
