"""`zerodp plan`: will it fit, and how should I run it?

zerodp/cli.py registers the subcommand with `add_parser(subparsers)` and calls `run(args)`; this module
never imports zerodp.cli.commands (no import circle). Imports neither torch nor deepspeed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from zerodp.errors import UserError
from zerodp.models.chunking import checkpointing_mode
from zerodp.models.lora_spec import lora_spec
from zerodp.planner.choose import choose
from zerodp.planner.hardware import GPUS, INTERCONNECTS, MFU, Cluster, GpuSpec, gpu_preset
from zerodp.planner.hf_config import SUPPORTED as HF_MODEL_TYPES
from zerodp.planner.lora import with_lora, without_lora
from zerodp.planner.models import PRESETS, preset, spec_from_hf_config, spec_from_model_config, spec_from_params
from zerodp.planner.preference import REFERENCES
from zerodp.planner.types import Workload
from zerodp.planner.units import parse_bytes, parse_count

EXAMPLES = """examples:
  zerodp plan --model llama2-7b --gpus 8 --hbm 80GB
  zerodp plan --config configs/gpt2-124m.yaml --gpus 8 --nodes 2 --gpu a100 train.micro_batch_size=6
  zerodp plan --hf-config path/to/model_folder --gpus 4 --gpu h100 --micro-batch 2 --seq-len 4096 --json
  zerodp plan --params 13e9 --layers 40 --hidden 5120 --gpus 8 --cpu-ram 1TB
  zerodp plan --model llama3-70b --gpus 8 --nodes 4 --interconnect ethernet --global-batch 512 --seq-len 4096
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `plan` subcommand on an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "plan", help="will it fit, and how should I run it? (memory and strategy planner, offline)",
        description="Estimate per-GPU memory, communication and step time of every strategy "
                    "(ddp, zero1-3, fsdp, offload variants) and choose one. Formulas: docs/memory_model.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (give one of --config, --hf-config, --model, --params)")
    m.add_argument("--config", metavar="CONFIG.yaml", help="a zerodp training config")
    m.add_argument("overrides", nargs="*", metavar="section.key=value", help="overrides for --config")
    m.add_argument("--hf-config", metavar="PATH",
                   help=f"a Hugging Face model folder, or its config.json: {', '.join(HF_MODEL_TYPES)} "
                        "(mixtures of experts: memory for every expert, compute for the routed ones)")
    m.add_argument("--model", metavar="NAME", help=f"a built-in preset: {', '.join(PRESETS)}")
    m.add_argument("--params", metavar="N", help="parameter count, e.g. 7.5e9 or 7B")
    m.add_argument("--layers", type=int, help="with --params: transformer blocks")
    m.add_argument("--hidden", type=int, help="with --params: hidden width")
    m.add_argument("--heads", type=int, help="with --params: attention heads")
    m.add_argument("--vocab", type=int, help="with --params: vocabulary size (default 32000)")
    a = p.add_argument_group("adapters (LoRA: the base frozen, low-rank adapters trained; shown beside full "
                             "fine-tuning)")
    a.add_argument("--lora-rank", type=int, metavar="R", help="train rank-R adapters (with --config: the override "
                   "model.lora.rank=R; a config with model.lora is planned with its adapters anyway)")
    a.add_argument("--lora-targets", metavar="NAMES", help="with --lora-rank: the adapted linear layers by their "
                   "Hugging Face names, comma-separated, e.g. q_proj,v_proj (default all-linear)")
    a.add_argument("--lora-alpha", type=float, metavar="A", help="with --lora-rank: the adapters' alpha, their "
                   "output scaled by alpha / rank (default 2 x rank); the memory does not depend on it")
    o = p.add_argument_group("objective (DPO: shown beside SFT, the reference priced)")
    o.add_argument("--objective", choices=("sft", "dpo"), help="train.objective (default sft, or the config's): dpo "
                   "trains on preference pairs, its micro batch whole pairs (even)")
    o.add_argument("--dpo-reference", choices=REFERENCES, help="with --objective dpo: dpo.reference (default "
                   "adapters-off with --lora-rank, else live): live holds a frozen copy, adapters-off and precomputed "
                   "none; live and adapters-off add a forward per micro batch")
    h = p.add_argument_group("hardware")
    h.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    h.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    h.add_argument("--gpu", metavar="NAME",
                   help=f"GPU preset for memory and peak FLOPs: {', '.join(GPUS)} (default h100)")
    h.add_argument("--hbm", metavar="SIZE", help="memory per GPU, e.g. 80GB (80e9 bytes) or 80GiB; overrides --gpu's")
    h.add_argument("--cpu-ram", metavar="SIZE",
                   help="CPU memory per node, for offloaded states and the start-up peak, e.g. 512GB")
    h.add_argument("--interconnect", metavar="LINK",
                   help="the slowest link: on one node between its GPUs (nvlink, pcie), across nodes "
                   "between the nodes, all NICs of a node together (infiniband, infiniband-rail, ethernet); "
                   "default nvlink on one node, infiniband across nodes")
    h.add_argument("--mfu", type=float, default=MFU, help=f"model FLOPs utilisation assumed (default {MFU})")
    w = p.add_argument_group("step")
    w.add_argument("--micro-batch", type=int, help="sequences per GPU per forward (default 1; with --config the "
                   "same as the override train.micro_batch_size=N, the accumulation following from the global batch)")
    w.add_argument("--global-batch", type=int, metavar="G",
                   help="sequences per optimizer step: search the micro batch (the divisors of G / GPUs) and "
                        "activation checkpointing for every strategy, accumulation following from G (with "
                        "--config the override train.global_batch_size=G; train.micro_batch_size=auto searches too)")
    w.add_argument("--seq-len", type=int, help="tokens per sequence (default min(context, 4096), or block_size)")
    w.add_argument("--grad-accum", type=int, help="micro batches per optimizer step (default 1; with --config "
                   "train.global_batch_size / (micro batch x GPUs), as zerodp train splits it, which this must equal)")
    w.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default bf16, or the config's")
    w.add_argument("--activation-checkpointing", choices=("off", "selective", "full", "on"),
                   help="off, selective (the matmul and attention outputs kept) or full (on); default: the planner "
                        "decides (or the config's when it is not off)")
    w.add_argument("--loss-chunks", help="the head and loss in this many chunks of tokens, 0: the whole logits "
                   "(default auto, or the config's model.loss_chunks)")
    w.add_argument("--async-save", action="store_true",
                   help="show the host memory per node of checkpoint.async_save's snapshot (one copy of each "
                        "rank's checkpoint; the config's checkpoint.async_save turns it on too)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--from-run", metavar="RUN", help="a zerodp train run directory: its measured critical batch "
                   "(gradient noise scale) against each world size's global batch (docs/grad_noise.md)")
    p.set_defaults(func=run)
    return p


