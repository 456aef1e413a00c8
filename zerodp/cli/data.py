"""`zerodp data batch` and `zerodp data stats`: what the sampler (zerodp.data.samples) feeds a run.

    zerodp data batch configs/tiny.yaml --step 1000 --world 8 --micro 4 [--json] [--decode]
    zerodp data stats runs/mine

`batch` prints step K's global batch as training draws it, for each row its source, sample, token range
and documents, and the rank and micro batch that train it (at --world and --micro: the batch itself is
the same at every split); --decode adds each sample's text. `stats` prints per source its documents,
tokens, samples per epoch and the epochs train.max_steps reaches. Both read a training config (with
section.key=value overrides) or a run folder (its config.yaml).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from zerodp.errors import UserError


def add_data_parser(sub) -> None:
    p = sub.add_parser("data", help="what the sampler feeds a run: one step's global batch, or per-source statistics",
                       description="Inspect the training data as the sampler draws it (docs/data.md).")
    inner = p.add_subparsers(dest="data_command", metavar="{batch,stats}", parser_class=type(p))
    inner.required = True
    b = inner.add_parser("batch", help="step K's global batch: each row's source, documents, tokens, rank and micro "
                                       "batch", description="Print step K's global batch as training draws it.")
    _config_args(b)
    b.add_argument("--step", type=int, required=True, help="the optimizer step (0 is the first)")
    b.add_argument("--world", type=int, default=None,
                   help="ranks to split the batch over (default: a run folder's own, from its newest checkpoint; "
                        "else 1)")
    b.add_argument("--micro", type=int, default=None, help="micro batch per rank (default train.micro_batch_size)")
    b.add_argument("--json", action="store_true", help="one JSON object")
    b.add_argument("--decode", action="store_true", help="each sample's text (the prepared folder's tokenizer; bytes "
                                                          "for raw text)")
    b.set_defaults(func=run_batch)
    s = inner.add_parser("stats", help="per source: documents, tokens, samples per epoch, epochs at train.max_steps",
                         description="Per source: documents, tokens, samples per epoch and epochs at train.max_steps.")
    _config_args(s)
    s.add_argument("--json", action="store_true", help="one JSON object")
    s.set_defaults(func=run_stats)


def _config_args(p) -> None:
    p.add_argument("config", help="a training config (YAML) or a run folder (its config.yaml)")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value, e.g. data.source=data/mine")


def _config(path: str, overrides: list[str]):
    from zerodp.config import load_config

    p = Path(path)
    if p.is_dir():
        if not (p / "config.yaml").is_file():
            raise UserError(f"{path} holds no config.yaml; give a training config or the train.out_dir of a run")
        p = p / "config.yaml"
    return load_config(str(p), overrides)


_KEPT_CONFIG = re.compile(r"config\.steps-(\d+)-(\d+)(?:-\d+)?\.yaml")


def run_segment(run: Path, step: int) -> tuple[Path, int, int | None]:
    """(the config that trained global batch `step` of a run folder, the first and the end global batch
    that config trained, None while it trains on): a resume that changed the settings (another global
    batch, say) kept the earlier ones as config.steps-A-B.yaml, the config of global batches A..B-1
    (steps A+1..B, zerodp.trainer.resume), and config.yaml trains from the last such B on."""
    kept = []
    for f in run.glob("config.steps-*.yaml"):
        if m := _KEPT_CONFIG.fullmatch(f.name):
            kept.append((int(m.group(1)), int(m.group(2)), f.stat().st_mtime, f))
    for first, end, _, f in sorted(kept, key=lambda k: k[2], reverse=True):  # a rewritten range: the newest
        if first <= step < end:
            return f, first, end
    return run / "config.yaml", max((end for _, end, _, _ in kept), default=0), None


def recorded_origin(run: Path, first: int, end: int | None, global_batch: int) -> tuple[int, int]:
    """(step, position): where a run folder's global batch `step` started in the sample sequence, for the
    config that trained global batches first..end-1 at `global_batch`: from a checkpoint that config saved
    (trainer.json's "samples", the samples consumed before its step), else the steps before `first` at each
    kept config's global batch (no checkpoint of it left: keep_last removed them)."""
    from zerodp.checkpoint.manifest import checkpoint_order, recorded_step

    for folder in checkpoint_order(run / "checkpoints"):
        saved = recorded_step(folder)
        if saved is None or saved <= first or (end is not None and saved > end):
            continue
        try:
            samples = json.loads((folder / "trainer.json").read_text()).get("samples")
        except (OSError, ValueError):
            continue
        if isinstance(samples, int):
            return first, samples - (saved - first) * global_batch
    position = 0
    for f in run.glob("config.steps-*.yaml"):
        if (m := _KEPT_CONFIG.fullmatch(f.name)) and int(m.group(2)) <= first:
            from zerodp.config import load_config

            position += (int(m.group(2)) - int(m.group(1))) * load_config(str(f)).train.global_batch_size
    return first, position


def run_world(path: str) -> int | None:
    """The world size a run folder's newest checkpoint records (`checkpoints/latest`, else the newest
    step folder), or None (a config file, a run without a checkpoint)."""
    from zerodp.checkpoint.manifest import checkpoint_order

    root = Path(path) / "checkpoints"
    if not Path(path).is_dir() or not root.is_dir():
        return None
    for folder in checkpoint_order(root):
        try:
            world = json.loads((folder / "meta.json").read_text()).get("world_size")
        except (OSError, ValueError):
            continue
        if isinstance(world, int) and world >= 1:
            return world
    return None


def _batches(cfg, split: str = "train"):
    from zerodp.data.batches import TokenBatches, load_tokens

    return TokenBatches(load_tokens(cfg), cfg, split, document_masking=False)


def rows_of(cfg, step: int, world: int, micro: int, decode: bool = False,
            origin: tuple[int, int] | None = None) -> list[dict]:
    """Step `step`'s global batch, a dict per row: row, rank, micro, source, sample, epoch, tokens
    [start, end) in the source's split file (the real tokens of the row: with data.packing=false a
    conversation's first block_size + 1 at most, the rest of the row padding), documents [first, last]
    (None without an index), targets (the row's target tokens, what its loss is taken over), padding, and
    with `decode` the sample's text. `origin` (step, position): where a resumed run's batches continued
    (zerodp.data.batches.TokenBatches.continue_from); None: global batch k at position k x the batch."""
    import numpy as np

    from zerodp.data.samples import documents_of

    data, G, T = _batches(cfg), cfg.train.global_batch_size, cfg.model.block_size
    if origin is not None:
        data.continue_from(*origin)
    where, per_rank = data.locate(step, G), G // world
    lengths = data._lengths(where.source, where.start)  # T + 1, or an unpacked row's real tokens
    targets = data.target_counts(data.bases[where.source] + where.start)
    if decode:
        from zerodp.trainer.sample import decode as decode_tokens
    out = []
    for j, (d, sample, start) in enumerate(zip(where.source.tolist(), where.sample.tolist(), where.start.tolist())):
        s, n = data.streams[d], int(lengths[j])
        docs = documents_of(s.index, start, n) if s.index is not None and len(s.index) else None
        row = {"row": j, "rank": j // per_rank, "micro": (j % per_rank) // micro, "source": s.name,
               "file": s.where, "sample": sample, "tokens": [start, start + n],
               "documents": list(docs) if docs is not None else None, "targets": int(targets[j]),
               "padding": T + 1 - n}
        if decode:
            row["text"] = decode_tokens(cfg, [int(t) for t in np.asarray(s.tokens[start : start + n])])
        out.append(row)
    return out


def run_batch(args) -> int:
    if args.step < 0 or (args.world is not None and args.world < 1) or (args.micro is not None and args.micro < 1):
        raise UserError(f"--step {args.step} --world {args.world} --micro {args.micro}: give a step >= 0 and a world "
                        f"and micro batch >= 1")
    origin, run = None, Path(args.config)
    if run.is_dir() and (run / "config.yaml").is_file():  # a run folder: the settings that trained that step
        from zerodp.config import load_config

        path, first, end = run_segment(run, args.step)
        cfg = load_config(str(path), args.overrides)
        origin = recorded_origin(run, first, end, load_config(str(path)).train.global_batch_size)
    else:
        cfg = _config(args.config, args.overrides)
    if args.micro is not None:
        cfg.train.micro_batch_size = args.micro
    if cfg.train.micro_batch_size == "auto":
        raise UserError("train.micro_batch_size is auto: the planner picks it at launch; give --micro N")
    world = args.world or run_world(args.config) or 1  # a run folder's own world size unless --world says
    accum = cfg.check_batch_split(world)
    micro = cfg.train.micro_batch_size
    rows = rows_of(cfg, args.step, world, micro, args.decode, origin)
    head = {"step": args.step, "global_batch": cfg.train.global_batch_size, "world": world, "micro": micro,
            "accumulation": accum, "block_size": cfg.model.block_size, "packing": cfg.data.packing,
            "targets": sum(r["targets"] for r in rows)}
    if args.json:
        print(json.dumps({**head, "rows": rows}))
        return 0
    shape = (f"samples of {cfg.model.block_size + 1} tokens" if cfg.data.packing else
             f"one conversation a sample, its first {cfg.model.block_size + 1} tokens at most, padded")
    print(f"step {args.step}: global batch {head['global_batch']} = micro {micro} x world {world} x accum "
          f"{accum}, {shape}; {head['targets']:,} target tokens")
    for r in rows:
        docs = "-" if r["documents"] is None else (f"document {r['documents'][0]}" if r["documents"][0] == r[
            "documents"][1] else f"documents {r['documents'][0]}-{r['documents'][1]}")
        pad = f", {r['padding']} padding" if r["padding"] else ""
        print(f"row {r['row']:>4}  rank {r['rank']} micro {r['micro']}  {r['source']}  sample {r['sample']:,}  tokens "
              f"[{r['tokens'][0]:,}, {r['tokens'][1]:,})  {docs}  {r['targets']:,} targets{pad}")
        if args.decode:
            print(f"      {r['text']!r}")
    return 0


def stats_of(cfg) -> list[dict]:
    """Per source: name, weight, documents and tokens of each split, samples per epoch (train) and the
    epochs train.max_steps reaches."""
    import copy

    data, val, evaluating = _batches(cfg), None, copy.deepcopy(cfg)
    evaluating.train.eval_every = 1  # a val split too short for one sample is reported as none, not as train's
    try:
        val = _batches(evaluating, "val")
    except UserError:
        pass
    G, steps = cfg.train.global_batch_size, cfg.train.max_steps
    out = []
    for d, (s, n, epochs) in enumerate(zip(data.streams, data.samples_per_epoch(), data.epochs(steps, G))):
        v = val.streams[d] if val is not None else None
        out.append({"source": s.name, "file": s.where, "weight": s.weight / sum(x.weight for x in data.streams),
                    "documents": None if s.index is None else len(s.index), "tokens": len(s.tokens),
                    "val_documents": None if v is None or v.index is None else len(v.index),
                    "val_tokens": None if v is None else len(v.tokens),
                    "samples_per_epoch": n, "epochs_at_max_steps": epochs})
    return out


def run_stats(args) -> int:
    cfg = _config(args.config, args.overrides)
    stats = stats_of(cfg)
    if args.json:
        print(json.dumps({"max_steps": cfg.train.max_steps, "global_batch": cfg.train.global_batch_size,
                          "block_size": cfg.model.block_size, "sources": stats}))
        return 0
    print(f"train.max_steps {cfg.train.max_steps:,} x global batch {cfg.train.global_batch_size} samples of "
          f"{cfg.model.block_size + 1} tokens")
    for s in stats:
        docs = "documents unknown (no index)" if s["documents"] is None else f"{s['documents']:,} documents"
        val = "" if s["val_tokens"] is None else f"; val {s['val_tokens']:,} tokens"
        print(f"{s['source']} (weight {s['weight']:.3g}, {s['file']}): {docs}, {s['tokens']:,} tokens, "
              f"{s['samples_per_epoch']:,} samples an epoch, {s['epochs_at_max_steps']:.3f} epochs at max_steps{val}")
    return 0
