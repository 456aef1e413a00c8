"""`zerodp convert SRC DST` and `zerodp inspect PATH`.

Wired into zerodp/cli.py by `add_convert_parser(sub)` and `add_inspect_parser(sub)`; each sets
`func(args) -> int`; zerodp/cli.py turns a UserError into one line on stderr and exit 2. This module
never imports zerodp.cli.commands (no import circle): run it as `zerodp convert|inspect` or `python -m zerodp`.
"""

from __future__ import annotations

import time
from pathlib import Path

from zerodp.errors import UserError

TARGETS = ("safetensors", "hf", "zerodp", "peft")
DTYPE_NAMES = ("fp32", "bf16", "fp16")


def add_convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a checkpoint (zerodp, DeepSpeed, DCP, safetensors, a Hugging Face model folder) "
                        "to safetensors, a Hugging Face model folder, zerodp or a PEFT adapter",
        description="Detect what SRC is and write it to DST: consolidated safetensors as SRC names them, a "
                    "Hugging Face model folder (config.json and weights that transformers' from_pretrained "
                    "loads), a zerodp checkpoint in the canonical layout (resume at any world size), or for a LoRA "
                    "run a PEFT adapter folder (--to peft) or the merged model (--to hf --merge).")
    p.add_argument("src", help="checkpoint: zerodp step_ folder or out_dir, DeepSpeed save_dir, DCP folder, "
                               ".safetensors file or folder")
    p.add_argument("dst", help="output folder (created; must be new or empty, outside SRC, and not hold SRC)")
    p.add_argument("--to", default="safetensors", help="safetensors (default) | hf | zerodp | peft (a LoRA run's "
                                                       "adapters, for peft.PeftModel.from_pretrained)")
    p.add_argument("--merge", action="store_true",
                   help="hf target of a LoRA run (or a PEFT folder): the base with the adapters merged in (W + alpha/r "
                        "B A), a plain model")
    p.add_argument("--dtype", default=None,
                   help="safetensors/hf weights dtype: fp32 | bf16 | fp16 (default: as stored)")
    p.add_argument("--max-shard-size", default=None, help="split safetensors/hf output into shards, e.g. 5GB")
    p.add_argument("--config", default=None,
                   help="hf target: the zerodp config the weights were trained with, for a source that records "
                        "none (a DeepSpeed or DCP folder written outside zerodp)")
    p.add_argument("--step", type=int, default=None, help="zerodp target: training step to record")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST if it is an earlier output of `zerodp convert` with the same --to")
    p.add_argument("--max-memory", default="256MiB",
                   help="bytes of tensors read ahead of the writer (default 256MiB; at least the largest tensor is "
                        "always read): peak memory is about this plus one tensor being written")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_convert)


def add_inspect_parser(sub) -> None:
    p = sub.add_parser("inspect", help="say what a checkpoint is and whether it is intact",
                       description="Print format, strategy, world size, step, parameter count, dtypes, size and "
                                   "integrity. Exit 0 if intact, 1 if a file is missing or damaged.")
    p.add_argument("path", help="checkpoint file or folder")
    p.set_defaults(func=run_inspect)


def run_convert(args) -> int:
    from zerodp.convert.destination import check_destination, parse_size  # no torch: see below

    refuse_prepared_data(args.src, "convert")
    if args.to not in TARGETS:
        raise UserError(f"--to {args.to} is not a target; use --to safetensors or --to zerodp, --to hf for a "
                        f"Hugging Face model folder, or --to peft for a LoRA run's adapters")
    if args.merge and args.to != "hf":
        raise UserError("--merge applies to --to hf (the LoRA model's merged weights); remove it, or pass --to hf")
    if args.to == "peft" and (args.max_shard_size or args.config or args.step is not None):
        raise UserError("--max-shard-size, --config and --step do not apply to --to peft (one adapter file, the "
                        "model the run records); remove them")
    if args.dtype is not None and args.dtype not in DTYPE_NAMES:
        raise UserError(f"--dtype {args.dtype} is not supported; use fp32, bf16 or fp16")
    if args.to == "zerodp" and (args.dtype not in (None, "fp32") or args.max_shard_size):
        raise UserError("--dtype and --max-shard-size apply to --to safetensors and hf; a zerodp checkpoint is "
                        "always fp32")
    if args.config and args.to != "hf":
        raise UserError("--config applies to --to hf (the model a source without one holds); remove it")
    dst = Path(args.dst)
    if dst.suffix == ".safetensors" and not dst.is_dir():  # (an earlier output of that name stays replaceable)
        raise UserError(f"{args.dst} names a .safetensors file, but zerodp convert writes a folder (model.safetensors "
                        f"or shards with their index, and the tokenizer, config.json for --to hf); give a folder, "
                        f"e.g. {dst.with_suffix('')}")
    shard = parse_size(args.max_shard_size, "--max-shard-size") if args.max_shard_size else None
    window = parse_size(args.max_memory, "--max-memory")
    # Before SRC is opened (and hashed): DST must not overlap SRC as given (an out_dir, say, of which
    # the source reads one step folder) nor be anything but new, empty or an earlier output of --to.
    # The writer checks again against every file the source reads, and writes through a staging folder.
    check_destination(args.dst, args.to, args.overwrite, inputs=[args.src])
    t0 = time.time()
    hashing = _begin_hashing(args.src)
    try:
        return _convert(args, shard, window, hashing, t0)
    finally:
        if hashing is not None:
            hashing.cancel()  # a no-op once the source has confirmed it; else (an error) stop the threads


