"""The training loop: the same for every strategy (it never branches on the strategy's name)."""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zerodp.checkpoint import store as checkpoint
from zerodp.distributed import determinism
from zerodp.telemetry import loggers
from zerodp.telemetry.comm import CommMeter, PlanCheck
from zerodp.config import Config, dump_yaml
from zerodp.data.batches import TokenBatches, describe_prepared, load_tokens, prefetch, prepared_meta
from zerodp.distributed.process_group import DistEnv, all_gather_floats, broadcast_object, init_distributed
from zerodp.errors import PeerFailure, UserError
from zerodp.resilience.faults import (DeviceProbe, Heartbeat, PeerWatch, Preemption, Stopwatch, StragglerMonitor,
                           compute_from_probe)
from zerodp.telemetry.grad_noise import NoiseScale, advice, skip_reason
from zerodp.models import build_model, compile_blocks, flops_per_token, param_count
from zerodp.optim.schedules import lr_at
from zerodp.trainer.sample import sample
from zerodp.telemetry.step_metrics import Pending, Throughput, describe_run, fetch_interval, peak_flops
from zerodp.trainer.start import plan_start
from zerodp.strategies import CATALOG, RunContext, make_strategy


def log(env: DistEnv, msg: str) -> None:
    """A line on rank 0's stderr, on its own line: above a live progress bar, never inside it."""
    if env.rank == 0:
        from tqdm import tqdm

        tqdm.write(f"zerodp: {msg}", file=sys.stderr)
        sys.stderr.flush()


