"""`zerodp` command line: train, plan, convert, inspect, config, prepare, data, generate, eval, verify.

User errors (UserError) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from zerodp.cli.allocator import default_allocator
from zerodp.distributed.launcher import record_exit
from zerodp.errors import OneLineParser, PeerFailure, UserError


class _Parser(OneLineParser):
    def error_line(self, message: str) -> str:
        return f"zerodp: error: {message}; see '{self.prog} --help'"


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a GPT under any launcher (deepspeed, torchrun, python)",
                       description="Train per CONFIG.yaml, with section.key=value overrides; or continue the run in "
                                   "RUN_DIR from its config.yaml.")
    p.add_argument("config", help="training config, e.g. configs/tiny.yaml, or a run folder (runs/tiny): its "
                                  "config.yaml, train.out_dir that folder")
    # default=[]: argparse otherwise lists an empty nargs="*" positional among the missing arguments
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value, e.g. train.max_steps=50")
    p.add_argument("--fresh", action="store_true",
                   help="start from step 0 even if out_dir has checkpoints (the earlier run's checkpoints, metrics and "
                        "config are moved together into out_dir/earlier-<date>, not deleted)")
    p.add_argument("--from-checkpoint", metavar="STEP_FOLDER",
                   help="resume from this checkpoint of the run (step_00000250, or 250) instead of the newest; "
                        "`latest` then names it, later checkpoints stay, the records past it are moved to "
                        "out_dir/superseded-<date>")
    p.add_argument("--allow-data-change", action="store_true",
                   help="resume although train.seed or the data settings differ from the checkpoint's (a new "
                        "seed continues at the same sample count in the new order; new data starts at its "
                        "first sample)")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check that needs no process group, print the plan, the resolved config, the "
                        "keys you set (unlike the defaults), those resolved for you and where the run would start; "
                        "then exit")
    p.set_defaults(func=_run_train)


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="list every training config key with its type, default and meaning",
                       description="Print every key a training config (or a section.key=value override) accepts, "
                                   "grouped by section, with its type, default and what it does.")
    p.add_argument("section", nargs="?", default=None,
                   help="only this section: model, data, optim, train, strategy or checkpoint")
    p.set_defaults(func=_run_config)


def _run_config(args) -> int:
    from zerodp.config import _SECTIONS, format_field_docs

    if args.section is not None and args.section not in _SECTIONS:
        raise UserError(f"there is no config section {args.section!r}; choose one of {', '.join(_SECTIONS)}")
    print(format_field_docs(args.section))
    return 0


def _run_train(args) -> int:
    from zerodp.config import load_config, user_settings

    config, overrides = run_folder_config(args.config, args.overrides)
    cfg = load_config(config, overrides)
    start = {"from_checkpoint": args.from_checkpoint, "allow_data_change": args.allow_data_change}
    if args.dry_run:
        return _dry_run(cfg, args.fresh, user_settings(config, overrides), start)
    from zerodp.distributed.process_group import shutdown
    from zerodp.trainer.loop import train

    summary = train(cfg, fresh=args.fresh, **start)
    shutdown()  # only after success: with a dead peer, teardown itself could block
    record_exit(summary["exit_code"])  # zerodp.distributed.launcher's answer to a signal it forwarded: 0 or 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A gloo thread still finishing could abort interpreter finalisation ("terminate called without
        # an active exception", seen once in a preempted 2-rank run even after shutdown): leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(summary["exit_code"])
    return summary["exit_code"]


def run_folder_config(path: str, overrides: list[str]) -> tuple[str, list[str]]:
    """(config file, overrides) for `zerodp train PATH`: a run folder continues from its config.yaml,
    with train.out_dir that folder (kept as config.yaml writes it when it names the same folder)."""
    folder = Path(path)
    if not folder.is_dir():
        return path, overrides
    config = folder / "config.yaml"
    if not config.is_file():
        raise UserError(f"{folder} is a folder without a config.yaml, so no run to continue; pass a config file "
                        f"(e.g. configs/tiny.yaml) or a run folder zerodp train wrote")
    import yaml

    written = ((yaml.safe_load(config.read_text()) or {}).get("train") or {}).get("out_dir")
    same = written is not None and Path(written).resolve() == folder.resolve()
    return str(config), ([] if same else [f"train.out_dir={folder}"]) + list(overrides)


def _strip_local_rank(argv: list[str]) -> list[str]:
    """Remove the `--local_rank=N` the deepspeed launcher inserts (before the subcommand); export it."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith(("--local_rank", "--local-rank")):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "0")
            i += 1 if "=" in a else 2
            os.environ.setdefault("LOCAL_RANK", value)
            continue
        out.append(a)
        i += 1
    return out


