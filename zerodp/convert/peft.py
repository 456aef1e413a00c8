"""PEFT adapter folders (the `peft` library's LoRA format), written and read by zerodp itself:

    adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules, fan_in_fan_out, ...
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight (r, in), ...lora_B.weight (out, r)

`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), folder)` computes what zerodp's
LoRA model computes. The keys are zerodp's adapter names under `base_model.model.`, each module named
as Hugging Face names it (the family's TABLE, zerodp/models/<family>/spec.py: the same names for every
family today); A and B keep their shapes even over GPT-2's Conv1D layers, for which PEFT is told
fan_in_fan_out (the base weight is (in, out) there).

`write_peft` writes a folder (`zerodp convert RUN --to peft`); `check_adapters` (torch-free: config and
safetensors header) and `read_adapters` read one back for `model.lora.init_from`, refusing in one line an
adapter zerodp would not compute as PEFT does, or one made for another model. A pickled adapter
(adapter_model.bin) is never loaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from zerodp.errors import ConfigError
from zerodp.models.hf import TRANSPOSE, from_hf, to_hf
from zerodp.models.lora_spec import ALL_LINEAR, LoraSpec, adapted_modules, adapter_shapes, is_pattern, linear_modules

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED = "adapter_model.bin"
BASE_FOLDER = "base"  # zerodp.convert.destination.PEFT_BASE
"""Where `zerodp convert RUN --to peft` writes a base no folder holds (a seed's initial weights)."""
PREFIX = "base_model.model."
"""PeftModel's prefix on the wrapped model's names, as its saved adapters carry it."""
# Settings under which PEFT computes something else than W x + (alpha / r) B A x: refused on import.
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "bias": "none", "modules_to_save": None,
                "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
# Refused on import too, but not written (older PEFT versions do not know them).
_UNSUPPORTED_READ = {"exclude_modules": None, "target_parameters": None, "lora_bias": False,
                     "trainable_token_indices": None, "layer_replication": None}


def is_peft_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding an adapter_config.json (a PEFT adapter, not a model)."""
    return Path(path).is_dir() and (Path(path) / ADAPTER_CONFIG).is_file()


def peft_key(family: str, name: str) -> tuple[str, bool]:
    """(PEFT's key, whether the base layer is Hugging Face's Conv1D) of zerodp adapter `name`
    (`<module>.lora_A.weight`)."""
    module, _, tail = name.rpartition(".lora_")
    hit = to_hf(family, f"{module}.weight")
    assert hit is not None, f"{family}'s TABLE has no row for {module}.weight"
    return f"{PREFIX}{hit[0].removesuffix('.weight')}.lora_{tail}", hit[1] == TRANSPOSE


def zerodp_name(family: str, key: str) -> str | None:
    """zerodp's adapter name of PEFT key `key`, or None if it names no layer of the family."""
    body = key.removeprefix(PREFIX)
    module, sep, tail = body.rpartition(".lora_")
    if not key.startswith(PREFIX) or not sep or tail not in ("A.weight", "B.weight"):
        return None
    hit = from_hf(family, f"{module}.weight")
    return f"{hit[0].removesuffix('.weight')}.lora_{tail}" if hit else None


def peft_targets(arch, spec: LoraSpec) -> list[str] | str:
    """target_modules for adapter_config.json: the spec's targets (PEFT matches them as zerodp does),
    `all-linear` spelled out as the blocks' linear layers' names (PEFT's own all-linear would depend on its
    version's rules), one pattern as PEFT's pattern string, and names beside patterns (which PEFT's list
    cannot hold) as the adapted modules' full names."""
    if ALL_LINEAR in spec.targets:
        return sorted({m.rpartition(".")[2] for m in linear_modules(arch)})
    if not any(is_pattern(t) for t in spec.targets):
        return list(spec.targets)
    if len(spec.targets) == 1:
        return spec.targets[0]
    return [_hf_module(arch, m) for m in adapted_modules(arch, spec)]


def adapter_config(arch, spec: LoraSpec, base: str | None) -> dict:
    """adapter_config.json for adapters `spec` of model `arch`; `base`: the base model's path or hub name."""
    fan_in_fan_out = any(peft_key(arch.family, n)[1] for n in adapter_shapes(arch, spec))
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": spec.rank,
            "lora_alpha": alpha, "lora_dropout": spec.dropout, "target_modules": peft_targets(arch, spec),
            "fan_in_fan_out": fan_in_fan_out, "init_lora_weights": True, "inference_mode": True,
            **_UNSUPPORTED}


