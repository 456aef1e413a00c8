"""`zerodp verify CONFIG [overrides] --against KEY=VALUE[,KEY=VALUE] [--steps N] [--nproc N] [--keep]`:
the user's own config trained N steps as written and with the --against overrides, from the same
initial weights (a function of train.seed and the parameter's name, under any strategy and world size)
and the same global batches (a function of train.seed and the step), then compared step by step and
tensor by tensor (zerodp.trainer.compare). Exit 0: the same trajectory within the precision's
tolerance; 1: not (the first differing step and the tensors that differ most named); 2: bad input.

Both runs write into one temporary folder beside train.out_dir, removed at the end (--keep keeps it), their
console output into a.log and b.log there (shown on stderr when a run fails).
On one process, or under a launcher that started this command (torchrun, deepspeed), both runs train
one after another in this command's processes. With --nproc N, or `nproc=M` among the --against
pairs (another world size), each run is launched as its own `zerodp train`: under torchrun
(zerodp.distributed.launcher, as launchers/local.sh starts it) for more than one process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from zerodp.errors import UserError

# What both runs get besides the user's overrides: N steps, a save at the last only, nothing else.
FIXED = ["checkpoint.every=0", "checkpoint.keep_last=1", "checkpoint.resume=false", "train.eval_every=0",
         "train.sample_tokens=0", "train.progress=false", "train.tensorboard=false", "train.wandb="]
_OWN = {"train.max_steps", "train.out_dir", *(f.split("=")[0] for f in FIXED)}
_PAIR = re.compile(r",(?=\s*[A-Za-z_][\w.]*=)")  # a comma that starts the next KEY=VALUE


def add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="prove on your config that a change (strategy, world size, precision...) "
                                      "keeps the training trajectory",
                       description="Train CONFIG for --steps steps as written and with the --against overrides, "
                                   "from the same weights and batches; compare losses, grad norms and final "
                                   "weights. Exit 0 if they agree within the precision's tolerance, 1 if not.")
    p.add_argument("config", help="training config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value for both runs")
    p.add_argument("--against", required=True,
                   help="the change: KEY=VALUE[,KEY=VALUE], e.g. strategy.name=fsdp or nproc=1 (world size)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch each run on this many processes (torchrun); default: this command's own")
    p.add_argument("--keep", action="store_true", help="keep both runs' folders (printed at the end)")
    p.set_defaults(func=run_verify)


def parse_against(text: str) -> tuple[list[str], int | None]:
    """(config overrides, the other run's process count or None) of --against's KEY=VALUE pairs."""
    overrides, nproc = [], None
    for pair in (p.strip() for p in _PAIR.split(text)):
        key, eq, value = pair.partition("=")
        if not eq or not key or not value:
            raise UserError(f"--against {pair!r} is not KEY=VALUE; e.g. --against strategy.name=fsdp,train.seed=2")
        if key == "nproc":
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--against nproc={value} is not a number of processes; e.g. nproc=1")
            nproc = int(value)
        elif "." not in key:
            raise UserError(f"--against {pair!r}: {key!r} is no section.key (nor nproc); e.g. strategy.name=fsdp")
        elif key in _OWN or key.startswith("checkpoint."):
            raise UserError(f"--against {key}: zerodp verify sets it for both runs (--steps sets train.max_steps); "
                            f"change what you want to compare, e.g. strategy.name=fsdp")
        else:
            overrides.append(pair)
    return overrides, nproc


def model_shapes(cfg, trained_only: bool = False) -> dict[str, tuple]:
    """{name: shape} of cfg's parameters; `trained_only`: those a checkpoint holds and training changes
    (a LoRA run's adapters: its frozen base is neither saved nor updated)."""
    from zerodp.models import build_model

    return {n: tuple(p.shape) for n, p in build_model(cfg.model, device="meta").named_parameters()
            if p.requires_grad or not trained_only}


def check_inputs(args) -> tuple:
    """(config as written, config against, overrides against, nproc as written, nproc against), or a
    UserError/ConfigError for bad input."""
    from zerodp.config import load_config

    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: train at least 1 step (default 10)")
    if args.nproc is not None and args.nproc < 1:
        raise UserError(f"--nproc {args.nproc}: launch at least 1 process")
    against, nproc_b = parse_against(args.against)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and (args.nproc is not None or nproc_b is not None):
        raise UserError("zerodp verify runs under this launcher's processes: drop --nproc and nproc=, or run "
                         "zerodp verify on one process to let it launch each run")
    cfg_a = load_config(args.config, list(args.overrides) + [f"train.max_steps={args.steps}"])
    cfg_b = load_config(args.config, list(args.overrides) + against + [f"train.max_steps={args.steps}"])
    shapes_a, shapes_b = model_shapes(cfg_a), model_shapes(cfg_b)
    if shapes_a != shapes_b:
        keys = ", ".join(p.split("=")[0] for p in against if p.startswith("model."))
        raise UserError(f"--against {keys or args.against} changes the model's shape; verify compares one model "
                         f"under two settings: change strategy, world size, precision, batch split or the like")
    return cfg_a, cfg_b, against, args.nproc, nproc_b


def run_verify(args) -> int:
    """The command: exit 0 when the runs agree, 1 when not, on every rank (the launcher sees one outcome)."""
    from zerodp.distributed.launcher import record_exit

    return record_exit(_verify(args))


def _verify(args) -> int:
    cfg_a, cfg_b, against, nproc_a, nproc_b = check_inputs(args)
    launch = nproc_a is not None or nproc_b is not None
    nproc_a = nproc_a or 1
    nproc_b = nproc_b or nproc_a
    rank0 = os.environ.get("RANK", "0") == "0"
    work = _work_folder(Path(cfg_a.train.out_dir), rank0)
    common = list(args.overrides) + FIXED + [f"train.max_steps={args.steps}"]
    runs = [("as written", nproc_a, common + [f"train.out_dir={work / 'a'}"]),
            (f"against {args.against}", nproc_b, common + against + [f"train.out_dir={work / 'b'}"])]
    keep, done = args.keep, False
    try:
        for (label, nproc, overrides), name in zip(runs, "ab"):
            if rank0:
                print(f"zerodp verify: training {args.steps} steps {label}"
                      + (f" on {nproc} process(es)" if launch else ""), file=sys.stderr, flush=True)
            if launch:
                code = _launched(args.config, overrides, nproc, work / f"{name}.log")
                if code:
                    keep = True
                    print(f"zerodp: error: the run {label} failed (exit {code}); its output is in {work}",
                          file=sys.stderr)
                    return 2 if code == 2 else 1
            else:
                _in_process(args.config, overrides, work / f"{name}.log" if rank0 else None)
        code = 0
        if rank0:
            from zerodp.trainer.compare import compare_runs, tolerance_for

            verdict = compare_runs(work / "a", work / "b", model_shapes(cfg_a, trained_only=True),
                                   tolerance_for(cfg_a.train.precision, cfg_b.train.precision))
            print(verdict.report(f"{args.config} as written", f"--against {args.against}"), flush=True)
            if keep:
                print(f"zerodp verify: both runs kept in {work} (a: as written, b: against)")
            code = 0 if verdict.passed else 1
        done = True
        return _shared(code)
    finally:
        if done:
            _barrier()  # every rank is done with the folder (after an error a peer may be gone: no wait)
        if not keep and rank0:
            shutil.rmtree(work, ignore_errors=True)


def _work_folder(out_dir: Path, rank0: bool) -> Path:
    """A new folder beside train.out_dir (a file system every node sees), one name on every rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank must name the same folder: no clock, no pid
        tag = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "0")
    else:
        tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    work = out_dir.parent / f"verify-{out_dir.name}-{tag}"
    if rank0:
        try:
            work.mkdir(parents=True)
        except FileExistsError:
            raise UserError(f"{work} exists already; remove it or rerun (verify never writes into a folder it "
                             f"did not create)") from None
        except OSError as e:
            raise UserError(f"cannot create {work} beside train.out_dir ({e.strerror}); set train.out_dir to a "
                             f"folder you can write to") from None
    return work


def _in_process(config: str, overrides: list[str], log: Path | None) -> None:
    """One run in this process, its console output kept out of the verdict's way: written to `log`
    (None: dropped) when it trains, shown on stderr when it fails."""
    import contextlib
    import io

    from zerodp.config import load_config
    from zerodp.trainer.loop import train

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            train(load_config(config, overrides), fresh=True)
    except BaseException:
        sys.stderr.write(out.getvalue())
        raise
    if log is not None:
        log.write_text(out.getvalue())


def _launched(config: str, overrides: list[str], nproc: int, log: Path) -> int:
    """One run as its own `zerodp train` on `nproc` processes; its output into `log`; its exit code."""
    train = ["-m", "zerodp", "train", config, *overrides]
    if nproc > 1:
        cmd = [sys.executable, "-m", "zerodp.distributed.launcher", "--standalone", "--nproc-per-node", str(nproc),
               *train]
    else:
        cmd = [sys.executable, *train]
    env = dict(os.environ)
    env.pop("ZERODP_OUTCOME_DIR", None)
    with open(log, "w") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode


def _shared(code: int) -> int:
    """Rank 0's `code` on every rank of this command's process group (none: `code`)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from zerodp.distributed.process_group import broadcast_object

        return broadcast_object(code)
    return code


def _barrier() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
