"""`zerodp generate` and `zerodp eval`: use a checkpoint without training, on one process (CPU or GPU).

Both read any checkpoint `zerodp.load_model` reads (a run folder, a step folder, DeepSpeed, DCP, zerodp
safetensors, a Hugging Face folder), built on the meta device and filled tensor by tensor; a LoRA run's
checkpoint or a PEFT adapter folder as its base with the adapters (zerodp.convert.lora_source.open_model).

Text goes in and out the way the run saw it (`Text`): with the tokenizer the checkpoint records (a run
on a `zerodp prepare` folder; its sha256 is checked), or the tokenizer.json beside a Hugging Face
export, or `--tokenizer`; as bytes for a byte-level run; else as token ids.

zerodp/cli.py registers both with `add_parsers(subparsers)`; bad input raises UserError (one line on
stderr, exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from zerodp.errors import UserError

GENERATE_EXAMPLES = """examples:
  zerodp generate runs/tiny --prompt 'def main(' --max-new-tokens 200
  zerodp generate runs/llama-mine/checkpoints/step_00000500 --prompt 'Once upon a time' --temperature 0
  zerodp generate exports/llama-hf --prompt 'The' --top-k 0 --seed 3 --device cuda
  zerodp generate runs/sft-llama --chat 'What does def do in Python?' --temperature 0
"""

EVAL_EXAMPLES = """examples:
  zerodp eval runs/llama-mine                       # the run's val_loss: its validation set, as training computed it
  zerodp eval runs/llama-mine --all                 # every sample of the validation split once
  zerodp eval exports/llama-hf data.source=data/mine --max-tokens 1000000
  zerodp eval exports/sft-hf data.source=data/sft data.document_masking=true   # as the run saw its data
  zerodp eval runs/dpo-llama-lora                   # a DPO run: val_loss, val_rewards/*, val_logps/* as logged
"""


def add_parsers(subparsers) -> None:
    g = subparsers.add_parser(
        "generate", help="print text a checkpoint generates from a prompt (one process, CPU or GPU)",
        description="Load a checkpoint on one process and sample --max-new-tokens tokens after --prompt "
                    "(temperature, then top-k; a seeded generator: the same command prints the same text). "
                    "Text is encoded and decoded with the run's tokenizer (bytes for a byte-level run).",
        epilog=GENERATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("path", metavar="PATH",
                   help="a run folder, step folder, DeepSpeed/DCP folder, safetensors or HF folder")
    g.add_argument("--prompt", default=None,
                   help="text to continue (default: the start of a new document, as the end-of-run sample)")
    g.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="a user message: rendered with the run's chat template, the answer printed (zerodp.cli.chat)")
    g.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate (default 100)")
    g.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="softmax temperature (default 0.8); 0 takes the most likely token every time")
    g.add_argument("--top-k", type=int, default=50, metavar="K",
                   help="sample among the K likeliest (default 50; 0: all)")
    g.add_argument("--seed", type=int, default=None, metavar="S",
                   help="sampling seed (default: the run's train.seed, which its exports record too, so a run and its "
                        "export print the same text; 0 for a model zerodp did not train)")
    _common(g)
    g.set_defaults(func=run_generate)

    e = subparsers.add_parser(
        "eval", help="print a checkpoint's validation loss and perplexity (one process, CPU or GPU)",
        description="Load a checkpoint on one process and compute the mean cross-entropy (and its exp, the "
                    "perplexity) over the target tokens: for a run (or an export that records its config), the "
                    "run's validation set (train.eval_batches micro batches of the val split, the val_loss training "
                    "logged, computed by the same code); with --all or --max-tokens, or for a checkpoint without "
                    "the run's config (a Hugging Face folder), every sample of the validation split once (a "
                    "`zerodp prepare` folder's val.bin, or the last data.val_fraction of another source). Either "
                    "takes the data settings: the loss mask (zerodp prepare --chat), data.packing and "
                    "data.document_masking, the run's unless an override names others. A train.objective=dpo run "
                    "prints its validation pairs' loss, rewards and log-probs, against the run's reference, as it "
                    "logged them.",
        epilog=EVAL_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("path", metavar="PATH",
                   help="a run folder, step folder, DeepSpeed/DCP folder, safetensors or HF folder")
    e.add_argument("overrides", nargs="*", metavar="data.KEY=VALUE",
                   help="data settings in place of the run's, e.g. data.source=DIR (a zerodp prepare folder)")
    e.add_argument("--batch-size", type=int, default=8, metavar="B",
                   help="samples per forward with --all (default 8; the validation set takes the run's micro batches)")
    e.add_argument("--all", action="store_true",
                   help="every sample of the validation split once, not the run's validation set")
    e.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="every sample within the first N tokens of the validation split (implies --all)")
    e.add_argument("--json", action="store_true", help="print the result as one JSON object")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    _common(e)
    e.set_defaults(func=run_eval)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or a folder holding one) in place of the one the checkpoint records")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when there is a GPU)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="compute in fp32 (default; exact) or under bf16 autocast")


# -- text in and out ---------------------------------------------------------------------------------

@dataclass
class Text:
    """How this checkpoint's token ids and text map onto each other."""

    tokenizer: object | None = None  # a tokenizers.Tokenizer
    byte_level: bool = False
    vocab_size: int = 0  # the model's, named when nothing encodes text for it
    eot_id: int | None = None  # the document separator the run trained with, if known
    special_tokens: bool = True  # whether prepare let the post-processor add its special tokens
    note: str | None = None  # why a recorded tokenizer was not used

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=self.special_tokens).ids
        if self.byte_level:
            return list(text.encode("utf-8"))
        raise UserError(f"this checkpoint has a vocabulary of {self.vocab_size} tokens, not bytes, and no tokenizer "
                        "(none recorded, none beside it" + (f"; {self.note}" if self.note else "") + "), so --prompt "
                        "cannot be encoded; pass --tokenizer path/to/tokenizer.json")

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.byte_level and max(ids, default=0) < 256:
            return bytes(ids).decode("utf-8", errors="replace")
        return " ".join(map(str, ids))