def _positive(flag: str, value, what: str, example: int) -> None:
    if value is not None and value < 1:
        raise UserError(f"{flag} {value}: {what} must be at least 1 (e.g. {flag} {example})")


def _model(args):
    """(ModelSpec, config or None) from whichever single model source was given."""
    given = [f for f, v in (("--config", args.config), ("--hf-config", args.hf_config),
                            ("--model", args.model), ("--params", args.params)) if v is not None]
    if len(given) != 1:
        what = "several: " + ", ".join(given) if given else "none"
        raise UserError(f"give exactly one model source, got {what}; e.g. --model llama2-7b, "
                        f"--config CONFIG.yaml, --hf-config config.json or --params 7e9")
    if args.overrides and args.config is None:
        raise UserError(f"overrides {' '.join(args.overrides)} need --config CONFIG.yaml to apply to")
    if args.params is None and any(v is not None for v in (args.layers, args.hidden, args.heads, args.vocab)):
        raise UserError("--layers/--hidden/--heads/--vocab describe a --params model; add --params N")
    lora = _lora_settings(args)
    if args.config is not None:
        from zerodp.config import load_config  # imports yaml only
        # --micro-batch is an override, so the batch is split and validated exactly as `zerodp train` would
        micro = [f"train.micro_batch_size={args.micro_batch}"] if args.micro_batch is not None else []
        micro += [f"train.global_batch_size={args.global_batch}"] if args.global_batch is not None else []
        if args.global_batch is not None and args.micro_batch is None:
            micro.append("train.micro_batch_size=auto")  # --global-batch alone searches the micro batch
        micro += [f"model.lora.{k}={v}" for k, v in lora.items()]  # checked with the config, as zerodp train would
        cfg = load_config(args.config, list(args.overrides) + micro)
        return spec_from_model_config(cfg.model, name=args.config), cfg
    if args.hf_config is not None:
        model = spec_from_hf_config(args.hf_config)
    elif args.model is not None:
        model = preset(args.model)
    else:
        model = spec_from_params(parse_count(args.params), args.layers, args.hidden, args.heads, args.vocab)
    if lora:
        model = with_lora(model, lora_spec(lora, where="--lora"), where="--lora-targets")
    return model, None