def device_memory(device: torch.device, local_world_size: int = 1) -> tuple[int, str]:
    """Memory one rank may use and the device's name: the GPU's, or this node's RAM shared by its ranks."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, props.name
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, local_world_size), "cpu"


def resolve_strategy(cfg: Config, world_size: int, device: torch.device, local_world_size: int = 1):
    """The config to run: as given, or with the planner's choices applied: strategy.name=auto (the
    strategy, offload and checkpointing) and train.micro_batch_size=auto (the micro batch and
    checkpointing, for the strategy given or chosen).

    Returns (config, plan); plan is None unless the planner chose something. Pure: no collectives."""
    if (spec := CATALOG.get(cfg.strategy.name)) and spec.single_process and world_size > 1:  # auto: None
        raise UserError(f"strategy.name={spec.name} cannot run on {world_size} processes; use ddp (or launch one "
                        "process)")
    search = cfg.train.micro_batch_size == "auto"
    if cfg.strategy.name != "auto" and not search:
        return cfg, None
    from zerodp.planner import plan_for_training

    memory, name = device_memory(device, local_world_size)
    per_node = local_world_size if world_size % local_world_size == 0 else None
    plan = plan_for_training(cfg, world_size, memory, name, gpus_per_node=per_node,
                             strategy=None if cfg.strategy.name == "auto" else cfg.strategy.name)
    if plan.choice is None:
        what = "strategy.name=auto" if cfg.strategy.name == "auto" else "train.micro_batch_size=auto"
        raise UserError(f"{what}: nothing fits in {memory / 1e9:.1f} GB per rank on {world_size} "
                        f"rank(s). {plan.suggestion or 'Use more GPUs, a smaller micro batch or a smaller model.'}")
    chose_strategy = cfg.strategy.name == "auto"
    cfg = copy.deepcopy(cfg)
    if chose_strategy:
        cfg.strategy.name = plan.choice
        cfg.strategy.offload_optimizer = plan.offload_optimizer
        cfg.strategy.offload_params = plan.offload_params
        if plan.hybrid:  # only fsdp+hybrid: strategy: auto never picks the approximate zero3+zero++
            cfg.strategy.hybrid_shard = True
    cfg.model.activation_checkpointing = plan.activation_checkpointing
    if search:
        cfg.train.micro_batch_size = plan.micro_batch
    return cfg, plan


def micro_batch_line(plan) -> str:
    """What train.micro_batch_size=auto chose, and why, in one line."""
    row = plan.chosen
    return (f"train.micro_batch_size=auto: micro batch {row.micro_batch} x {row.grad_accum_steps} accumulation "
            f"on {plan.cluster.world_size} rank(s) (global batch {plan.global_batch}) under {row.name}, "
            f"activation checkpointing {'on' if row.activation_checkpointing else 'off'}, predicted "
            f"{row.tokens_per_s_per_gpu:,.0f} tokens/s per device: "
            + next((r for r in plan.reasons if r.startswith("Micro batch")), "").rstrip("."))


def agree(env: DistEnv, fn):
    """Run `fn` on every rank; if it raised a UserError on any rank, raise it on all of them (rank 0
    prints it), so that no rank is left waiting in a collective for one that gave up."""
    error = None
    try:
        result = fn()
    except UserError as e:
        error, result = str(e), None
    errors = [None] * env.world_size
    dist.all_gather_object(errors, error)
    first = next(((r, e) for r, e in enumerate(errors) if e), None)
    if first is not None:
        r, e = first
        raise UserError(e if r == 0 or env.world_size == 1 else f"on rank {r} ({env.hosts[r]}): {e}")
    return result


def check_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write_test_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"train.out_dir {out_dir} is not writable ({e.strerror}); choose a directory you can write to") from None


def run_metadata(cfg: Config, strategy_name: str, layout: str, env: DistEnv, model: torch.nn.Module) -> dict:
    """What conversion and resume need to know about a checkpoint, besides its files; for a `zerodp
    prepare` folder also the tokenizer its meta.json names ({path, sha256, eot_id, special_tokens}),
    which `zerodp convert --to hf` copies into the export and `zerodp generate` encodes and decodes with."""
    prepared = prepared_meta(cfg.data.source)
    tokenizer = {**{k: (prepared.get("tokenizer") or {}).get(k) for k in ("path", "sha256")},
                 "eot_id": prepared.get("eot_id"), "special_tokens": prepared.get("special_tokens", True)} \
        if prepared else None
    return {
        **({"tokenizer": tokenizer} if tokenizer and tokenizer["path"] else {}),
        "strategy": strategy_name,
        "world_size": env.world_size,
        "layout": layout,
        "precision": cfg.train.precision,
        "config": cfg.to_dict(),
        "params": {n: {"shape": list(p.shape), "dtype": "float32"} for n, p in model.named_parameters()},
        "tied": model.tied_weights(),
        "torch_version": torch.__version__,
    }


def train(cfg: Config, fresh: bool = False, return_weights: bool = False) -> dict:
    """Train per `cfg` under the launcher's process group; return a summary of the run.

    The summary holds the strategy name, world size, {step: mean loss} of the steps run here, the
    bytes rank-local state held at start, the last step's collectives (`comm`, zerodp.telemetry.comm), the
    planner's prediction beside what was measured (`planned`), the run's figures (`run`:
    Throughput.summary, also printed as the last line before the sample, with the last
    `grad_noise_scale` when one was measured), and with `return_weights` the final full fp32 weights."""
    determinism.apply(cfg.train.deterministic)  # before CUDA computes anything: cuBLAS reads its workspace setting once
    env = init_distributed(cfg.train.device, cfg.strategy.timeout_s)
    searched = cfg.train.micro_batch_size == "auto"
    # Rank 0 plans and every rank runs its choice (nodes could report different memory).
    planned = agree(env, lambda: resolve_strategy(cfg, env.world_size, env.device, env.local_world_size)
                    if env.rank == 0 else None)
    cfg, plan = broadcast_object(planned)
    grad_accum = cfg.check_batch_split(env.world_size)
    name = cfg.strategy.name
    out_dir = Path(cfg.train.out_dir)
    if fresh and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        fresh = False  # a restarted attempt continues the run its first attempt started fresh
        log(env, "restarted attempt: --fresh ignored, resuming from the newest checkpoint")

    agree(env, lambda: check_out_dir(out_dir))  # on every rank: each checks its own file system
    agree(env, lambda: loggers.check(cfg.train) if env.rank == 0 else None)  # rank 0 logs
    # Where the run starts, checked before anything is written: a checkpoint of another model is refused.
    start_plan = broadcast_object(agree(env, lambda: plan_start(cfg, fresh, set_aside_damaged=True, rank=env.rank)))

    def inputs():  # before the model: a bad data source fails fast
        tokens = load_tokens(cfg)
        return TokenBatches(tokens, cfg, "train"), TokenBatches(tokens, cfg, "val"), describe_prepared(cfg, tokens)

    train_data, val_data, prepared_line = agree(env, inputs)
    if prepared_line:  # after both splits' checks: a bad input stays a one-line error
        log(env, prepared_line)
    if env.rank == 0:
        if start_plan.set_aside:
            _set_aside_earlier_run(env, out_dir, start_plan.set_aside)
        (out_dir / "config.yaml").write_text(dump_yaml(cfg))  # resolved: auto replaced by the choice
    dist.barrier()
    if plan is not None:  # after the input checks: a bad input stays a one-line error
        what = "train.micro_batch_size=auto" if searched else "strategy.name=auto"
        log(env, f"{what}, the planner's table:\n" + plan.table())
        if searched:
            log(env, micro_batch_line(plan))

    torch.manual_seed(cfg.train.seed)  # the same dropout streams as one process
    # Start-up: the model is built on the meta device (no memory); the strategy materialises only what
    # this rank keeps and fills it with the initial weights of (train.seed, parameter name), so every
    # strategy at every world size starts from the same weights; a checkpoint then loads tensor by tensor.
    model = build_model(cfg.model, device="meta")
    strategy = make_strategy(name)
    meta = run_metadata(cfg, name, strategy.layout, env, model)
    ctx = RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, grad_accum, env.local_world_size)
    strategy.setup(model, ctx)
    meter = CommMeter(cfg.train.measure_comm)  # counts the collectives of each step

    start, tokens_seen, noise_state = 0, 0, None
    if start_plan.resume_from is not None:
        state = checkpoint.load(strategy, start_plan.resume_from, env.world_size)
        noise_state = state.get("grad_noise")  # the averages continue (a checkpoint before them has none)
        # an imported checkpoint (zerodp convert --to zerodp) records the step only
        start = state["step"]
        tokens_seen = state.get("tokens", start * cfg.train.global_batch_size * cfg.model.block_size)
    elif start_plan.init_from:
        checkpoint.init_from(strategy, start_plan.init_from)
    if cfg.train.compile:
        compile_blocks(strategy.model)
    dist.barrier()  # start-up is over on every rank
    log(env, f"strategy {name} on {env.world_size} process(es), {param_count(cfg.model):,} parameters, "
             f"global batch {cfg.train.global_batch_size} = micro {cfg.train.micro_batch_size} x "
             f"world {env.world_size} x accum {grad_accum}")
    log(env, start_plan.why)
    plan_check = PlanCheck(cfg, env.world_size, *device_memory(env.device, env.local_world_size))
    log(env, plan_check.prediction())
    if start >= cfg.train.max_steps:
        log(env, f"the run is already complete at step {start}; raise train.max_steps to train further")

    metrics_path = out_dir / "metrics.jsonl"
    if env.rank == 0:
        _truncate_metrics(metrics_path, start)
    metric_loggers = agree(env, lambda: loggers.MetricLoggers(cfg, out_dir, start) if env.rank == 0 else None)
    heartbeat = Heartbeat(env.rank, env.world_size, env.hosts)
    heartbeat.beat(start)  # a peer lost during the first step is named too
    stragglers = StragglerMonitor(env.hosts, cfg.train.straggler_margin, cfg.train.straggler_patience)
    # Where the forward all-gathers parameters, its time is the slowest rank's on every rank: probe instead.
    probe = DeviceProbe(env.device) if strategy.gathers_in_forward and env.world_size > 1 else None
    preemption = Preemption(cfg.train.preempt_grace_s, announce=env.rank == 0)
    peak, no_peak = peak_flops(cfg, env.device)
    if no_peak:
        log(env, no_peak)
    throughput = Throughput(cfg, env.rank, env.world_size, flops_per_token(cfg.model), peak, tokens_seen)
    noise = _noise_scale(cfg, env, noise_state)
    bar = _progress(cfg, env, start)
    # A side thread for a peer that stops answering and for a signal while a collective blocks this thread.
    watch = PeerWatch(heartbeat, preemption, cfg.strategy.timeout_s, say=lambda line: _say(bar, line),
                      newest_checkpoint=lambda: _newest_checkpoint(out_dir))
    losses: dict[int, float] = {}
    records: list[dict] = []
    held: dict[int, int] = {}
    pending: list[Pending] = []
    step_comm: dict[int, dict] = {}  # each pending step's collectives (zerodp.telemetry.comm), for its record
    stopped_early = ctrl_c = False
    step, done, save_s = start, start, 0.0
    t_end = time.perf_counter()
    strategy.model.train()
    watch.start(start)
    try:
        for step, micro_batches in prefetch(train_data, range(start, cfg.train.max_steps), cfg,
                                            env.rank, env.world_size, cfg.data.prefetch):
            t0 = time.perf_counter()
            lr = lr_at(cfg, step)
            timer = Stopwatch(env.device)
            with meter.step(), timer:
                local_loss, grad_norm, forward, local_sq = train_step(strategy, micro_batches, lr, env.device)
            done = step + 1
            # Nothing below waits for the device until the sync point: the figures stay where they are.
            pending.append(Pending(done, lr, local_loss, grad_norm, timer, forward, t0 - t_end,
                                   probe.launch() if probe is not None else None, local_sq))
            step_comm[done] = meter.record()  # counted on the host as the collectives were issued
            heartbeat.beat(done)  # a write to the job's store, not a device sync
            if not held:  # after the first step, when gradients and optimizer state exist
                held = strategy.state_bytes()
                log(env, "rank 0 holds after the first step: " + ", ".join(
                    f"{k} {v / 2**20:.1f} MiB" if v or k != "grads" else "grads freed between steps"
                    for k, v in held.items()))
            evaluate_now = cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.max_steps)
            save_now = done == cfg.train.max_steps or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0)
            if not (evaluate_now or save_now or done % cfg.train.log_every == 0):
                watch.step_done(done, time.perf_counter() - t_end)
                t_end = time.perf_counter()
                continue
            # A sync point: the interval's figures come to the host in one device sync and go to every
            # rank in one all-gather, with any preemption request.
            per_step, sync_wait, stop = fetch_interval(pending, preemption.request_code)
            watch.step_done(done, time.perf_counter() - t_end)
            new = []
            for p, per_rank in zip(pending, per_step):
                record = throughput.record(p, per_rank, sync_wait if p is pending[-1] else 0.0)
                record.update(step_comm.pop(p.step, {}))
                losses[p.step] = record["loss"]
                if noise is not None:  # the same numbers on every rank: every rank keeps the same averages
                    estimate = noise.update(statistics.fmean(r[6] for r in per_rank), record["grad_norm"] ** 2)
                    if estimate is not None:
                        record["grad_noise_scale"] = estimate
                found = _find_stragglers(stragglers, per_rank, probe is not None, env)
                if found:
                    record["stragglers"] = found
                new.append(record)
            pending = []
            if evaluate_now:
                new[-1]["val_loss"] = evaluate(strategy, val_data, cfg, env)
            records += new
            if env.rank == 0:
                with open(metrics_path, "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in new)
                for r in new:
                    metric_loggers.log(r)
            for r in new:
                _report_step(env, bar, cfg, r)
            if stop or save_now:
                trainer_state = {"step": done, "tokens": throughput.tokens, "loss": losses[done],
                                 **({"grad_noise": noise.state()} if noise is not None else {})}
                watch.saving = True  # a signal now waits for the save (within the grace period)
                t_save = time.perf_counter()
                checkpoint.save(strategy, out_dir, done, trainer_state, meta, cfg.checkpoint.keep_last)
                save_s += time.perf_counter() - t_save
                watch.saving = False
                if metric_loggers is not None:
                    metric_loggers.flush()
            if stop:
                ctrl_c = stop == Preemption.CTRL_C
                what = "Ctrl-C" if ctrl_c else "preempted"
                log(env, f"{what}: stopped after step {done}, checkpoint saved; "
                         f"run the same command again to continue")
                stopped_early = True
                break
            t_end = time.perf_counter()
    except (dist.DistBackendError, RuntimeError) as e:
        if not _is_collective_failure(e):
            raise
        raise PeerFailure(heartbeat.diagnose(e, step)) from None
    finally:
        watch.stop()
        preemption.restore()
        if bar is not None:
            bar.close()
        if metric_loggers is not None:
            metric_loggers.close()
    if stragglers.waited_s > 0 and env.world_size > 1:
        named = ", ".join(f"rank {r} on {env.hosts[r]} ({cause})" for r, cause in sorted(stragglers.reported.items()))
        log(env, f"time spent waiting for the slowest rank: {stragglers.waited_s:.1f}s"
                 + (f"; stragglers: {named}" if named else ""))
    run = throughput.summary(records, stragglers.waited_s, save_s)
    if run:
        log(env, describe_run(run))
    if noise is not None and records:
        run["grad_noise_scale"] = noise.estimate()
        log(env, advice(cfg.train.global_batch_size, noise.estimate(), noise.steps))

    held = held or strategy.state_bytes()
    summary = {"strategy": name, "world_size": env.world_size, "losses": losses, "preempted": stopped_early,
               "exit_code": 130 if stopped_early and ctrl_c else 0,  # 130 after Ctrl-C, as a shell expects
               "final_step": done, "state_bytes": held, "straggler_wait_s": stragglers.waited_s, "run": run,
               "comm": meter.summary(), "planned": plan_check.compare(meter.summary(), held, env.device)}
    log(env, plan_check.report(summary["planned"]))
    if return_weights:
        summary["weights"] = strategy.full_state_dict()
    if cfg.train.sample_tokens and not stopped_early:
        summary["sample"] = sample(strategy, cfg, env)
        log(env, "sample:\n" + summary["sample"])
    return summary


def _noise_scale(cfg: Config, env: DistEnv, state: dict | None) -> NoiseScale | None:
    """The running gradient noise scale (zerodp.telemetry.grad_noise), or None when off or not measurable here
    (said once): the strategies measure the local norms under the same condition."""
    t = cfg.train
    if not t.grad_noise_scale:
        return None
    why = skip_reason(env.world_size, t.micro_batch_size, t.global_batch_size)
    if why:
        log(env, why)
        return None
    return NoiseScale(t.micro_batch_size, t.global_batch_size, t.grad_noise_ema, cfg.model.block_size, state)


def _report_step(env: DistEnv, bar, cfg: Config, record: dict) -> None:
    """The step on the console (at the sync point that fetched it): the progress bar's figures, or
    without a bar one line every train.log_every steps; a validation loss always gets its own line."""
    if env.rank != 0:
        return
    if bar is not None:
        mfu = {"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}
        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:,.0f}",
                        **mfu)
        bar.update(1)
    step = record["step"]
    if bar is None and (step % cfg.train.log_every == 0 or step == cfg.train.max_steps):
        mfu = f", MFU {record['mfu']:.1%}" if "mfu" in record else ""
        log(env, f"step {step}/{cfg.train.max_steps}: loss {record['loss']:.4f}, lr {record['lr']:.2e}, "
                 f"grad_norm {record['grad_norm']:.3f}, {record['tokens_per_s']:,.0f} tokens/s{mfu}")
    if "val_loss" in record:
        log(env, f"step {step}: val_loss {record['val_loss']:.4f}")


def _find_stragglers(monitor: StragglerMonitor, per_rank: list[list[float]], probed: bool,
                     env: DistEnv) -> list[dict]:
    """Feed one step's per-rank times (rows of the loop's all-gather) to the monitor; log what it finds.

    Compute is each rank's forward time, or, where the forward all-gathers parameters (`probed`), the
    forward time shared out in proportion to each rank's device-probe time."""
    compute, data_wait = [r[4] for r in per_rank], [r[2] for r in per_rank]
    if probed:
        compute = compute_from_probe(compute, [r[5] for r in per_rank])
    found = monitor.update(compute, data_wait)
    for f in found:
        if probed:
            f["measured_by"] = "device probe"
        log(env, f"straggler: rank {f['rank']} on {f['host']} is {f['slower_by']:.0%} slower than the other "
                 f"ranks ({f['step_time_s']:.3f}s vs {f['median_s']:.3f}s): {f['cause']}"
                 + (" (compute estimated from the device probe)" if probed else ""))
    return found


