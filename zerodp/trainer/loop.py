"""The training loop: the same for every strategy (it never branches on the strategy's name).

`train` is a short sequence of named phases: the start-up checks (zerodp.trainer.preflight, the same as
`--dry-run`'s), the run folder, the strategy and its checkpoints (zerodp.checkpoint.checkpointer), what
records the steps (zerodp.trainer.records) and what guards them (zerodp.trainer.guards), the steps
themselves (`Steps`), and the run's summary.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zerodp.checkpoint.checkpointer import Checkpointer
from zerodp.config import Config, dump_yaml
from zerodp.config.sources import primary_source
from zerodp.convert.lora_base import lora_record
from zerodp.data.batches import TokenBatches, prefetch, prepared_meta
from zerodp.data.chat import chat_record
from zerodp.distributed import determinism
from zerodp.distributed.process_group import DistEnv, init_distributed
from zerodp.models import build_model, compile_blocks, param_count
from zerodp.models.arch import arch_of
from zerodp.models.hf import ORIGIN, origin_config
from zerodp.models.lora_spec import lora_spec, summary as lora_summary
from zerodp.optim.schedules import lr_at
from zerodp.resilience.preemption import Preemption
from zerodp.resilience.replicas import ReplicaCheck
from zerodp.resilience.stragglers import Stopwatch
from zerodp.strategies import RunContext, make_strategy
from zerodp.telemetry.comm import CommMeter, PlanCheck
from zerodp.telemetry.memory import Peaks
from zerodp.telemetry.step_metrics import Pending, fetch_interval
from zerodp.trainer.guards import Guards
from zerodp.trainer.objective import make_objective
from zerodp.trainer.preflight import (
    Ready,
    Together,
    device_memory,
    micro_batch_line,
    preflight,
    resolve_strategy,  # noqa: F401  (tests and the config's docs name it here)
)
from zerodp.trainer.records import Records, log
from zerodp.trainer.resume import keep_config, keep_superseded, micro_batch_balance_note, new_folder_beside
from zerodp.trainer.sample import sample
from zerodp.trainer.validate import evaluate


def run_metadata(cfg: Config, strategy_name: str, layout: str, env: DistEnv, model: torch.nn.Module) -> dict:
    """What conversion and resume need to know about a checkpoint, besides its files; for a `zerodp
    prepare` folder also the tokenizer its meta.json names ({path, sha256, eot_id, special_tokens}),
    which `zerodp convert --to hf` copies into the export and `zerodp generate` encodes and decodes with,
    and for a `zerodp prepare --chat` folder its chat template and end-of-turn id (zerodp.data.chat.chat_record);
    for a model started from a Hugging Face one, that model's config.json (zerodp.models.hf.origin_config)."""
    prepared = prepared_meta(primary_source(cfg.data))  # a mixture's sources share its tokenizer
    tokenizer = {**{k: (prepared.get("tokenizer") or {}).get(k) for k in ("path", "sha256")},
                 "eot_id": prepared.get("eot_id"), "special_tokens": prepared.get("special_tokens", True),
                 **({"chat": chat_record(prepared)} if chat_record(prepared) else {})} if prepared else None
    origin = origin_config(cfg.model.hf_config, cfg.model.init_from)  # its context, rope: what an export keeps
    # a LoRA checkpoint holds the adapters alone (and their AdamW state), and names the base they need:
    # its identity is hashed once, by rank 0, which alone writes meta.json
    lora = lora_record(cfg) if cfg.model.lora and env.rank == 0 else None
    held = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not cfg.model.lora]
    return {
        **({"lora": lora} if lora else {}),
        **({"tokenizer": tokenizer} if tokenizer and tokenizer["path"] else {}),
        **({ORIGIN: origin} if origin else {}),
        "strategy": strategy_name,
        "world_size": env.world_size,
        "layout": layout,
        "precision": cfg.train.precision,
        "config": cfg.to_dict(),
        "params": {n: {"shape": list(p.shape), "dtype": "float32"} for n, p in held},
        "tied": model.tied_weights(),
        "torch_version": torch.__version__,
    }


