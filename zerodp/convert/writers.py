"""Targets: consolidated (optionally sharded) safetensors, a Hugging Face model folder (config.json and
safetensors in HF's names and layouts), and a zerodp checkpoint in the canonical layout.

All stream: tensors are fetched from the source one at a time and written straight into a file
whose header was laid out first, so memory holds about one tensor whatever the model size. Both
write through zerodp.checkpoint.safe_output: DST never overlaps what the source reads, only an earlier output
of the same target is replaced (`check_destination`), and only once the new one is complete. The
Hugging Face and zerodp targets read the source through zerodp.convert.full_state.FullState, so both
write their own names and layouts whatever the source's (zerodp/models/hf.py holds the mapping).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from zerodp.checkpoint.safe_output import staged
from zerodp.convert.destination import (  # noqa: F401
    HF_CONFIG,
    INDEX,
    TOKENIZER_FILES,
    check_destination,
    convert_output_kind,
    parse_size,
)

# check_destination, convert_output_kind and parse_size stay part of this module's API
from zerodp.convert.hf_tokenizer import tokenizer_files as given_tokenizer, with_chat_files
from zerodp.convert.source import (
    MOMENTS,
    CheckpointSource,
    FileRanges,
    TensorInfo,
    names_layout,
    write_safetensors_file,
)
from zerodp.convert.stream import DEFAULT_WINDOW, read_ahead
from zerodp.errors import CheckpointError, UserError
from zerodp.models.hf import ORIGIN, origin_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def _publish(source: CheckpointSource, dst: Path):
    """`staged(dst)`, made `dst` only once the source's integrity check, which ran beside the reads,
    has passed (`source.confirm()`); a read that failed on a damaged file reports the damage."""
    with staged(dst) as out:
        try:
            yield out
        except CheckpointError:
            source.confirm()
            raise
        source.confirm()


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, silence in logs and tests (the command prints a summary line)
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                disable=None if enabled else True, leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B of {total_fmt}B, {rate_fmt}, {remaining} left")




def _read_paths(source: CheckpointSource) -> list[Path]:
    """What the source reads: its file or folder, each file, and the folder that holds them all (for a
    source made of parts, as a LoRA model's adapters and base: each part's, not a folder holding both)."""
    if hasattr(source, "parts"):
        return [p for part in source.parts() for p in _read_paths(part)]
    files = [Path(f) for f in source.files()]
    paths = [Path(source.path), *files]
    if len(files) > 1:
        paths.append(Path(os.path.commonpath([str(f.resolve()) for f in files])))
    return paths


def _source_metadata(source: CheckpointSource, layout: str, tied: dict | None = None,
                     config: dict | None = None) -> dict[str, str]:
    """Every written file's metadata: where it came from, its names' layout ("hf" | "zerodp"), ties, config,
    and the tokenizer record of a run trained on a `zerodp prepare` folder."""
    md = {"format": "pt", "zerodp.source": json.dumps(source.describe(), sort_keys=True), "zerodp.layout": layout,
          "zerodp.tied": json.dumps(source.tied() if tied is None else tied, sort_keys=True)}
    cfg = config or source.meta.get("config")
    if cfg:
        md["zerodp.config"] = json.dumps(cfg, sort_keys=True)
    if source.meta.get("tokenizer"):  # zerodp generate and a later --to hf find the run's tokenizer by it
        md["zerodp.tokenizer"] = json.dumps(source.meta["tokenizer"], sort_keys=True)
    if origin_of(source.meta):  # a later --to hf keeps the Hugging Face model's context and rope by it
        md["zerodp.hf_origin"] = json.dumps(origin_of(source.meta), sort_keys=True)
    return md


def _with_tokenizer(metadata: dict[str, str], files: dict[str, bytes]) -> dict[str, str]:
    """`metadata` with the sha256 of the tokenizer files written beside the weights: what lets --overwrite
    recognise them as ours (convert_output_kind) and a later conversion carry them (carried_tokenizer)."""
    if files:
        metadata["zerodp.tokenizer_files"] = json.dumps(
            {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}, sort_keys=True)
    return metadata


def _shard(names: list[str], infos: dict[str, TensorInfo], max_shard_size: int | None) -> dict[str, list[str]]:
    """{file name: its tensors}: one model.safetensors, or HF's model-0000k-of-0000n.safetensors shards
    of at most max_shard_size bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        if max_shard_size and shards[-1] and size + infos[n].nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += infos[n].nbytes
    k = len(shards)
    files = ["model.safetensors"] if k == 1 else [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    return dict(zip(files, shards))


def _located(source: CheckpointSource, wanted: list[tuple[str, str]],
             kinds: list[str] | None = None) -> dict[str, FileRanges]:
    """{output name: where its bytes lie in the source} for the (output name, stored name) pairs whose
    stored tensor (of kinds[i], default "param") the source can locate (`CheckpointSource.locate`);
    the others are read."""
    found = {}
    for i, (out_name, stored) in enumerate(wanted):
        where = source.locate(stored, kinds[i] if kinds else "param")
        if where is not None:
            found[out_name] = where
    return found


def _write_shards(out: Path, shards: dict[str, list[str]], infos: dict[str, TensorInfo], fetch, metadata: dict,
                  bar) -> list[str]:
    """Write the shards (and, for more than one, the index) into `out`; return the file names."""
    for name, shard in shards.items():
        write_safetensors_file(out / name, shard, infos, fetch, metadata, bar.update)
    files = list(shards)
    if len(shards) > 1:
        weight_map = {n: name for name, shard in shards.items() for n in shard}
        total = sum(i.nbytes for i in infos.values())
        index = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=1))
        files.append(INDEX)
    return files