def train_step(strategy, micro_batches: list, lr: float, device: torch.device):
    """One optimizer step over this rank's micro batches, without waiting for the device.

    Returns (mean local loss, a 0-d tensor; global grad norm, a tensor or the float DeepSpeed hands
    back; a Stopwatch of the forward passes, read after a device sync; this rank's own micro-batch
    gradient norm squared before the reduction, a 0-d tensor, or None where the strategy does not
    measure it: the small batch of the gradient noise scale). Forward time is the straggler
    signal: under ddp/zero1/zero2 it holds no communication, so a slow rank shows there, while the fast
    ranks' waiting hides inside the backward's gradient reduction."""
    loss_sum = torch.zeros((), device=device)
    forward = Stopwatch(device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with strategy.micro_step(is_last=i == len(micro_batches) - 1):
            with strategy.autocast(), forward:
                loss = strategy.model(x, y)
            strategy.backward(loss)
        loss_sum += loss.detach().float()
    local_grad_sq = getattr(strategy, "local_grad_sq", None)  # optional; before step(): the loss scale
    local_sq = local_grad_sq() if local_grad_sq is not None else None
    grad_norm = strategy.step(lr)
    return loss_sum / len(micro_batches), grad_norm, forward, local_sq


@torch.no_grad()
def evaluate(strategy, val_data: TokenBatches, cfg: Config, env: DistEnv) -> float:
    """Mean validation loss over eval_batches micro batches per rank, averaged over ranks."""
    strategy.model.eval()
    total = torch.zeros((), device=env.device)
    micro = cfg.train.micro_batch_size
    for i in range(cfg.train.eval_batches):
        # Fixed validation batches: step index i of the validation split.
        x, y = val_data.rank_micro_batches(i, micro * env.world_size, micro, env.rank, env.world_size)[0]
        with strategy.autocast():
            total += strategy.model(x.to(env.device), y.to(env.device)).float()
    strategy.model.train()
    vals = all_gather_floats([total.item() / cfg.train.eval_batches])
    return sum(v[0] for v in vals) / env.world_size


def _say(bar, line: str) -> None:
    """A line on stderr from any thread, below a live progress bar rather than inside it."""
    print(("\n" if bar is not None else "") + line, file=sys.stderr, flush=True)


def _newest_checkpoint(out_dir: Path) -> str | None:
    """The checkpoint `latest` names (the newest complete one), or None before the first save."""
    try:
        return (checkpoint.checkpoint_root(out_dir) / "latest").read_text().strip() or None
    except OSError:
        return None


def _is_collective_failure(e: BaseException) -> bool:
    """A failed or timed-out collective (a peer died or hung), as opposed to a bug in this rank."""
    if isinstance(e, dist.DistBackendError):
        return True
    text = str(e)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out",
                                   "timed out", "Gloo", "NCCL", "connectFullMesh"))