def train(cfg: Config, fresh: bool = False, return_weights: bool = False, from_checkpoint: str | None = None,
          allow_data_change: bool = False) -> dict:
    """Train per `cfg` under the launcher's process group; return a summary of the run
    (`from_checkpoint`, `allow_data_change`: the start's, zerodp.trainer.start.plan_start).

    The summary holds the strategy name, world size, {step: mean loss} of the steps run here, the
    bytes rank-local state held at start, the last step's collectives (`comm`, zerodp.telemetry.comm), the
    planner's prediction beside what was measured (`planned`), the run's figures (`run`:
    Throughput.summary, also printed as the last line before the sample, with the last
    `grad_noise_scale` when one was measured), and with `return_weights` the final full fp32 weights.
    A run already at train.max_steps trains nothing and writes nothing (`nothing_to_train`)."""
    determinism.apply(cfg.train.deterministic)  # before CUDA computes anything: cuBLAS reads its workspace setting once
    env = init_distributed(cfg.train.device, cfg.strategy.timeout_s)
    if (fresh or from_checkpoint) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        # a restarted attempt continues the run its first attempt started (fresh, or from that checkpoint)
        log(env, f"restarted attempt: {'--fresh' if fresh else '--from-checkpoint'} ignored, resuming from the "
                 f"newest checkpoint")
        fresh, from_checkpoint = False, None
    # nothing is written before every check passed
    ready = preflight(cfg, fresh, Together(env), from_checkpoint=from_checkpoint, allow_data_change=allow_data_change)
    cfg = ready.cfg
    if ready.start.step >= cfg.train.max_steps:
        return nothing_to_train(cfg, env, ready, return_weights)
    open_run_folder(env, ready)
    strategy, checkpointer = set_up(cfg, env, ready.grad_accum)
    state = checkpointer.restore(ready.start.resume_from, ready.start.init_from, env.world_size)
    if ready.start.resume_from is not None:  # where the data stood, whatever the global batch then
        ready.train_data.continue_from(ready.start.step, ready.start.carried.samples)
    if cfg.train.compile:
        compile_blocks(strategy.model)
    dist.barrier()  # start-up is over on every rank
    peaks = Peaks(env.device)
    peaks.startup_over()  # the start-up peak, then a new peak for the steps
    # an imported checkpoint (zerodp convert --to zerodp) records the step only
    start = state.get("step", 0)
    tokens_seen = state.get("tokens", start * cfg.train.global_batch_size * cfg.model.block_size)
    plan_check = announce(cfg, env, ready)

    records = Records(cfg, env, start, tokens_seen, state.get("grad_noise"))
    guards = Guards(cfg, env, strategy.gathers_in_forward, start)
    steps = Steps(cfg, env, strategy, checkpointer, records, guards)
    steps.config_from = ready.start.carried.config_from
    # None: SFT, the model's own loss
    steps.objective = make_objective(cfg, env, ready.grad_accum, strategy, (ready.train_data, ready.val_data), start)
    try:
        with guards.watching(start, checkpointer, records.say):
            steps.run(ready.train_data, ready.val_data, start)
            checkpointer.finish()  # a background save still in flight (checkpoint.async_save)
    finally:
        records.close()
    peaks.training_over()
    guards.report()
    run = records.summary(guards.stragglers.waited_s, checkpointer.save_s)

    held = steps.held or strategy.state_bytes()
    summary = {"strategy": cfg.strategy.name, "world_size": env.world_size, "losses": records.losses,
               "preempted": steps.stopped_early,
               "exit_code": 130 if steps.ctrl_c else 0,  # 130 after Ctrl-C, as a shell expects
               "final_step": steps.done, "state_bytes": held, "straggler_wait_s": guards.stragglers.waited_s,
               "run": run, "comm": steps.meter.summary(), "memory": peaks.summary(),
               "planned": plan_check.compare(steps.meter.summary(), held, env.device, peaks, _reference_held(steps))}
    log(env, peaks.line())
    log(env, plan_check.report(summary["planned"]))
    if return_weights:
        summary["weights"] = strategy.full_state_dict()
    if cfg.train.sample_tokens and not steps.stopped_early:
        summary["sample"] = sample(strategy, cfg, env)
        log(env, "sample:\n" + summary["sample"])
    return summary


def nothing_to_train(cfg: Config, env: DistEnv, ready: Ready, return_weights: bool) -> dict:
    """The summary of a run already at train.max_steps: said in one line; no planner table, no sample,
    and the run folder left as it was (config.yaml keeps the settings that trained)."""
    log(env, ready.start.why)
    summary = {"strategy": cfg.strategy.name, "world_size": env.world_size, "losses": {}, "preempted": False,
               "exit_code": 0, "final_step": ready.start.step, "nothing_to_train": True}
    if return_weights:
        strategy, checkpointer = set_up(cfg, env, ready.grad_accum)
        checkpointer.restore(ready.start.resume_from, ready.start.init_from, env.world_size)
        summary["weights"] = strategy.full_state_dict()
    return summary