def _load_tokenizer(path: str | Path):
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise UserError(f"--tokenizer {path}: no tokenizer.json there; give the file or a folder holding it")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the library raises a bare Exception for a malformed file
        raise UserError(f"--tokenizer {file} is not a tokenizers tokenizer.json ({str(e).splitlines()[0]})") from None


def text_of(source, run_cfg: dict, tokenizer: str | None) -> Text:
    """The Text of an open checkpoint: --tokenizer, else the run's recorded tokenizer, else a
    tokenizer.json beside the checkpoint (an HF export), else the prepared folder the run's config names;
    bytes when the run read text byte by byte; else ids."""
    from zerodp.config.sources import primary_source
    from zerodp.data.batches import prepared_meta
    from zerodp.models.hf import origin_of
    from zerodp.trainer.sample import tokenizer_of

    rec = source.meta.get("tokenizer") or {}
    data = primary_source(run_cfg.get("data") or {})
    prepared = prepared_meta(data) if data else None
    eot = rec.get("eot_id", (prepared or {}).get("eot_id"))
    if eot is None:
        eot = origin_of(source.meta).get("eos_token_id")
    special = bool(rec.get("special_tokens", (prepared or {}).get("special_tokens", True)))
    text = Text(eot_id=eot, special_tokens=special)
    if tokenizer is not None:
        text.tokenizer = _load_tokenizer(tokenizer)
        return text
    if rec.get("path"):
        text.tokenizer, text.note = tokenizer_of({"tokenizer": rec})
        if text.tokenizer is not None:
            return text
    from zerodp.convert.lora_source import model_folders

    for folder in model_folders(source):  # an export's, a checkpoint converted from one, a LoRA model's base's
        if (folder / "tokenizer.json").is_file():
            text.tokenizer, text.note = _load_tokenizer(folder / "tokenizer.json"), None
            return text
    if prepared is not None and not rec.get("path"):
        text.tokenizer, text.note = tokenizer_of(prepared)
        return text
    text.vocab_size = int(((run_cfg.get("model") or {}).get("vocab_size")) or 0)
    if run_cfg.get("data"):  # a run's own config: text it read byte by byte (builtin, a text file or folder)
        text.byte_level = prepared is None and not str(data).endswith(".bin") and text.vocab_size >= 256
    else:  # an export or a Hugging Face folder: bytes only for a byte-level vocabulary, never a guess
        text.byte_level = text.vocab_size == 256
    return text


# -- the model ---------------------------------------------------------------------------------------

def _device(name: str | None):
    """The device a command computes on (a GPU when one is visible, unless --device says); torch's CPU
    threads sized to the CPUs this process may use first (zerodp.distributed.devices.size_threads)."""
    import torch

    from zerodp.distributed.devices import size_threads

    size_threads()
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no GPU is visible to this process; use --device cpu")
    return device