def _lora_settings(args) -> dict:
    """model.lora's settings from --lora-rank, --lora-targets, --lora-alpha ({} without --lora-rank)."""
    if args.lora_rank is None:
        given = [f for f, v in (("--lora-targets", args.lora_targets), ("--lora-alpha", args.lora_alpha))
                 if v is not None]
        if given:
            raise UserError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to adapters, and "
                            f"without --lora-rank there are none; add --lora-rank R (e.g. --lora-rank 16)")
        return {}
    _positive("--lora-rank", args.lora_rank, "the adapters' rank", 16)
    if args.lora_alpha is not None and args.lora_alpha <= 0:
        raise UserError(f"--lora-alpha {args.lora_alpha:g} must be positive (2 x rank = {2 * args.lora_rank} is "
                        "the usual start)")
    out: dict = {"rank": args.lora_rank}
    if args.lora_alpha is not None:
        out["alpha"] = args.lora_alpha
    if args.lora_targets is not None:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        if not targets:
            raise UserError(f"--lora-targets {args.lora_targets!r} names no module; e.g. --lora-targets q_proj,v_proj")
        out["targets"] = "[" + ", ".join(targets) + "]" if args.config is not None else targets
    return out


def _check_grad_accum(args, cfg, world_size: int) -> None:
    """With --config the global batch fixes the accumulation; an explicit --grad-accum must agree."""
    t, accum = cfg.train, args.grad_accum
    if accum is None or t.global_batch_size == t.micro_batch_size * world_size * accum:
        return
    implied = t.micro_batch_size * world_size * accum
    raise UserError(
        f"--grad-accum {accum} contradicts {args.config}: {t.micro_batch_size} micro x {world_size} GPUs x {accum} = "
        f"{implied} sequences per step, but train.global_batch_size={t.global_batch_size}; leave --grad-accum out "
        f"(the global batch sets it, as in zerodp train) or add train.global_batch_size={implied}")


def build(args):
    """The Plan `zerodp plan` prints for parsed arguments."""
    for flag, v, what, ex in (
        ("--gpus", args.gpus, "GPUs per node", 8), ("--nodes", args.nodes, "the number of nodes", 2),
        ("--micro-batch", args.micro_batch, "sequences per micro batch", 1),
        ("--global-batch", args.global_batch, "sequences per optimizer step", 512),
        ("--seq-len", args.seq_len, "the sequence length", 2048),
        ("--grad-accum", args.grad_accum, "micro batches per step", 1),
    ):
        _positive(flag, v, what, ex)
    if not 0 < args.mfu <= 1:
        raise UserError(f"--mfu {args.mfu} must be in (0, 1], e.g. --mfu 0.4")
    model, cfg = _model(args)
    notes = []
    gpu = gpu_preset(args.gpu) if args.gpu else GPUS["h100"]
    if args.hbm is not None:
        gpu = GpuSpec(gpu.name if args.gpu else "gpu", parse_bytes(args.hbm), gpu.peak_flops_16, gpu.peak_flops_32)
        if not args.gpu:
            notes.append("step time assumes H100 peak FLOPs (pass --gpu to change)")
    elif not args.gpu:
        notes.append("GPU assumed: h100 with 80 GB (pass --gpu or --hbm)")
    if args.interconnect and args.interconnect not in INTERCONNECTS:
        raise UserError(f"--interconnect {args.interconnect!r} is not one of {', '.join(INTERCONNECTS)}")
    cpu_ram = parse_bytes(args.cpu_ram, "--cpu-ram", "512GB") if args.cpu_ram is not None else None
    cluster = Cluster(gpu=gpu, gpus_per_node=args.gpus, nodes=args.nodes, interconnect=args.interconnect,
                      cpu_ram_bytes=cpu_ram, mfu=args.mfu)

    global_batch = args.global_batch
    if cfg is not None and cluster.nodes == 1:
        from zerodp.config import zeropp_settings
        if on := zeropp_settings(cfg.strategy):
            raise UserError(f"{', '.join(on)}: ZeRO++ cuts the traffic between nodes, and this plan has one node; "
                            f"plan it with --nodes N (N > 1), or remove {'them' if len(on) > 1 else 'it'}")
    if cfg is not None:
        from zerodp.planner.training import workload_from_config
        if cfg.train.micro_batch_size == "auto":
            if args.grad_accum is not None:
                raise UserError("--grad-accum follows from the micro batch the planner searches "
                                "(train.micro_batch_size=auto); leave it out, or give --micro-batch")
            global_batch = cfg.train.global_batch_size
        else:
            _check_grad_accum(args, cfg, cluster.world_size)
            global_batch = None
        base = workload_from_config(cfg, cluster.world_size)  # train's split: ConfigError if it does not divide
        if args.seq_len and args.seq_len > cfg.model.block_size:
            raise UserError(f"--seq-len {args.seq_len} exceeds model.block_size={cfg.model.block_size}; "
                            f"raise block_size in the config or pass a shorter --seq-len")
        ckpt = checkpointing_mode(cfg.model.activation_checkpointing)
        ckpt = ckpt if ckpt != "off" else None
    else:
        base = Workload(1, min(model.context, 4096))
        ckpt = None
    if args.seq_len and args.seq_len > model.context and cfg is None:
        notes.append(f"--seq-len {args.seq_len} is longer than the model's context {model.context}")
    micro, accum = args.micro_batch or base.micro_batch, args.grad_accum or base.grad_accum_steps
    if cfg is None and global_batch is not None:
        if args.grad_accum is not None:
            raise UserError("--grad-accum follows from --global-batch (G / (micro batch x GPUs)); leave it out")
        from zerodp.planner.choose import check_global_batch
        check_global_batch(global_batch, cluster.world_size)
        if args.micro_batch is not None:  # a given micro batch: only the accumulation follows
            per_rank = global_batch // cluster.world_size
            if per_rank % args.micro_batch:
                raise UserError(f"--micro-batch {args.micro_batch} does not divide {per_rank} sequences per GPU "
                                f"(--global-batch {global_batch} over {cluster.world_size} GPUs); leave "
                                f"--micro-batch out to search it, or use a divisor of {per_rank}")
            micro, accum, global_batch = args.micro_batch, per_rank // args.micro_batch, None
    objective, reference = _objective(args, cfg, model)
    if objective == "dpo" and args.micro_batch is None and cfg is None and global_batch is None:
        micro = 2  # one pair
    if objective == "dpo" and micro % 2 and global_batch is None:
        raise UserError(f"--objective dpo: micro batch {micro} would split a preference pair (its chosen and "
                        f"rejected sequences); give an even --micro-batch such as {micro + 1}")
    workload = Workload(micro, args.seq_len or base.seq_len, args.precision or base.precision, accum, base.bucket_mb,
                        base.fsdp_defer_grad_reduce, base.fsdp_reshard_after_forward, base.zero3_persistence_threshold,
                        base.zero3_keep_window, document_masking=base.document_masking,
                        document_attention=base.document_attention,
                        loss_chunks=base.loss_chunks if args.loss_chunks is None else _loss_chunks(args.loss_chunks),
                        objective=objective, dpo_reference=reference)
    if args.activation_checkpointing:
        ckpt = "full" if args.activation_checkpointing == "on" else args.activation_checkpointing
    if model.shape_assumed:
        notes.append(f"layer shape guessed from the parameter count ({model.n_layer} layers, hidden {model.hidden}); "
                     "pass --layers and --hidden for exact activations")
    plan = choose(model, cluster, workload, ckpt, global_batch=global_batch)
    if model.lora is not None:  # the same rows fully fine-tuned, beside the adapters'
        full = choose(without_lora(model), cluster, workload, ckpt, global_batch=global_batch)
        plan.full_fine_tuning = full.estimates
    if objective == "dpo":  # the same rows under SFT, beside DPO's
        sft = dataclasses.replace(workload, objective="sft", dpo_reference=None)
        plan.sft = choose(model, cluster, sft, ckpt, global_batch=global_batch).estimates
    plan.assumptions.extend(notes)
    plan.async_save = args.async_save or bool(cfg is not None and cfg.checkpoint.async_save)
    return plan