def open_run_folder(env: DistEnv, ready: Ready) -> None:
    """After the checks: say what the data is, move an earlier run aside (a start at step 0 over it) or
    the records a resume supersedes (zerodp.trainer.resume), point `latest` at a --from-checkpoint, keep
    the settings that trained before a resume that changes them, write the resolved config (auto
    replaced by the choice) and say what the planner chose."""
    cfg, plan = ready.cfg, ready.plan
    if ready.prepared_line:  # after both splits' checks: a bad input stays a one-line error
        for line in ready.prepared_line.splitlines():
            log(env, line)
    if ready.train_data.note:
        log(env, ready.train_data.note)
    for note in ready.notes:  # what data.packing=false never trains, a context past the model's
        log(env, note)
    if env.rank == 0:
        out_dir, start = Path(cfg.train.out_dir), ready.start
        if start.set_aside:
            _set_aside_earlier_run(env, out_dir, start.set_aside)
        elif said := keep_superseded(out_dir, start.step):
            log(env, said)
        if start.from_checkpoint:  # as `echo NAME > latest` would: a restart before the next save resumes there too
            root = out_dir / "checkpoints"
            (root / "latest.tmp").write_text(start.from_checkpoint + "\n")
            os.replace(root / "latest.tmp", root / "latest")
        if start.carried.kept_config:
            log(env, keep_config(out_dir, start.carried.kept_config))
        (out_dir / "config.yaml").write_text(dump_yaml(cfg))
    dist.barrier()
    if plan is not None:  # after the input checks: a bad input stays a one-line error
        what = "train.micro_batch_size=auto" if ready.searched else "strategy.name=auto"
        log(env, f"{what}, the planner's table:\n" + plan.table())
        if ready.searched:
            log(env, micro_batch_line(plan))
            if said := micro_batch_balance_note(cfg, None, "train.micro_batch_size=auto chose "
                                                           f"{cfg.train.micro_batch_size}"):
                log(env, said)


def set_up(cfg: Config, env: DistEnv, grad_accum: int):
    """The strategy with its model set up and its Checkpointer.

    The model is built on the meta device (no memory); the strategy materialises only what this rank
    keeps and fills it with the initial weights of (train.seed, parameter name), so every strategy at
    every world size starts from the same weights; a checkpoint then loads tensor by tensor."""
    torch.manual_seed(cfg.train.seed)  # what draws from torch's generator draws the same on every rank
    model = build_model(cfg.model, device="meta")
    strategy = make_strategy(cfg.strategy.name)
    meta = run_metadata(cfg, cfg.strategy.name, strategy.layout, env, model)
    ctx = RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, grad_accum, env.local_world_size)
    strategy.setup(model, ctx)
    c = cfg.checkpoint
    return strategy, Checkpointer(strategy, cfg.train.out_dir, meta, c.every, c.keep_last, cfg.train.max_steps,
                                  c.async_save, c.enabled)


def _reference_held(steps) -> dict[str, int] | None:
    """A DPO run's live reference's state_bytes() (zerodp.trainer.objective), for the end-of-run lines; None
    without one."""
    reference = getattr(steps.objective, "reference", None)
    return None if reference is None else reference.state_bytes()


def announce(cfg: Config, env: DistEnv, ready: Ready) -> PlanCheck:
    """The start-up lines: the strategy and batch, where the run starts, the planner's prediction."""
    log(env, f"strategy {cfg.strategy.name} on {env.world_size} process(es), {param_count(cfg.model):,} parameters, "
             f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x "
             f"world {env.world_size} x accum {ready.grad_accum}")
    spec = lora_spec(cfg.model.lora)
    if spec is not None:
        log(env, lora_summary(arch_of(cfg.model), spec, cfg.train.precision))
    log(env, ready.start.why)
    if not cfg.checkpoint.enabled:
        log(env, "checkpoint.enabled=false: this run writes no checkpoint, not even at the end; a preemption "
                 "stops it without saving")
    plan_check = PlanCheck(cfg, env.world_size, *device_memory(env.device, env.local_world_size))
    log(env, plan_check.prediction())
    return plan_check