def write_peft(adapters: dict, dst: str | Path, arch, spec: LoraSpec, base: str | None, metadata: dict,
               confirm=lambda: None, base_model=None) -> list[Path]:
    """Write folder `dst` (checked by zerodp.convert.destination.check_destination first) as a PEFT
    adapter: adapter_config.json and adapter_model.safetensors of `adapters` ({zerodp name: tensor}, in
    their dtype) under PEFT's keys, with `metadata` in the file's header. Written into a hidden sibling
    and renamed into place (zerodp.checkpoint.safe_output.staged) only after `confirm()` (the source's
    integrity check) has passed.

    `base_model` (a CheckpointSource of the base model, when no folder holds it: a seed's initial weights)
    is written inside as the Hugging Face folder `dst/base`, which base_model_name_or_path then names."""
    from zerodp.checkpoint.safe_output import staged
    from zerodp.convert.source import TensorInfo, write_safetensors_file

    assert set(adapters) == set(adapter_shapes(arch, spec)), "the adapters are not the spec's"
    _check_expert_names(arch, adapters)
    keys = {peft_key(arch.family, n)[0]: n for n in sorted(adapters)}
    infos = {k: TensorInfo(tuple(adapters[n].shape), adapters[n].dtype) for k, n in keys.items()}
    if base_model is not None:
        base = str(Path(dst).resolve() / BASE_FOLDER)
    config = adapter_config(arch, spec, base)
    with staged(dst) as out:
        if base_model is not None:
            from zerodp.convert.writers import write_hf

            write_hf(base_model, out / BASE_FOLDER, progress=False)
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors_file(out / ADAPTER_WEIGHTS, list(keys), infos, lambda k: adapters[keys[k]].contiguous(),
                               {"format": "pt", "zerodp.layout": "peft", **metadata})
        confirm()
    return [Path(dst) / ADAPTER_CONFIG, Path(dst) / ADAPTER_WEIGHTS] + ([Path(dst) / BASE_FOLDER] if base_model else [])


def _check_expert_names(arch, adapters: dict) -> None:
    """A mixture of experts' adapters PEFT would load onto other weights are refused (ConfigError): on a
    Qwen3-MoE model, peft (0.21) reads gate_proj, up_proj and down_proj in target_modules as the stacked
    experts' parameters (its transformers-5 remapping), so a dense block's MLP adapter would not load."""
    taken = getattr(arch.spec, "PEFT_EXPERT_NAMES", ())
    bad = sorted({n.rpartition(".lora_")[0].rpartition(".")[2] for n in adapters} & set(taken))
    if bad:
        raise ConfigError(f"cannot export {arch.family} adapters on {', '.join(bad)} for PEFT: peft reads those names "
                          f"on a {arch.family} model as its stacked experts', so these adapters would not load; export "
                          f"with --to hf --merge, or adapt the attention only (model.lora.targets=[q_proj, k_proj, "
                          f"v_proj, o_proj])")


# -- reading -----------------------------------------------------------------------------------------