def _autocast(device, precision: str):
    import contextlib

    import torch

    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _run_config(source) -> dict:
    return dict(source.meta.get("config") or {})


def _not_a_dataset(path: str, command: str) -> None:
    """Refuse a `zerodp prepare` folder given where the checkpoint goes (it holds a meta.json too, so the
    checkpoint reader would call it an incomplete checkpoint), saying what to pass instead."""
    from zerodp.config.sources import prepared_meta  # no torch: this check comes before its import

    if prepared_meta(path) is None:
        return
    instead = (f"give the checkpoint first and the data after it: zerodp eval RUN data.source={path} (RUN: a run "
               f"folder, step folder or export)" if command == "eval" else
               "pass a checkpoint: the run folder of a training on it (its train.out_dir), a step folder or an export")
    raise UserError(f"{path} is a dataset written by zerodp prepare (train.bin, val.bin, meta.json), not a "
                    f"checkpoint; {instead}")


# -- generate ----------------------------------------------------------------------------------------

def run_generate(args) -> int:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: give at least 1")
    if args.top_k < 0 or args.temperature < 0:
        raise UserError("--top-k and --temperature cannot be negative (0 means: all tokens / the most likely one)")
    _not_a_dataset(args.path, "generate")
    if args.chat is not None:
        from zerodp.cli.chat import run_chat

        return run_chat(args)
    import torch  # after the checks of the arguments alone: those fail at once, not after torch's import

    from zerodp.api import model_from_source
    from zerodp.convert.lora_source import open_model
    from zerodp.models.common import KVCache
    from zerodp.trainer.sample import next_logits, next_token

    device = _device(args.device)
    with open_model(args.path) as source:
        run_cfg = _run_config(source)
        text = text_of(source, run_cfg, args.tokenizer)
        model = model_from_source(source, device)
    if text.note:
        print(f"zerodp: {text.note}; printing token ids", file=sys.stderr)
    # The run's documents each follow the separator: a prompt continues from the start of a document.
    start = [text.eot_id] if text.eot_id is not None and text.tokenizer is not None else []
    if args.prompt is not None:
        prompt = start + text.encode(args.prompt)
    else:
        prompt = start or (list(b"def ") if text.byte_level else [0])
    if not prompt:
        raise UserError("--prompt '' encodes to no tokens; give some text")
    vocab = model.arch.vocab_size
    if max(prompt) >= vocab:
        raise UserError(f"the prompt encodes to token id {max(prompt)}, beyond the model's vocabulary of {vocab}; "
                        f"use the tokenizer the model was trained with (--tokenizer)")
    seed = args.seed if args.seed is not None else int((run_cfg.get("train") or {}).get("seed", 0))
    generator = torch.Generator().manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long)  # (1, T) on the CPU
    block = model.arch.block_size
    # A key/value cache, as the end-of-run sample decodes (zerodp.trainer.sample): the prompt runs once,
    # then each new token alone; past block_size tokens each one re-runs the last block_size from position 0.
    kv = KVCache(model.arch.n_layer)
    with torch.no_grad(), _autocast(device, args.precision):
        for _ in range(args.max_new_tokens):
            logits, kv = next_logits(model, idx, kv, block, device)
            idx = torch.cat([idx, next_token(logits[:, -1, :], generator, args.temperature, args.top_k)], dim=1)
    print(text.decode(idx[0, len(start):].tolist()))
    return 0


# -- eval --------------------------------------------------------------------------------------------

def eval_config(source, overrides: list[str], given: str | None = None):
    """The run's Config with the `data.*` overrides applied; a checkpoint that records no training data
    (a Hugging Face folder, an export) must be given its data: the message repeats the path as `given`
    (what the user typed; `source.path` may be a file inside it) with data.source=DIR after it."""
    from zerodp.api import model_config_of
    from zerodp.config import from_dict, parse_override, resolve_model

    raw = {k: dict(v) for k, v in _run_config(source).items() if isinstance(v, dict)}
    data = raw.setdefault("data", {})
    for item in overrides:
        section, key, value = parse_override(item)
        if section != "data":
            raise UserError(f"zerodp eval takes data.* settings only (got {item}); the model is the checkpoint's")
        data[key] = value
    if "source" not in data:  # an export records the model only
        given = source.path if given is None else given
        raise UserError(f"{given} records no training data; name it: zerodp eval {given} data.source=DIR "
                        f"(a zerodp prepare folder)")
    raw["model"] = dataclasses.asdict(model_config_of(source))
    return resolve_model(from_dict(raw, f"{source.path}'s config"))