class Steps:
    """The optimizer steps from `start` to train.max_steps, or to a preemption: each step queued
    without waiting for the device, and at each sync point (every train.log_every steps, an evaluation
    or a checkpoint) the interval's figures fetched in one device sync and one all-gather, with any
    preemption request, so that every rank stops after the same step."""

    def __init__(self, cfg: Config, env: DistEnv, strategy, checkpointer: Checkpointer, records: Records,
                 guards: Guards):
        self.cfg, self.env, self.strategy = cfg, env, strategy
        self.checkpointer, self.records, self.guards = checkpointer, records, guards
        self.meter = CommMeter(cfg.train.measure_comm)  # counts the collectives of each step
        self.replicas = ReplicaCheck(cfg, env, strategy)  # train.check_replicas_every
        self.config_from = 0
        """The step the run's config took effect at (zerodp.trainer.resume), for its checkpoints."""
        self.objective = None
        """train.objective=dpo's loss and metrics (zerodp.trainer.objective); None: the model's loss."""
        self.held: dict[int, int] = {}
        """What rank 0 holds after the first step (strategy.state_bytes)."""
        self.done = 0
        self.epoch_ends: list[tuple[str, int, int]] = []
        """(source, epoch, step) of each epoch that ended in this run."""
        self.stopped_early = self.ctrl_c = False
        self.interval_start = 0.0
        """perf_counter at the start of the steps since the last sync point, less evaluations and saves."""

    def run(self, train_data: TokenBatches, val_data: TokenBatches, start: int) -> None:
        cfg, env, guards, watch = self.cfg, self.env, self.guards, self.guards.watch
        pending: list[Pending] = []
        step_comm: dict[int, dict] = {}  # each pending step's collectives (zerodp.telemetry.comm), for its record
        self.done, self.train_data = start, train_data
        t_end = self.interval_start = time.perf_counter()
        self.strategy.model.train()
        for step, micro_batches in prefetch(train_data, range(start, cfg.train.max_steps), cfg,
                                            env.rank, env.world_size, cfg.data.prefetch, env.device):
            guards.step = step  # the step in progress, for the line of a failed collective
            t0 = time.perf_counter()
            lr = lr_at(cfg, step)
            timer = Stopwatch(env.device)
            self.replicas.arm(step + 1, self.checkpointer.saves_after(step + 1))
            with self.meter.step(), timer:
                figures: dict = {}
                local_loss, grad_norm, forward, local_sq = train_step(self.strategy, micro_batches, lr, env.device,
                                                                      figures, self.objective)
            done = self.done = step + 1
            # Nothing below waits for the device until the sync point: the figures stay where they are.
            pending.append(Pending(done, lr, local_loss, grad_norm, timer, forward, t0 - t_end,
                                   guards.probe.launch() if guards.probe is not None else None, local_sq,
                                   getattr(micro_batches, "targets", None), getattr(micro_batches, "spread", 1.0),
                                   figures.get("balance_loss"), figures.get("expert_load")))
            step_comm[done] = self.meter.record()  # counted on the host as the collectives were issued
            guards.heartbeat.beat(done)  # a write to the job's store, not a device sync
            self._say_epoch_ends(done)
            if not self.held:  # after the first step, when gradients and optimizer state exist
                self._say_held()
            evaluate_now = cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.max_steps)
            save_now = self.checkpointer.due(done)
            last = done == cfg.train.max_steps  # a sync point even where no save is (checkpoint.enabled=false)
            if not (evaluate_now or save_now or last or done % cfg.train.log_every == 0):
                watch.step_done(done, time.perf_counter() - t_end)
                t_end = time.perf_counter()
                continue
            stop = self._sync_point(pending, step_comm, evaluate_now, t_end, val_data)
            pending = []
            if (stop and self.checkpointer.enabled) or save_now:
                t_save = time.perf_counter()
                position = self.train_data.position(done, cfg.train.global_batch_size)  # samples consumed
                self.checkpointer.save(done, {**self.records.trainer_state(done), "samples": position,
                                              "config_from": self.config_from})
                self.interval_start += time.perf_counter() - t_save  # saves are counted apart (checkpoint_save_s)
                self.records.flush()
            if stop:
                self.ctrl_c = stop == Preemption.CTRL_C
                what = "Ctrl-C" if self.ctrl_c else "preempted"
                saved = ("checkpoint saved; run the same command again to continue" if self.checkpointer.enabled
                         else "no checkpoint saved (checkpoint.enabled=false)")
                log(env, f"{what}: stopped after step {done}, {saved}")
                self.stopped_early = True
                break
            t_end = time.perf_counter()
        self._say_epochs_unsaid()

    def _sync_point(self, pending: list[Pending], step_comm: dict[int, dict], evaluate_now: bool, t_end: float,
                    val_data: TokenBatches) -> float:
        """Fetch, record and publish the pending steps' figures (and a validation loss); return the
        preemption request shared by the ranks (Preemption.request_code, 0 for none)."""
        per_step, sync_wait, stop, load = fetch_interval(pending, self.guards.preemption.request_code,
                                                         self.interval_start)
        # The next interval's wall time starts where this one's ended, when the device was done: the
        # exchange, the records and the logging below belong to the next steps' time, evaluation does not.
        self.interval_start = time.perf_counter() - sync_wait
        self.guards.watch.step_done(pending[-1].step, time.perf_counter() - t_end)
        new = []
        for p, per_rank in zip(pending, per_step):
            record = self.records.measure(p, per_rank, sync_wait if p is pending[-1] else 0.0,
                                          step_comm.pop(p.step, {}))
            record.update(self._epochs(p.step))
            found = self.guards.find_stragglers(per_rank)
            if found:
                record["stragglers"] = found
            new.append(record)
        if load is not None:  # a mixture of experts: its routers over the interval
            new[-1].update(self.records.router_load(load, pending[0].step, pending[-1].step))
        if self.objective is not None:  # one all-reduce of the interval's preference metrics
            for record, found in zip(new, self.objective.metrics([p.step for p in pending], self.env.device)):
                record.update(found)
        if evaluate_now:
            t_eval = time.perf_counter()
            measure = evaluate if self.objective is None else self.objective.evaluate
            new[-1].update(measure(self.strategy, val_data, self.cfg, self.env))
            self.interval_start += time.perf_counter() - t_eval
        step = pending[-1].step  # checked before a save, the finding in the step's record, then the stop
        found = self.replicas.check(step, bool(stop) or self.checkpointer.due(step))
        new[-1].update(found)
        self.records.publish(new)
        self.replicas.stop(found)
        return stop

    def _epochs(self, done: int) -> dict[str, float]:
        """Epochs of the training data completed after `done` steps: "epoch", and for a mixture each
        source's ("epoch/<name>"), "epoch" then the largest (the source repeated most)."""
        data = self.train_data
        epochs = [round(e, 6) for e in data.epochs(done, self.cfg.train.global_batch_size)]
        if len(epochs) == 1:
            return {"epoch": epochs[0]}
        return {"epoch": max(epochs), **{f"epoch/{s.name}": e for s, e in zip(data.streams, epochs)}}

    EPOCH_LINES = 2
    """Epoch ends said in one run, at most: a small data set ends one every few steps (61 lines in a
    150-step fine-tune); the rest are counted at the end of the run (`_say_epochs_unsaid`)."""

    def _say_epoch_ends(self, done: int) -> None:
        """One line (rank 0) for each source whose epoch ended within step `done`, the first EPOCH_LINES."""
        data, G = self.train_data, self.cfg.train.global_batch_size
        for s, before, after, n in zip(data.streams, data.epochs(done - 1, G), data.epochs(done, G),
                                       data.samples_per_epoch()):
            if int(after) > int(before):
                what = f"data source {s.name}" if len(data.streams) > 1 else "the training data"
                self.epoch_ends.append((what, int(after), done))
                if len(self.epoch_ends) <= self.EPOCH_LINES:
                    last = "; later epoch ends are counted at the end of the run" * (
                        len(self.epoch_ends) == self.EPOCH_LINES)
                    log(self.env, f"epoch {int(after)} of {what} ({n:,} samples) ended in step {done}; the next "
                                  f"visits them in a new order{last}")

    def _say_epochs_unsaid(self) -> None:
        """After the steps: the epoch ends not said, as one line per source."""
        unsaid = self.epoch_ends[self.EPOCH_LINES:]
        for what in dict.fromkeys(w for w, _, _ in unsaid):
            ends = [(e, step) for w, e, step in unsaid if w == what]
            log(self.env, f"{len(ends)} more epoch(s) of {what} ended, the last (epoch {ends[-1][0]}) in step "
                          f"{ends[-1][1]}")

    def _say_held(self) -> None:
        self.held = self.strategy.state_bytes()
        log(self.env, "rank 0 holds after the first step: " + ", ".join(
            f"{k} {v / 2**20:.1f} MiB" if v or k != "grads" else "grads freed between steps"
            for k, v in self.held.items()))