def refuse_prepared_data(path: str, command: str) -> None:
    """A `zerodp prepare` folder, or a file of one, is training data, not a checkpoint (its meta.json would
    otherwise read as an incomplete checkpoint's): say what it is and what to do, in one line."""
    from zerodp.config.sources import prepared_meta

    p = Path(path)
    folder = p.parent if p.is_file() else p
    meta = prepared_meta(str(folder))
    if meta is None:
        return
    tokens = sum(int(split.get("tokens") or 0) for split in (meta.get("splits") or {}).values()
                 if isinstance(split, dict))
    what = f"a file of the `zerodp prepare` folder {folder}" if p.is_file() else "a `zerodp prepare` folder"
    raise UserError(f"{path} is training data, not a checkpoint: {what} ({tokens:,} tokens in train.bin and "
                    f"val.bin); train on it with data.source={folder}, and give zerodp {command} a run's checkpoint "
                    f"(its train.out_dir or a step_ folder)")


def _begin_hashing(src: str):
    """A zerodp checkpoint's sha256 check (zerodp.checkpoint.manifest.BackgroundVerify), begun before torch is
    imported: the hashing threads run while the imports (2-4 s) hold the main one. None for other formats."""
    from zerodp.checkpoint.manifest import BackgroundVerify, resolve_step_folder

    path = Path(src)
    try:
        step = resolve_step_folder(path) if path.is_dir() else None
    except Exception:  # a broken `latest`: open_checkpoint says so in its own words
        return None
    return BackgroundVerify(step) if step is not None else None


def _convert(args, shard, window, hashing, t0) -> int:
    from zerodp.convert import open_checkpoint, write_safetensors, write_zerodp
    from zerodp.convert.peft import is_peft_folder
    from zerodp.convert.writers import write_hf

    if args.to == "peft" or args.merge or is_peft_folder(args.src):
        return _convert_lora(args, shard, window, hashing, t0)
    model = None
    if args.config:
        from zerodp.config import load_config

        model = load_config(args.config).to_dict()["model"]
    with open_checkpoint(args.src, verify_deep=True, hash_beside_reads=True, hashing=hashing) as src:
        _refuse_lora(src, args)
        if args.to == "safetensors":
            out = write_safetensors(src, args.dst, dtype=args.dtype, max_shard_size=shard,
                                    progress=not args.no_progress, overwrite=args.overwrite, window=window)
            what = f"{len(out)} file{'s' if len(out) > 1 else ''}"
        elif args.to == "hf":
            out = write_hf(src, args.dst, dtype=args.dtype, max_shard_size=shard, progress=not args.no_progress,
                           overwrite=args.overwrite, model=model, window=window)
            what = f"a Hugging Face model folder ({len(out)} files)"
        else:
            write_zerodp(src, args.dst, step=args.step, progress=not args.no_progress, overwrite=args.overwrite,
                         window=window)
            what = "a zerodp checkpoint"
        n = len(src.param_names())
    _said(src, n, what, args.dst, t0)
    if args.to == "zerodp":
        _say_what_resumes(Path(args.dst))
    return 0


def _said(src, n: int, what: str, dst: str, t0: float) -> None:
    seconds = time.time() - t0
    written = sum(f.stat().st_size for f in Path(dst).rglob("*") if f.is_file())
    print(f"converted {src.format} checkpoint {src.path} ({n} tensor{'' if n == 1 else 's'}) to {what} in {dst} "
          f"({binary_size(written)} in {seconds:.1f}s, {binary_size(written / max(seconds, 1e-9))}/s)")