def read_config(folder: str | Path, where: str) -> dict:
    """adapter_config.json of PEFT folder `folder`, its weights file checked present; ConfigError otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{where} {folder} does not exist or is not a folder; give a PEFT adapter folder "
                          f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}), such as `zerodp convert RUN --to peft` writes")
    if not (folder / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{where} {folder} holds no {ADAPTER_CONFIG}: not a PEFT adapter folder; give the folder "
                          f"PeftModel.save_pretrained or `zerodp convert RUN --to peft` wrote")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        if (folder / PICKLED).is_file():
            raise ConfigError(f"{where} {folder} holds a pickled adapter ({PICKLED}), and zerodp never loads a pickle "
                              f"(it can run code); save it as safetensors: PeftModel.save_pretrained(dir, "
                              f"safe_serialization=True)")
        raise ConfigError(f"{where} {folder} holds no {ADAPTER_WEIGHTS}; give a complete PEFT adapter folder")
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where} {folder / ADAPTER_CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ConfigError(f"{where} {folder} is a {kind or 'non-LoRA'} adapter; zerodp trains and reads LoRA adapters "
                          f"(peft_type LORA) only")
    for key in (*_UNSUPPORTED, *_UNSUPPORTED_READ):
        value = config.get(key)
        if value not in (None, "none") if key == "bias" else value not in (None, False, {}, []):
            raise ConfigError(f"{where} {folder} sets {key}={config[key]!r}, which zerodp's LoRA does not compute "
                              f"(it computes W x + alpha / r * B A x on the target layers alone); export the adapter "
                              f"without it")
    return config


def _header(path: Path) -> dict:
    """The tensors of a safetensors file's header: {name: (dtype, shape)} (no torch)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n <= 100 * 2**20 else None
    except (OSError, ValueError) as e:
        header = None
        why = str(e)
    else:
        why = "no valid header"
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a safetensors file ({why}); re-save the adapter")
    header.pop("__metadata__", None)
    return {k: (v.get("dtype"), tuple(v.get("shape") or ())) for k, v in header.items() if isinstance(v, dict)}


def _hf_module(arch, module: str) -> str:
    """The Hugging Face name of zerodp module `module` (PEFT's key for it, without prefix and tail)."""
    return peft_key(arch.family, f"{module}.lora_A.weight")[0].removeprefix(PREFIX).removesuffix(".lora_A.weight")


def _modules_of_targets(arch, targets) -> set[str]:
    """The zerodp modules PEFT adapts for adapter_config.json's `target_modules`, by PEFT's own rule
    (peft.tuners.tuners_utils.check_target_module_exists) over the Hugging Face full names: a string is
    all-linear or a pattern the full name matches whole; a list, names the full name equals or ends with
    after a dot."""
    every = {m: _hf_module(arch, m) for m in adapted_modules(arch, LoraSpec(1, 1.0, 0.0, (ALL_LINEAR,), None))}
    if isinstance(targets, str):
        if targets.lower() == ALL_LINEAR:
            return set(every)
        try:
            return {m for m, h in every.items() if re.fullmatch(targets, h)}
        except re.error as e:
            raise ConfigError(f"{ADAPTER_CONFIG}: target_modules {targets!r} is not a valid regular expression "
                              f"({e}); re-save the adapter") from None
    targets = [t for t in targets or () if isinstance(t, str)]
    return {m for m, h in every.items() if h in targets or any(h.endswith(f".{t}") for t in targets)}


def _short(modules: set[str]) -> str:
    names = sorted({m.rpartition(".")[2] for m in modules})
    return ", ".join(names) if names else "no layer"