def train_step(strategy, micro_batches: list, lr: float, device: torch.device, figures: dict | None = None,
               objective=None):
    """One optimizer step over this rank's micro batches, without waiting for the device.

    A model that leaves an `aux_loss` after its forward (a mixture of experts: router_aux_loss_coef x its
    balance loss, zerodp.models.moe_spec) has it added to the loss it backpropagates, weighed the same in
    every micro batch (a loss mask's weights are the LM loss's); the loss returned stays the LM loss, and
    `figures` (if given) gets the mean of its `balance_loss` over the micro batches, a 0-d tensor, and the
    step's tokens per expert of each sparse block, `expert_load` (L, E) (zerodp.telemetry.router).

    Returns (mean local loss, a 0-d tensor; global grad norm, a tensor or the float DeepSpeed hands
    back; a Stopwatch of the forward passes, read after a device sync; this rank's own micro-batch
    gradient norm squared before the reduction, a 0-d tensor, or None where the strategy does not
    measure it: the small batch of the gradient noise scale). Forward time is the straggler
    signal: under ddp/zero1/zero2 it holds no communication, so a slow rank shows there, while the fast
    ranks' waiting hides inside the backward's gradient reduction. `objective` (zerodp.trainer.objective)
    takes the model's place where train.objective is not sft."""
    loss_sum = torch.zeros((), device=device)
    forward = Stopwatch(device)
    weights = getattr(micro_batches, "weights", None)  # loss masks: the global batch's target mean
    keys = getattr(micro_batches, "dropout_keys", None)  # dropout: each row's masks, whatever the layout
    core, balance_sum = _core(strategy.model), None
    for i, batch in enumerate(micro_batches):
        batch = model_inputs(batch, device)
        keyed = {"dropout_keys": keys[i].to(device, non_blocking=True)} if keys is not None else {}
        with strategy.micro_step(is_last=i == len(micro_batches) - 1):
            with strategy.autocast(), forward:
                loss = (strategy.model(*batch, **keyed) if objective is None
                        else objective(strategy.model, batch, micro_batches, **keyed))
                if weights is not None:
                    loss = loss * weights[i]  # a Python float: no host sync
                aux = getattr(core, "aux_loss", None)
            strategy.backward(loss if aux is None else loss + aux)
        loss_sum += loss.detach().float()
        if aux is not None:
            balance = core.balance_loss.detach().float()
            balance_sum = balance if balance_sum is None else balance_sum + balance
    local_grad_sq = getattr(strategy, "local_grad_sq", None)  # optional; before step(): the loss scale
    local_sq = local_grad_sq() if local_grad_sq is not None else None
    grad_norm = strategy.step(lr)
    if figures is not None and balance_sum is not None:
        figures["balance_loss"] = balance_sum / len(micro_batches)
        figures["expert_load"] = core.router_log.take_load()  # (L, E), on the device (zerodp.telemetry.router)
    return loss_sum / len(micro_batches), grad_norm, forward, local_sq


def _core(model):
    """The model a DDP wrapper or DeepSpeed engine holds (FSDP shards the model in place)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_inputs(batch: tuple, device: torch.device, non_blocking: bool = True) -> tuple:
    """A micro batch on `device`, as the model takes it: (x, y), or (x, y, doc_ids) when
    zerodp.data.batches adds document ids (data.document_masking with a document index)."""
    return tuple(t.to(device, non_blocking=non_blocking) for t in batch)


def _set_aside_earlier_run(env: DistEnv, out_dir: Path, names: list[str]) -> None:
    """A run that starts at step 0 over an earlier one (--fresh, checkpoint.resume=false, or a run that
    never saved): move the earlier run's files (`names`: its checkpoints, metrics.jsonl, config.yaml,
    logger folders) together into one folder beside them, never deleting or truncating what it wrote,
    so that neither resume nor retention ever mixes the two runs."""
    aside = new_folder_beside(out_dir, "earlier")
    for name in names:
        if (out_dir / name).exists():
            os.replace(out_dir / name, aside / name)
    log(env, f"moved the earlier run ({', '.join(names)}) to {aside}")