def run_eval(args) -> int:
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: give at least 1")
    _not_a_dataset(args.path, "eval")
    from zerodp.api import model_from_source  # after the check of the arguments alone: imports torch
    from zerodp.config.sources import primary_source
    from zerodp.convert.lora_source import open_model
    from zerodp.data.batches import TokenBatches, load_tokens, prepared_meta

    device = _device(args.device)
    with open_model(args.path) as source:
        cfg = eval_config(source, args.overrides, args.path)
        preference = cfg.train.objective == "dpo"
        if preference and (args.all or args.max_tokens is not None):
            raise UserError(f"{args.path} trained with train.objective=dpo: zerodp eval computes its validation pairs' "
                            f"loss and rewards, as the run did; drop --all and --max-tokens")
        recorded = (source.meta.get("tokenizer") or {}).get("sha256")
        prepared = prepared_meta(primary_source(cfg.data))
        used = ((prepared or {}).get("tokenizer") or {}).get("sha256")
        if recorded and prepared is not None and used != recorded:
            raise UserError(f"{primary_source(cfg.data)} was prepared with another tokenizer than the one {args.path} "
                            f"was trained with (sha256 differs); evaluate on data prepared with the run's tokenizer")
        # A run has a validation set (its train section's eval_batches); a Hugging Face folder, or an export
        # that records only the model and its generation seed, has none.
        recorded_train = _run_config(source).get("train") or {}
        whole = args.all or args.max_tokens is not None or "eval_batches" not in recorded_train
        tokens = load_tokens(cfg)
        _check_val_length(tokens, cfg)
        # eval reads the val split whatever train.eval_every was (TokenBatches would read train for a short one)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=max(1, cfg.train.eval_every)))
        data = TokenBatches(tokens, cfg, "val")
        model = model_from_source(source, device)
    if data.note:
        print(f"zerodp: {data.note}", file=sys.stderr)
    if preference:
        return _eval_preference(model, data, cfg, args, device)
    if whole:
        results = [_eval_split(model, part, args, device) for _, part in data.per_source()]
    else:
        results = _eval_validation_set(model, data, cfg, args, device)
    how = (("document masking on" if data.with_doc_ids else "document masking off") + ", "
           + ("packed" if data.packing else "one document a sample (data.packing=false)"))
    if len(results) == 1:
        result = {**results[0], "documents_masked": data.with_doc_ids, "packing": data.packing}
    else:
        weights = [s.weight for s in data.streams]
        loss = sum(w * r["val_loss"] for w, r in zip(weights, results)) / sum(weights)
        result = {"val_loss": loss, "perplexity": math.exp(min(loss, 700)), "set": results[0]["set"],
                  "documents_masked": data.with_doc_ids, "packing": data.packing,
                  "sources": {s.name: r for s, r in zip(data.streams, results)}}
    if args.json:
        print(json.dumps(result))
        return 0
    for stream, r in zip(data.streams, results):
        targets = f", {r['targets']:,} of them targets" if r["targets"] != r["tokens"] else ""
        what = (f"the run's validation set: {cfg.train.eval_batches} micro batches of {cfg.train.micro_batch_size}"
                if r["set"] == "validation" else f"{r['samples']:,} samples of {model.arch.block_size}")
        print(("" if len(results) == 1 else f"{stream.name} (weight {stream.weight:g}): ")
              + f"val_loss {r['val_loss']:.4f}  perplexity {r['perplexity']:.3f}  ({r['tokens']:,} tokens{targets}: "
              f"{what} from {stream.where}; {how})")
    if len(results) > 1:
        print(f"val_loss {result['val_loss']:.4f}  perplexity {result['perplexity']:.3f}  (the sources' mean by "
              f"weight)")
    return 0