def check_adapters(folder: str | Path, arch, spec: LoraSpec, where: str = "model.lora.init_from") -> dict[str, str]:
    """Check PEFT folder `folder` against adapters `spec` of model `arch` without reading a tensor: its rank,
    alpha and targets equal the spec's, and its tensors are the spec's adapters with their shapes (an
    adapter made for another width or depth is refused). Returns {zerodp name: PEFT key}; ConfigError
    naming the difference and the fix otherwise."""
    folder = Path(folder)
    config = read_config(folder, where)
    section = where.rpartition(".")[0] or "model.lora"
    if config.get("r") != spec.rank:
        raise ConfigError(f"{where} {folder} has rank r={config.get('r')!r} but {section}.rank is {spec.rank}; set "
                          f"{section}.rank={config.get('r')} to start from it")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or float(alpha) != spec.alpha:
        raise ConfigError(f"{where} {folder} has lora_alpha={alpha!r} but {section}.alpha is {spec.alpha:g}; set "
                          f"{section}.alpha={alpha} to start from it")
    theirs, ours = _modules_of_targets(arch, config.get("target_modules")), set(adapted_modules(arch, spec))
    if theirs != ours:
        raise ConfigError(f"{where} {folder} adapts {_short(theirs)} (target_modules {config.get('target_modules')!r}) "
                          f"but {section}.targets adapts {_short(ours)}; set {section}.targets to the adapter's")
    want = adapter_shapes(arch, spec)
    found: dict[str, str] = {}
    for key, (dtype, shape) in _header(folder / ADAPTER_WEIGHTS).items():
        name = zerodp_name(arch.family, key)
        if name is None or name not in want:
            raise ConfigError(f"{where} {folder / ADAPTER_WEIGHTS} holds {key}, which is no adapter of this "
                              f"{arch.family} model ({arch.n_layer} layers, {section}.targets {list(spec.targets)}); "
                              f"it was made for another model: give an adapter of this base")
        if shape != tuple(want[name]):
            raise ConfigError(f"{where} {folder}: {key} is {list(shape)} there but {list(want[name])} in this model "
                              f"(n_embd {arch.n_embd}); the adapter was made for a base of another shape: give one "
                              f"trained on this base, or set the model section to its base's")
        if dtype not in ("F32", "BF16", "F16", "F64"):
            raise ConfigError(f"{where} {folder}: {key} is {dtype}, not a floating-point tensor")
        found[name] = key
    missing = sorted(set(want) - set(found))
    if missing:
        raise ConfigError(f"{where} {folder / ADAPTER_WEIGHTS} lacks {len(missing)} of the {len(want)} adapter tensors "
                          f"(e.g. {peft_key(arch.family, missing[0])[0]}); the file is incomplete")
    return found


def read_adapters(folder: str | Path, arch, spec: LoraSpec, where: str = "model.lora.init_from") -> dict:
    """The adapters of PEFT folder `folder` by zerodp's names, fp32 on the CPU, after `check_adapters`."""
    from zerodp.convert.source import SafetensorsFile

    keys = check_adapters(folder, arch, spec, where)
    f = SafetensorsFile(Path(folder) / ADAPTER_WEIGHTS)
    return {name: f.read(key).float() for name, key in keys.items()}


def spec_of_config(config: dict) -> LoraSpec:
    """The LoraSpec an adapter_config.json (read_config's) describes: what a PEFT folder given to zerodp
    generate or eval adapts."""
    from zerodp.models.lora_spec import lora_spec

    targets = config.get("target_modules")
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:  # PEFT's spelling is case-blind
        targets = ALL_LINEAR
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    return lora_spec({"rank": config.get("r"), "alpha": config.get("lora_alpha", 8), "targets": targets,
                      "dropout": float(config.get("lora_dropout") or 0.0)}, f"{ADAPTER_CONFIG}")


# -- a run's start (model.lora.init_from) ------------------------------------------------------------

def check_init_from(model_cfg) -> None:
    """model.lora.init_from, when set, is a PEFT folder of this model's adapters (`check_adapters`, headers
    only): checked at the run's start, before anything is written."""
    from zerodp.models.arch import arch_of
    from zerodp.models.lora_spec import lora_spec

    spec = lora_spec(model_cfg.lora)
    if spec is not None and spec.init_from:
        check_adapters(spec.init_from, arch_of(model_cfg), spec)


class AdapterStart:
    """What a strategy's `load_full` receives for a run whose adapters start from a PEFT folder: the
    adapters' tensors alone. Every load_full copies only what the state `holds`
    (zerodp.strategies.common.loaded_params), so the base stays as the run loaded it."""

    with_optimizer = False
    source = None

    def __init__(self, adapters: dict):
        self.adapters = adapters

    def holds(self, name: str) -> bool:
        return name in self.adapters

    def get(self, name: str, kind: str, shape):
        assert kind == "param" and name in self.adapters, (name, kind)
        return self.adapters[name].reshape(tuple(shape))

    def step(self, name: str) -> float:
        return 0.0


def load_adapters(strategy, config: dict) -> None:
    """Collective: set the adapters of the run `config` describes (a Config's dict) to model.lora.init_from's
    (read_adapters), over the base the run has loaded, at the start (a fresh AdamW)."""
    from zerodp.models.arch import arch_from_section
    from zerodp.models.lora_spec import lora_spec

    spec = lora_spec(config["model"]["lora"])
    strategy.load_full(AdapterStart(read_adapters(spec.init_from, arch_from_section(config["model"]), spec)))
