"""What a run records of its steps: metrics.jsonl, the metric loggers (tensorboard, wandb), the
figures behind each record (tokens/s, MFU, the gradient noise scale) and the console (a progress bar,
or one line every train.log_every steps)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from zerodp.config import Config
from zerodp.distributed.process_group import DistEnv
from zerodp.models import arch_of, flops_per_token
from zerodp.telemetry import loggers, router
from zerodp.telemetry.grad_noise import NoiseScale, advice, skip_reason
from zerodp.telemetry.step_metrics import Pending, Throughput, describe_run, peak_flops
from zerodp.trainer.preflight import Together


def log(env: DistEnv, msg: str) -> None:
    """A line on rank 0's stderr, on its own line: above a live progress bar, never inside it."""
    if env.rank == 0:
        from tqdm import tqdm

        tqdm.write(f"zerodp: {msg}", file=sys.stderr)
        sys.stderr.flush()


class Records:
    """The run's step records from step `start` on: metrics.jsonl (appended to: a resume has moved the
    records past `start` aside, zerodp.trainer.resume), the metric loggers and the console on rank 0;
    the losses, throughput and noise scale on every rank.
    Collective to build (the loggers start on rank 0, their errors raised on every rank)."""

    def __init__(self, cfg: Config, env: DistEnv, start: int, tokens_seen: int, noise_state: dict | None):
        self.cfg, self.env = cfg, env
        self.metrics_path = Path(cfg.train.out_dir) / "metrics.jsonl"
        self.loggers = Together(env).first(
            lambda: loggers.MetricLoggers(cfg, Path(cfg.train.out_dir), start), share=False)
        peak, no_peak = peak_flops(cfg, env.device)
        if no_peak:
            log(env, no_peak)
        self.throughput = Throughput(cfg, env.rank, env.world_size, flops_per_token(cfg.model), peak, tokens_seen)
        self.noise = _noise_scale(cfg, env, noise_state)
        self.bar = _progress(cfg, env, start)
        self.losses: dict[int, float] = {}
        self.records: list[dict] = []
        self._since_line: list[dict] = []
        self.sparse_blocks: list[int] | None = None
        """A mixture of experts: the model's index of each sparse block (the router figures' order)."""
        """Records since the last console line (train.progress=false), for its median."""

    def measure(self, p: Pending, per_rank: list[list[float]], sync_wait: float, comm: dict) -> dict:
        """The record of pending step `p` from its per-rank figures (rows of the loop's all-gather) and
        its collectives (`comm`, zerodp.telemetry.comm)."""
        record = self.throughput.record(p, per_rank, sync_wait)
        record.update(comm)
        self.losses[p.step] = record["loss"]
        if self.noise is not None:  # the same numbers on every rank: every rank keeps the same averages
            estimate = self.noise.update(statistics.fmean(r[6] for r in per_rank), record["grad_norm"] ** 2, p.spread)
            if estimate is not None:
                record["grad_noise_scale"] = estimate
        return record

    def router_load(self, load: list[list[float]], first: int, last: int) -> dict:
        """The router figures of steps first..last (zerodp.telemetry.router) for the interval's last record;
        a line (rank 0) when an expert received no token in all of them."""
        figures = router.router_figures(load)
        if self.sparse_blocks is None:
            a = arch_of(self.cfg.model)
            self.sparse_blocks = [i for i in range(a.n_layer) if a.is_moe_layer(i)]
        line = router.idle_warning(figures, self.sparse_blocks, first, last)
        if line:
            log(self.env, line)
        return figures

    def publish(self, new: list[dict]) -> None:
        """Keep the records of a sync point; write them to metrics.jsonl and the loggers, show them."""
        self.records += new
        if self.env.rank == 0:
            with open(self.metrics_path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            for r in new:
                self.loggers.log(r)
        for r in new:
            self._report_step(r)

    def trainer_state(self, step: int) -> dict:
        """What a checkpoint at `step` keeps for the loop to continue: tokens seen, loss, noise averages."""
        return {"step": step, "tokens": self.throughput.tokens, "loss": self.losses[step],
                **({"grad_noise": self.noise.state()} if self.noise is not None else {})}

    def flush(self) -> None:
        if self.loggers is not None:
            self.loggers.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.loggers is not None:
            self.loggers.close()

    def say(self, line: str) -> None:
        """A line on stderr from any thread, below a live progress bar rather than inside it."""
        print(("\n" if self.bar is not None else "") + line, file=sys.stderr, flush=True)

    def summary(self, straggler_wait_s: float, save_s: float) -> dict:
        """The run's figures (Throughput.summary, with the last gradient noise scale), said on the console."""
        run = self.throughput.summary(self.records, straggler_wait_s, save_s)
        if run:
            log(self.env, describe_run(run))
        if self.noise is not None and self.records:
            run["grad_noise_scale"] = self.noise.estimate()
            log(self.env, advice(self.cfg.train.global_batch_size, self.noise.estimate(), self.noise.steps))
        return run

    def _report_step(self, record: dict) -> None:
        """The step on the console (at the sync point that fetched it): the progress bar's figures, or
        without a bar one line every train.log_every steps; a validation loss always gets its own line."""
        env, bar, cfg = self.env, self.bar, self.cfg
        if env.rank != 0:
            return
        if bar is not None:
            mfu = {"mfu": f"{record['mfu']:.1%}"} if "mfu" in record else {}
            epoch = {"epoch": f"{record['epoch']:.2f}"} if "epoch" in record else {}
            balance = {"balance": f"{record['balance_loss']:.3f}"} if "balance_loss" in record else {}
            bar.set_postfix(loss=f"{record['loss']:.4f}", **balance, lr=f"{record['lr']:.2e}",
                            tok_s=f"{record['tokens_per_s']:,.0f}", **epoch, **mfu)
            bar.update(1)
        step = record["step"]
        self._since_line.append(record)
        if bar is None and (step % cfg.train.log_every == 0 or step == cfg.train.max_steps):
            # the median of the steps since the last line, each step's own figures, without the warm-up
            kept, what = self.throughput.measured(self._since_line)
            self._since_line = []
            rate = statistics.median(r["tokens_per_s"] for r in kept)
            mfu = f", MFU {statistics.median(r['mfu'] for r in kept):.1%}" if "mfu" in record else ""
            epoch = f", epoch {record['epoch']:.2f}" if "epoch" in record else ""
            balance = f", balance_loss {record['balance_loss']:.4f}" if "balance_loss" in record else ""
            if "moe/max_load" in record:
                balance += router.summary(record)
            balance += "".join(f", {k} {record[k]:.4f}" for k in ("rewards/margins", "rewards/accuracies")
                               if k in record)  # train.objective=dpo
            log(env, f"step {step}/{cfg.train.max_steps}: loss {record['loss']:.4f}{balance}, lr {record['lr']:.2e}, "
                     f"grad_norm {record['grad_norm']:.3f}{epoch}, {rate:,.0f} tokens/s{mfu} (median of {what})")
        if "val_loss" in record:
            each = ", ".join(f"{k.removeprefix('val_loss/')} {v:.4f}" for k, v in record.items()
                             if k.startswith("val_loss/"))
            log(env, f"step {step}: val_loss {record['val_loss']:.4f}" + (f" ({each})" if each else ""))


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


def _progress(cfg: Config, env: DistEnv, start: int):
    """The progress bar on rank 0's terminal; None without one (a log file, a pipe: a bar's redraws would
    fill it), and then the steps are lines every train.log_every steps."""
    if env.rank != 0 or not cfg.train.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.max_steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stderr)