def binary_size(n: float) -> str:
    """Bytes in the largest of B, KiB, MiB, GiB, TiB that keeps the figure at 1 or more, to three
    significant digits ('812 B', '41.5 KiB', '1.23 GiB'): a small conversion is not '0 MB'."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    k = 0
    while k < len(units) - 1 and n >= 1024 ** (k + 1):
        k += 1
    value = n / 1024 ** k
    if k == 0:
        return f"{value:.0f} B"
    return f"{value:.3g} {units[k]}" if value < 1000 else f"{value:,.0f} {units[k]}"


def _refuse_lora(src, args) -> None:
    """A LoRA run's checkpoint holds its adapters alone: as a Hugging Face model it needs --merge."""
    from zerodp.convert.lora_source import recorded_lora

    if args.to == "hf" and recorded_lora(src.meta) is not None:
        raise UserError(f"{args.src} is a LoRA run's checkpoint (its adapters alone, not a model); pass --merge for "
                        f"the base with the adapters merged in, or --to peft for a PEFT adapter folder")


def _convert_lora(args, shard, window, hashing, t0) -> int:
    """--to peft (the adapters, PEFT's format) or --to hf --merge (base + adapters merged) of a LoRA run's
    checkpoint or a PEFT folder (zerodp.convert.lora_source: the base its record names)."""
    import json

    from zerodp.convert import open_checkpoint
    from zerodp.convert.lora_source import lora_of, peft_model, recorded_lora
    from zerodp.convert.peft import is_peft_folder, write_peft
    from zerodp.convert.writers import DTYPES, _read_paths, write_hf

    if is_peft_folder(args.src):
        if args.to != "hf" or not args.merge:
            raise UserError(f"{args.src} is a PEFT adapter folder; zerodp converts it with --to hf --merge (the base "
                            f"it names with the adapters merged in)")
        src = peft_model(args.src, merged=True)
    else:
        plain = open_checkpoint(args.src, verify_deep=True, hash_beside_reads=True, hashing=hashing)
        if recorded_lora(plain.meta) is None:
            plain.close()
            raise UserError(f"{args.src} holds no LoRA adapters (its run set no model.lora); --to peft and --merge "
                            f"apply to a LoRA run: use --to hf for a full model")
        try:
            src = lora_of(plain, merged=args.merge)
        except BaseException:
            plain.close()
            raise
    with src:
        if args.to == "hf":
            out = write_hf(src, args.dst, dtype=args.dtype, max_shard_size=shard, progress=not args.no_progress,
                           overwrite=args.overwrite, window=window)
            what, n = f"a Hugging Face model folder, adapters merged ({len(out)} files)", len(src.param_names())
        else:
            from zerodp.convert.destination import check_destination

            check_destination(args.dst, "peft", args.overwrite, _read_paths(src))
            dtype = DTYPES[args.dtype] if args.dtype else None
            adapters = {k: t.to(dtype) if dtype else t for k, t in src.adapters.items()}
            from zerodp.convert.lora_source import BaseModel
            from zerodp.convert.peft import BASE_FOLDER

            base = recorded_lora(src.meta)["base"].get("init_from")
            md = {"zerodp.source": json.dumps(src.describe(), sort_keys=True),
                  "zerodp.config": json.dumps({"model": src.meta["config"]["model"]}, sort_keys=True)}
            # a seeded base is in no folder: written inside as a Hugging Face folder, so the export is usable
            write_peft(adapters, args.dst, src.base.arch, src.spec, base, md, confirm=src.confirm,
                       base_model=None if base else BaseModel(src))
            what, n = "a PEFT adapter folder", len(adapters)
            if not base:
                what += (f" with its base ({src.base.what}) as the Hugging Face folder {BASE_FOLDER}/ inside, which "
                         f"base_model_name_or_path names")
    _said(src, n, what, args.dst, t0)
    return 0


def _say_what_resumes(dst: Path) -> None:
    """An import into a run's checkpoints folder: say so when a rerun of that run would resume from
    another checkpoint (the one `latest` names, or a newer one), and how to choose this one."""
    from zerodp.checkpoint.manifest import checkpoint_order, latest_name, recorded_step

    root = dst.parent
    if root.name != "checkpoints" or dst.name not in {p.name for p in checkpoint_order(root)}:
        return
    first = checkpoint_order(root)[0]
    if first.name == dst.name:
        return
    why = "`latest` names it" if latest_name(root) == first.name else "it records a later step"
    print(f"note: a run in {root.parent} resumes from {first.name} (step {recorded_step(first)}: {why}), not from "
          f"this import; to resume from it: echo {dst.name} > {root / 'latest'}")


def run_inspect(args) -> int:
    from zerodp.convert import detect_format
    from zerodp.convert.inspect import inspect_checkpoint

    refuse_prepared_data(args.path, "inspect")
    detect_format(args.path)  # not a checkpoint at all: bad input (exit 2), not a damaged one (exit 1)
    lines, ok = inspect_checkpoint(args.path)
    print("\n".join(lines))
    return 0 if ok else 1