def _eval_preference(model, data, cfg, args, device) -> int:
    """A train.objective=dpo run's figures over its validation pairs: the val_loss and val_rewards/...,
    val_logps/... its validation logged, by the same code (zerodp.trainer.objective.evaluate_checkpoint)."""
    import functools

    from zerodp.config.validation import dpo_reference
    from zerodp.trainer.objective import evaluate_checkpoint

    reference = None
    if dpo_reference(cfg) == "live":  # the starting weights: model.init_from's, or the seed's
        from zerodp.api import model_from_source
        from zerodp.convert import open_checkpoint
        from zerodp.models import build_model

        if cfg.model.init_from:
            with open_checkpoint(cfg.model.init_from) as source:
                reference = model_from_source(source, device, config=cfg.model)
        else:
            reference = build_model(cfg.model, seed=cfg.train.seed, device=device)
    result = evaluate_checkpoint(cfg, model, data, device, functools.partial(_autocast, device, args.precision),
                                 reference)
    if args.json:
        print(json.dumps(result))
        return 0
    pairs = cfg.train.eval_batches * cfg.train.micro_batch_size // 2
    print(f"val_loss {result['val_loss']:.4f}  (dpo.loss {cfg.dpo.loss}, beta {cfg.dpo.beta:g}; the run's validation "
          f"set: {pairs} pairs of {data.streams[0].where})")
    print("  ".join(f"{k} {v:.4f}" for k, v in result.items() if k != "val_loss"))
    return 0


def _check_val_length(tokens, cfg) -> None:
    """Refuse a validation split shorter than one sample (block_size + 2 tokens), saying how to make one."""
    import numpy as np

    from zerodp.data.batches import Mixture, PreparedTokens

    block = cfg.model.block_size
    if isinstance(tokens, Mixture):
        splits = [(p.data.val, p.data.folder / "val.bin") for p in tokens.parts]
    elif isinstance(tokens, PreparedTokens):
        splits = [(tokens.val, tokens.folder / "val.bin")]
    else:
        n_val = int(len(tokens) * cfg.data.val_fraction)
        splits = [(np.zeros(n_val), f"the last {cfg.data.val_fraction:g} of {cfg.data.source}")]
    for split, where in splits:
        if len(split) <= block + 1:
            raise UserError(f"the validation split ({where}) has {len(split)} tokens, fewer than one sample of "
                            f"model.block_size+2={block + 2}; prepare with a larger --val-fraction")


def _result(total: float, targets: int, samples: int, block: int, where, kind: str) -> dict:
    if targets == 0:
        raise UserError(f"the validation split ({where}) holds no target tokens in the {samples:,} samples evaluated "
                        f"(its loss mask is all 0 there); evaluate more of it (--all) or prepare with --train-on all")
    loss = total / targets
    return {"val_loss": loss, "perplexity": math.exp(min(loss, 700)), "tokens": samples * block, "targets": targets,
            "samples": samples, "set": kind, "source": str(where)}


def _eval_validation_set(model, data, cfg, args, device) -> list[dict]:
    """Each source's loss over the run's validation set: what training's validation computes
    (zerodp.trainer.validate), with the same code, on one process."""
    import functools

    import torch

    from zerodp.trainer.validate import validation_sums

    with torch.no_grad():
        sums = validation_sums(lambda batch: model(*(t.to(device) for t in batch)), data, cfg,
                               autocast=functools.partial(_autocast, device, args.precision))
    samples = cfg.train.eval_batches * cfg.train.micro_batch_size
    return [_result(s, int(n), samples, data.block, stream.where, "validation")
            for (s, n), stream in zip(sums.tolist(), data.streams)]


def _eval_split(model, data, args, device) -> dict:
    """The loss over the target tokens of every sample of one source's val split once (its first
    --max-tokens): fixed windows, or one document a sample with data.packing=false, with the data's loss
    mask and document masking; the sum of their losses over their number."""
    import torch
    from tqdm import tqdm

    from zerodp.trainer.validate import split_offsets, target_sums

    offsets = split_offsets(data, args.max_tokens)
    where = data.streams[0].where
    if len(offsets) < 1:
        raise UserError(f"the validation split ({where}) holds no sample in its first {args.max_tokens:,} tokens "
                        f"(a sample is model.block_size+1={data.block + 1}); evaluate more of it (--max-tokens)")
    total, targets = 0.0, 0
    bar = tqdm(total=len(offsets), desc="eval", unit="sample", file=sys.stderr,
               disable=args.no_progress or not sys.stderr.isatty())
    with torch.no_grad(), _autocast(device, args.precision):
        for first in range(0, len(offsets), args.batch_size):
            batch = data.rows(offsets[first : first + args.batch_size])
            s, n = target_sums(model(*(t.to(device) for t in batch)), batch[1])  # the model: the mean over targets
            total, targets = total + float(s), targets + n
            bar.update(len(batch[0]))
    bar.close()
    return _result(total, targets, len(offsets), data.block, where, "split")
