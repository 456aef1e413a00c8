"""`zerodp` command line: train, plan, convert, inspect.

User errors (UserError) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from zerodp.errors import PeerFailure, UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage block too)
        print(f"zerodp: error: {message}; see '{self.prog} --help'", file=sys.stderr)
        sys.exit(2)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a GPT under any launcher (deepspeed, torchrun, python)",
                       description="Train per CONFIG.yaml, with section.key=value overrides.")
    p.add_argument("config", help="training config, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.max_steps=50")
    p.add_argument("--fresh", action="store_true", help="start from scratch even if out_dir has checkpoints")
    p.add_argument("--dry-run", action="store_true", help="print the plan and resolved config, then exit")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from zerodp.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        return _dry_run(cfg)
    from zerodp.dist import shutdown
    from zerodp.train import train

    train(cfg, fresh=args.fresh)
    shutdown()  # only after success: with a dead peer, teardown itself could block
    return 0


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


def _dry_run(cfg) -> int:
    """Print the plan and the resolved config for this launch, without training."""
    import torch

    from zerodp.config import dump_yaml
    from zerodp.planner import plan_for_training
    from zerodp.train import device_memory, resolve_strategy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    accum = cfg.check_batch_split(world)
    use_cuda = torch.cuda.is_available() and cfg.train.device in ("auto", "cuda")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    resolved, plan = resolve_strategy(cfg, world, device, local)
    if plan is None:
        memory, name = device_memory(device, local)
        plan = plan_for_training(cfg, world, memory, name)
    if os.environ.get("RANK", "0") == "0":
        print(plan.table())
        print()
        print(dump_yaml(resolved), end="")
        print(f"# world_size {world}, grad_accum_steps {accum}, strategy {resolved.strategy.name}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zerodp", description="Data-parallel GPT training: one pipeline, any strategy.")
    sub = parser.add_subparsers(dest="command", metavar="{train,plan,convert,inspect}", parser_class=_Parser)
    sub.required = True
    _add_train(sub)
    from zerodp.convert import cli as convert_cli
    from zerodp.planner import cli as plan_cli

    plan_cli.add_parser(sub)
    convert_cli.add_convert_parser(sub)
    convert_cli.add_inspect_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = _strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow flags (`train cfg.yaml --fresh train.max_steps=5`): argparse leaves them over.
    unknown = [a for a in extra if a.startswith("-") or getattr(args, "command", None) != "train"]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        return args.func(args)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"zerodp: error: {e}", file=sys.stderr)
        return _exit_code(2)
    except PeerFailure as e:
        print(f"zerodp: error: {e}", file=sys.stderr)
        return _exit_code(1)
    except KeyboardInterrupt:
        return _exit_code(130)


def _exit_code(code: int) -> int:
    """Leave a failed distributed run with `code` now: a teardown of process groups whose peers may be
    gone can block, and finalising Python under live communication threads can abort (exit 134)."""
    dist = sys.modules.get("torch.distributed")  # not imported: nothing to tear down
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