def _objective(args, cfg, model) -> tuple[str, str | None]:
    """(train.objective, the reference dpo.reference resolves to, None without one) from --objective and
    --dpo-reference, else the config's; a UserError for a reference that cannot apply."""
    from zerodp.config.validation import dpo_reference

    given = args.objective or (cfg.train.objective if cfg is not None else "sft")
    if given != "dpo":
        if args.dpo_reference is not None:
            raise UserError(f"--dpo-reference {args.dpo_reference} is DPO's reference model, and this plan is "
                            f"{given}; add --objective dpo")
        return given, None
    lora = model.lora is not None
    if args.dpo_reference is None:
        if cfg is not None and cfg.train.objective == "dpo":
            return given, dpo_reference(cfg)
        return given, "adapters-off" if lora else "live"
    if args.dpo_reference == "adapters-off" and not lora:
        raise UserError("--dpo-reference adapters-off switches LoRA's adapters off, and this plan has none; add "
                        "--lora-rank R, or use --dpo-reference live or precomputed")
    if args.dpo_reference == "live" and lora:
        raise UserError("--dpo-reference live holds a second copy of the model; with adapters the base with them "
                        "off is the reference at no cost: use --dpo-reference adapters-off (or leave it out)")
    return given, args.dpo_reference


def _loss_chunks(value: str) -> int | str:
    if value == "auto" or (value.isdigit()):
        return value if value == "auto" else int(value)
    raise UserError(f"--loss-chunks {value!r} must be 0 (the whole logits), a number of chunks or auto")


def run(args) -> int:
    """Print the plan (table, or JSON with --json); return 0. Bad input raises UserError."""
    if args.from_run is not None:
        from zerodp.planner import noise
        return noise.run(args, build)
    plan = build(args)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.table())
    return 0