def write_safetensors(source: CheckpointSource, dst: str | Path, dtype: str | None = None,
                      max_shard_size: int | None = None, progress: bool = True, overwrite: bool = False,
                      window: int = DEFAULT_WINDOW) -> list[Path]:
    """Write the source's weights into folder `dst` as `model.safetensors`, or, when they exceed
    `max_shard_size` bytes, as HF's `model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json`.

    Names and layouts stay as the source has them (`zerodp.layout` in the metadata says which). dtype
    None keeps each tensor's dtype; "fp32" | "bf16" | "fp16" casts floating tensors. A tied alias is
    not written (HF's convention: GPT-2's lm_head.weight is absent and re-tied on load); `zerodp.tied`
    in the metadata records it. The source's description rides in `zerodp.source`. A background thread
    reads up to `window` bytes ahead of the writer (zerodp.convert.stream)."""
    dst = Path(dst)
    target = DTYPES[dtype] if dtype else None
    names = source.param_names()
    infos = {}
    for n in names:
        i = source.info(n)
        infos[n] = TensorInfo(i.shape, target if target is not None and i.dtype.is_floating_point else i.dtype)
    shards = _shard(names, infos, max_shard_size)
    check_destination(dst, "safetensors", overwrite, _read_paths(source))
    tokenizer_files = given_tokenizer(source)
    metadata = _with_tokenizer(_source_metadata(source, names_layout(source)), tokenizer_files)

    source.will_read(("param",))
    # A tensor kept as stored is copied file to file in the kernel; the rest are read ahead (and cast)
    direct = _located(source, [(n, n) for n in names if infos[n].dtype == source.info(n).dtype])
    order = [(n, "param") for shard in shards.values() for n in shard if n not in direct]
    total = sum(i.nbytes for i in infos.values())

    def cast(index: int, t: torch.Tensor) -> torch.Tensor:  # in the reading thread (zerodp.convert.stream)
        want = infos[order[index][0]].dtype
        return t.to(want) if t.dtype != want else t

    sizes = [infos[n].nbytes for n, _ in order]
    with _publish(source, dst) as out, _progress(total, "convert", progress) as bar, \
            read_ahead(source, order, window, cast, sizes) as src:
        def fetch(n: str):
            return direct[n] if n in direct else src.get(n)

        files = _write_shards(out, shards, infos, fetch, metadata, bar)
        for name, data in tokenizer_files.items():
            (out / name).write_bytes(data)
            files.append(name)
    return [dst / name for name in files]