def _set_aside_earlier_run(env: DistEnv, out_dir: Path, names: list[str]) -> None:
    """A run that starts at step 0 over an earlier one (--fresh, checkpoint.resume=false, or a run that
    never saved): move the earlier run's files (`names`: its checkpoints, metrics.jsonl, config.yaml,
    logger folders) together into one folder beside them, never deleting or truncating what it wrote,
    so that neither resume nor retention ever mixes the two runs."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out_dir / f"earlier-{stamp}", 1
    while aside.exists():
        n += 1
        aside = out_dir / f"earlier-{stamp}-{n}"
    aside.mkdir()
    for name in names:
        if (out_dir / name).exists():
            os.replace(out_dir / name, aside / name)
    log(env, f"moved the earlier run ({', '.join(names)}) to {aside}")


def _truncate_metrics(path: Path, start: int) -> None:
    """On resume, drop records past the checkpoint so metrics.jsonl reads as one run."""
    if not path.exists():
        return
    if start == 0:
        path.unlink()
        return
    kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
    tmp = path.with_name(path.name + ".tmp")  # swapped in whole: a crash here leaves the old file
    tmp.write_text("".join(ln + "\n" for ln in kept))
    os.replace(tmp, path)


def _progress(cfg: Config, env: DistEnv, start: int):
    if env.rank != 0 or not cfg.train.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.max_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stderr)