def _dry_run(cfg, fresh: bool, given: dict, start: dict) -> int:
    """Run the start-up checks of a launch (zerodp.trainer.preflight, the launch's own; `start`: its
    from_checkpoint and allow_data_change) without a process group, then print the plan, the resolved
    config, the keys the user set (`given`, from config.user_settings) apart from those resolved for
    them, and where the run would start. Writes nothing."""
    from zerodp.config import dump_yaml, set_and_resolved
    from zerodp.planner import plan_for_training
    from zerodp.trainer.preflight import Alone, Machine, device_memory, micro_batch_line, preflight

    machine = Machine.from_environment(cfg)
    rank0 = os.environ.get("RANK", "0") == "0"

    def said(plan) -> None:  # printed before the checks that need the data
        if cfg.train.micro_batch_size == "auto" and rank0:
            print(f"zerodp: {micro_batch_line(plan)}", flush=True)

    ready = preflight(cfg, fresh, Alone(machine), on_plan=said, **start)
    plan, resolved, world = ready.plan, ready.cfg, machine.world_size
    if plan is None:
        memory, name = device_memory(machine.device, machine.local_world_size)
        plan = plan_for_training(cfg, world, memory, name)
    if rank0:
        for note in ready.notes:  # what the launch says at start-up about its inputs
            print(f"zerodp: {note}", file=sys.stderr)
        print(plan.table())
        print()
        print(dump_yaml(resolved), end="")
        print(f"# world_size {world}, grad_accum_steps {ready.grad_accum}, strategy {resolved.strategy.name}")
        mine, filled = set_and_resolved(given, resolved)
        for what, pairs in (("set by you, unlike the defaults (zerodp config lists them all)", mine),
                            ("resolved, not set by you (null keys from model.arch or model.hf_config, auto by "
                             "the planner)", filled)):
            print(f"# {what}: " + (", ".join(f"{k}={v!r}" for k, v in pairs) or "nothing"))
        where = ", ".join(f"{s.where} (weight {s.weight:g})" for s in ready.train_data.streams) \
            if cfg.data.sources else cfg.data.source
        print(f"# data: {len(ready.tokens):,} tokens from {where}")
        print(f"# {ready.start.why}{ready.start.superseded}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from zerodp import __version__

    parser = _Parser(prog="zerodp", description="Data-parallel GPT training: one pipeline, any strategy.")
    parser.add_argument("--version", action="version", version=f"zerodp {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser,
                                metavar="{train,plan,convert,inspect,config,prepare,data,generate,eval,verify}")
    sub.required = True
    _add_train(sub)
    from zerodp.convert import cli as convert_cli
    from zerodp.planner import cli as plan_cli

    plan_cli.add_parser(sub)
    convert_cli.add_convert_parser(sub)
    convert_cli.add_inspect_parser(sub)
    _add_config(sub)
    from zerodp.cli import prepare as prepare_cli

    prepare_cli.add_prepare_parser(sub)
    from zerodp.cli import data as data_cli

    data_cli.add_data_parser(sub)
    from zerodp.cli import use

    use.add_parsers(sub)
    from zerodp.cli import verify

    verify.add_verify_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    default_allocator(os.environ)  # before anything imports torch: the CUDA allocator reads it once
    # torch's and DeepSpeed's deprecation notices about their own internals (e.g. DeepSpeed calling
    # all_gather_into_tensor) name nothing a zerodp user can change.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|deepspeed)(\.|$)")
    argv = _strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow flags (`train cfg.yaml --fresh train.max_steps=5`): argparse leaves them over.
    unknown = [a for a in extra if a.startswith("-") or getattr(args, "command", None) not in ("train", "verify")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except UserError as e:
        _print_user_error(str(e))
        return _exit_code(2)
    except PeerFailure as e:
        print(f"zerodp: error: {e}", file=sys.stderr)
        return _exit_code(1)
    except BrokenPipeError:  # `zerodp config | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print("\nzerodp: stopped by Ctrl-C; the newest checkpoint (if any) is intact, nothing since it was "
                  "saved; run the same command again to continue", file=sys.stderr)
        return _exit_code(130)


# How long a rank other than 0 waits before printing an error that every rank found on its own.
PEER_ERROR_DELAY_S = 3.0


def _print_user_error(message: str) -> None:
    """One line from rank 0, always seen.

    Errors found after the process group is up are shared by the ranks (zerodp.trainer.preflight.agree) and printed
    by rank 0 alone. One found before it (a config error: the same on every rank) is found by every
    rank at once, and a launcher that sees any rank exit kills the others, so rank 0 could be killed
    before it prints. The other ranks therefore wait PEER_ERROR_DELAY_S and print it too if still alive:
    under a launcher, rank 0 has printed and exited by then and the launcher kills them first, so the
    user sees one line; when rank 0 never got to print, theirs is the line."""
    dist = sys.modules.get("torch.distributed")
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and grouped:
        return
    if rank != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(PEER_ERROR_DELAY_S)
    print(f"zerodp: error: {message}", file=sys.stderr, flush=True)


def _exit_code(code: int) -> int:
    """Leave a failed distributed run with `code` now: a teardown of process groups whose peers may be
    gone can block, and finalising Python under live communication threads can abort (exit 134)."""
    record_exit(code)  # zerodp.distributed.launcher then knows the code (1 included) for this rank's choice
    dist = sys.modules.get("torch.distributed")  # not imported: nothing to tear down
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