def write_hf(source: CheckpointSource, dst: str | Path, dtype: str | None = None, max_shard_size: int | None = None,
             progress: bool = True, overwrite: bool = False, model: dict | None = None,
             window: int = DEFAULT_WINDOW) -> list[Path]:
    """Write folder `dst` as a Hugging Face model: config.json (zerodp.models.hf.hf_config_from_model) and
    the weights in HF's names and layouts, one model.safetensors or shards with an index, as
    `write_safetensors` lays them out; `AutoModelForCausalLM.from_pretrained(dst)` loads it.

    `model`: the zerodp model section (a dict) the weights belong to; default the source's own
    (`source.meta["config"]["model"]`: a zerodp checkpoint's meta.json, an export's metadata, an HF
    folder's config.json). A tied head is not written (HF re-ties it on load). dtype as for
    `write_safetensors`; config.json's torch_dtype names the embedding's."""
    from zerodp.config import ModelConfig
    from zerodp.convert.experts import per_expert
    from zerodp.convert.full_state import FullState
    from zerodp.models.arch import arch_of
    from zerodp.models.hf import TRANSPOSE, hf_config_from_model, to_hf, transposed

    dst = Path(dst)
    model = model or (source.meta.get("config") or {}).get("model")
    if not model:
        raise UserError(f"{source.path} records no model config (a {source.format} checkpoint written outside "
                        f"zerodp); pass --config with the zerodp config it was trained with")
    a = arch_of(ModelConfig(**{k: v for k, v in model.items() if k in ModelConfig.__dataclass_fields__}))
    source, shapes = per_expert(source, a, a.param_shapes())  # MoE: the stacked experts as HF's per-expert tensors
    state = FullState(source, with_optimizer=False)
    problem = state.mismatch(shapes)
    if problem:
        raise CheckpointError(f"{source.path} does not hold the model its config describes ({problem})")
    target = DTYPES[dtype] if dtype else None
    hf_names, infos, back = [], {}, {}
    for name, shape in shapes.items():
        hf_name, transform = to_hf(a.family, name)
        have = state.source_dtype(name)
        infos[hf_name] = TensorInfo(transposed(shape, transform), target or have if have.is_floating_point else have)
        hf_names.append(hf_name)
        back[hf_name] = (name, shape, transform)
    # A RoPE model keeps the context of the Hugging Face model it started from (not the length the run
    # trained at, which the rope scaling knows nothing of); one trained from scratch has the run's.
    origin = origin_of(source.meta).get("max_position_embeddings")
    trained = model.get("block_size") or 0  # (an HF folder's model section has none: not a weight)
    longest = max(origin, trained) if isinstance(origin, int) and not a.spec.LEARNED_POSITIONS else None
    dtype_name = str(infos[to_hf(a.family, a.embedding)[0]].dtype).replace("torch.", "")
    config = hf_config_from_model(model, dtype=dtype_name, max_positions=longest)
    shards = _shard(hf_names, infos, max_shard_size)
    check_destination(dst, "hf", overwrite, _read_paths(source))
    tied = {to_hf(a.family, alias)[0]: to_hf(a.family, stored)[0] for alias, stored in a.tied_weights().items()}
    seed = ((source.meta.get("config") or {}).get("train") or {}).get("seed")  # zerodp generate's default seed
    metadata = _source_metadata(source, "hf", tied, {"model": model, **({"train": {"seed": seed}}
                                                                        if seed is not None else {})})
    tokenizer_files = given_tokenizer(source)
    config.update(_special_ids(source, bool(tokenizer_files)))
    tokenizer_files = with_chat_files(tokenizer_files, source.meta, config)  # template, generation_config.json
    _with_tokenizer(metadata, tokenizer_files)

    hf_order = [h for shard in shards.values() for h in shard]
    stored_of = {h: state.stored_name(back[h][0]) for h in hf_order}
    source.will_read(("param",))
    # Copied file to file in the kernel: tensors whose stored dtype, shape and layout are HF's already
    direct = _located(source, [(h, stored_of[h]) for h in hf_order
                               if state.stored_transposed(back[h][0]) == (back[h][2] == TRANSPOSE)
                               and source.info(stored_of[h]).dtype == infos[h].dtype
                               and tuple(source.info(stored_of[h]).shape) == infos[h].shape])
    hf_order = [h for h in hf_order if h not in direct]
    order = [(stored_of[h], "param") for h in hf_order]

    def to_hf_layout(index: int, t: torch.Tensor) -> torch.Tensor:  # in the reading thread (zerodp.convert.stream)
        hf_name = hf_order[index]
        name, shape, transform = back[hf_name]
        # nn.Linear (out, in) <-> HF's Conv1D (in, out): transposed once if exactly one of the source's
        # layout and HF's differs from the model's (an HF source written back as HF is not transposed twice)
        if state.stored_transposed(name) != (transform == TRANSPOSE):
            t = t.t()
        want = infos[hf_name]
        if tuple(t.shape) != want.shape:  # state.mismatch compared the headers; this is the data
            raise CheckpointError(f"{source.path}: {name} has shape {tuple(t.shape)} there but {want.shape} "
                                  f"in the output; set the model section to the checkpoint's dimensions")
        if t.dtype == want.dtype:
            return t.contiguous()  # (`to` would hand a transposed view back as it is)
        return t.to(want.dtype, memory_format=torch.contiguous_format)  # one pass: cast and layout

    total = sum(i.nbytes for i in infos.values())
    sizes = [infos[h].nbytes for h in hf_order]
    with _publish(source, dst) as out, _progress(total, "convert", progress) as bar, \
            read_ahead(source, order, window, to_hf_layout, sizes) as src:
        def fetch(hf_name: str):
            return direct[hf_name] if hf_name in direct else src.get(stored_of[hf_name])

        (out / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        files = [HF_CONFIG, *_write_shards(out, shards, infos, fetch, metadata, bar)]
        for name, data in tokenizer_files.items():
            (out / name).write_bytes(data)
            files.append(name)
    return [dst / name for name in files]


def _special_ids(source: CheckpointSource, with_tokenizer: bool) -> dict:
    """config.json's bos/eos token ids: a Hugging Face source's own, else for an export that carries the
    run's tokenizer its end-of-text id as eos (text generation then stops at a document's end), or for
    chat data the template's end-of-turn id."""
    hf = origin_of(source.meta)
    ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf.get(k) is not None}
    rec = source.meta.get("tokenizer") or {}
    eot = rec.get("eot_id", None)
    if eot is None:  # chat data: no separator, the template's end-of-turn ends an answer
        eot = (rec.get("chat") or {}).get("end_of_turn_id")
    if "eos_token_id" not in ids and with_tokenizer and eot is not None:
        ids["eos_token_id"] = int(eot)
    return ids


def write_zerodp(source: CheckpointSource, dst: str | Path, step: int | None = None, progress: bool = True,
                 overwrite: bool = False, window: int = DEFAULT_WINDOW) -> Path:
    """Write `dst` as a zerodp checkpoint folder in the canonical layout (strategy "single", world size 1):
    model.safetensors (fp32 weights), optim.safetensors (fp32 exp_avg / exp_avg_sq, where the source
    has them), optim.json (AdamW step per parameter), trainer.json and meta.json with its manifest.
    zerodp.checkpoint.store.verify() accepts the result; `step` overrides the source's training step."""
    dst = Path(dst)
    train_step = step if step is not None else source.step()
    _check_step_name(dst, train_step)
    check_destination(dst, "zerodp", overwrite, _read_paths(source))
    with _publish(source, dst) as out:
        _write_zerodp_into(out, source, train_step, progress, window)
    return dst


def _check_step_name(dst: Path, train_step: float | None) -> None:
    """A `step_N` destination must hold step N: training numbers its next saves from the step the
    checkpoint records, and a folder named for another step would be mistaken for it by anyone reading
    the folder names (and was, by earlier resume code)."""
    from zerodp.checkpoint.manifest import is_step_name, step_dir_name

    if not is_step_name(dst.name):
        return
    named, at = int(dst.name.removeprefix("step_")), int(train_step or 0)
    if named == at:
        return
    recorded = (f"the source records step {at}" if train_step is not None
                else "the source records no training step (it becomes step 0)")
    raise UserError(f"{dst} is named for step {named} but {recorded}: name it {dst.with_name(step_dir_name(at))}, "
                    f"or pass --step {named} to record step {named}")


def _write_zerodp_into(dst: Path, source: CheckpointSource, train_step: float | None, progress: bool,
                       window: int = DEFAULT_WINDOW) -> None:
    from zerodp.checkpoint.manifest import FORMAT_VERSION, file_record
    from zerodp.convert.full_state import FullState

    state = FullState(source, with_optimizer=False)  # the model's names and layouts, whatever the source's
    names = state.param_names()
    infos = {n: TensorInfo(state.shape(n), torch.float32) for n in names}
    moments = [n for n in names if all(state.has(n, k) for k in MOMENTS)]
    m_names = [f"{n}/{k}" for n in moments for k in MOMENTS]
    m_infos = {f"{n}/{k}": infos[n] for n in moments for k in MOMENTS}
    metadata = _source_metadata(source, "zerodp", state.tied())
    total = sum(i.nbytes for i in infos.values()) + sum(i.nbytes for i in m_infos.values())
    source.will_read(("param",) + (MOMENTS if moments else ()))
    # fp32 tensors the source keeps in the model's layout are copied file to file; the rest are read
    kept = [n for n in names if not state.stored_transposed(n) and state.source_dtype(n) == torch.float32
            and tuple(source.info(state.stored_name(n)).shape) == infos[n].shape]
    direct = _located(source, [(f"{n}/{k}", state.stored_name(n)) for n in kept for k in ("param",) + MOMENTS
                               if k == "param" or n in moments], [k for n in kept for k in ("param",) + MOMENTS
                                                                   if k == "param" or n in moments])
    order = [(state.stored_name(n), "param") for n in names if f"{n}/param" not in direct] + \
        [(state.stored_name(n), k) for n in moments for k in MOMENTS if f"{n}/{k}" not in direct]

    def fetch(name: str, kind: str):
        key = f"{name}/{kind}"
        return direct[key] if key in direct else state.get(name, kind, infos[name].shape)

    with _progress(total, "convert", progress) as bar, state.reading_ahead(order, window):
        write_safetensors_file(dst / "model.safetensors", names, infos, lambda n: fetch(n, "param"), metadata,
                               bar.update)
        write_safetensors_file(dst / "optim.safetensors", m_names, m_infos,
                               lambda key: fetch(*key.rsplit("/", 1)), metadata, bar.update)
    steps = {}
    for n in moments:
        s = source.step(state.stored[n][0])
        steps[n] = float(s if s is not None else (train_step or 0))
    for name, data in given_tokenizer(source).items():  # in the manifest below: verified with the weights
        (dst / name).write_bytes(data)
    (dst / "optim.json").write_text(json.dumps({"step": steps, "extra": {}}))
    trainer = dict(getattr(source, "trainer", {}) or {})
    trainer["step"] = int(train_step or 0)
    (dst / "trainer.json").write_text(json.dumps(trainer, indent=1))
    files = {p.name: file_record(p) for p in sorted(dst.iterdir())}
    meta = {
        "strategy": "single", "world_size": 1, "layout": "canonical",
        "precision": source.meta.get("precision", "fp32"),
        "config": source.meta.get("config") or {},
        "params": {n: {"shape": list(infos[n].shape), "dtype": "float32"} for n in names},
        "tied": state.tied(),
        "converted_from": source.describe(),
        **{k: v for k, v in (("tokenizer", source.meta.get("tokenizer")), (ORIGIN, origin_of(source.meta))) if v},
        "torch_version": torch.__version__,
        "format_version": FORMAT_VERSION, "step": int(train_step or 0), "files": files,
    }
    tmp = dst / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, dst / "meta.json")  # written last, as zerodp's own save does
