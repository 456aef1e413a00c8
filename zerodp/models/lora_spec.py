"""Low-rank adapters (LoRA) described, torch-free: `model.lora`'s settings checked, and which weights get
adapters and of what shapes, from the architecture's description alone (the config, the planner and the
conversions read this; zerodp.models.lora builds the modules).

A target linear layer W (out, in) computes

    y = W x + b + (alpha / rank) * B A dropout(x)        A: (rank, in), B: (out, rank)

with W and b frozen and A, B trained. B starts at 0, so step 0 is the base model; A starts at
N(0, 1/(3 in)), the variance of PEFT's kaiming-uniform default. The adapters of module `<m>` are the
parameters `<m>.lora_A.weight` and `<m>.lora_B.weight`: PEFT's names inside the model, so an adapter
export is the same tensors under `base_model.model.` (zerodp.convert).

Targets are matched as PEFT matches them (peft.tuners.tuners_utils.check_target_module_exists) against a
module's full Hugging Face name (`model.layers.3.self_attn.q_proj`, `transformer.h.0.attn.c_attn`: zerodp's
names are Hugging Face's): a name matches the module whose full name equals it or ends with "." + it
(q_proj, mlp.down_proj, model.layers.1.mlp.down_proj; gpt2: c_attn, c_proj, c_fc, attn.c_proj), and a
regular expression (a target holding a character other than letters, digits, _, - and .) is matched
against the whole full name (re.fullmatch), as PEFT does with a target_modules string. `all-linear` (the
default) adapts every linear layer of every block. The embedding and the output head are never adapted.

When `init_from` names a PEFT folder, the rank, alpha and targets not given are its adapter_config.json's.

Layer: beside the family specs (imports zerodp.models.arch and zerodp.errors only)."""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from zerodp.errors import ConfigError

KEYS = ("rank", "alpha", "dropout", "targets", "init_from")
"""model.lora's keys, each documented in LoraSpec."""
ALL_LINEAR = "all-linear"
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    """The adapters' rank r: A is (r, in), B (out, r). 8 to 64 is the usual range."""
    alpha: float
    """The update is scaled by alpha / rank; default: alpha = 2 x rank (a scale of 2)."""
    dropout: float
    """Dropout on the adapter's input (not on the frozen path); 0 keeps strategies bit-comparable."""
    targets: tuple[str, ...]
    """The linear layers adapted: Hugging Face module names (short or full) and regular expressions over the
    full names, or ('all-linear',)."""
    init_from: str | None
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) whose adapters the run
    starts from instead of B = 0; its rank, alpha and targets must equal these."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        out = asdict(self)
        out["targets"] = list(self.targets)
        return out


def lora_spec(section: dict | None, where: str = "model.lora") -> LoraSpec | None:
    """The LoraSpec of a `model.lora` mapping, or None when it is empty (no adapters: full fine-tuning).
    With `init_from`, the rank, alpha and targets not given are the PEFT folder's. Raises ConfigError naming
    the bad key and how to fix it."""
    if not section:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a mapping such as {{rank: 16, targets: [q_proj, v_proj]}}, got {section!r}")
    for key in section:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(KEYS)}"
            raise ConfigError(f"unknown key {key!r} in {where}{hint}")
    init_from = section.get("init_from")
    if init_from is not None and not isinstance(init_from, str):
        raise ConfigError(f"{where}.init_from={init_from!r} must be the path of a PEFT adapter folder")
    section = {**_of_folder(init_from), **section} if init_from else section
    rank = section.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        if rank is None and init_from:
            raise ConfigError(f"{where}.rank is not set and {where}.init_from {init_from} holds no readable "
                              f"adapter_config.json to take it from; give a PEFT adapter folder there, or set "
                              f"{where}.rank")
        if rank is None:
            raise ConfigError(f"{where}.rank is not set: set it to a positive whole number such as 16 (the adapters' "
                              f"rank), or {where}.init_from to a PEFT folder to take it from; for full fine-tuning "
                              f"remove {where}")
        raise ConfigError(f"{where}.rank={rank!r} must be a positive whole number such as 16 (the adapters' rank); "
                          f"for full fine-tuning remove {where}")
    alpha = section.get("alpha", 2 * rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConfigError(f"{where}.alpha={alpha!r} must be a positive number (the update is scaled by alpha / rank; "
                          f"2 x rank = {2 * rank} is the usual start)")
    dropout = section.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{where}.dropout={dropout!r} must be in [0, 1)")
    targets = _targets(section.get("targets", [ALL_LINEAR]), where)
    return LoraSpec(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=tuple(targets), init_from=init_from)


_NAME = re.compile(r"[\w.\-]+")
"""A target of these characters alone is a module name; any other character makes it a regular expression."""


def is_pattern(target: str) -> bool:
    """Whether `target` is a regular expression over full module names rather than a module name."""
    return target != ALL_LINEAR and not _NAME.fullmatch(target)


def _targets(targets, where: str) -> tuple[str, ...]:
    """model.lora.targets as a tuple: a list as given; a string is `all-linear`, names separated by commas,
    or one regular expression (PEFT's target_modules string)."""
    if isinstance(targets, str):
        parts = [t.strip() for t in targets.split(",")]
        if targets.strip().lower() == ALL_LINEAR:
            targets = [ALL_LINEAR]
        elif all(_NAME.fullmatch(t) for t in parts):
            targets = parts
        else:
            targets = [targets]
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"{where}.targets={targets!r} must be a list of module names such as [q_proj, v_proj], "
                          f"[{ALL_LINEAR}], or a regular expression over full module names")
    for t in targets:
        if is_pattern(t):
            try:
                re.compile(t)
            except re.error as e:
                raise ConfigError(f"{where}.targets: {t!r} is not a valid regular expression ({e}); give module "
                                  f"names such as [q_proj, v_proj] or a pattern such as '.*\\.(q|v)_proj'") from None
    return tuple(targets)


def _of_folder(init_from: str) -> dict:
    """rank, alpha and targets of the PEFT folder `init_from` (its adapter_config.json), as model.lora's keys;
    {} when it has none to read (zerodp.convert.peft.check_adapters says what is wrong with it)."""
    try:
        config = json.loads((Path(init_from) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    out = {"rank": config.get("r"), "alpha": config.get("lora_alpha"), "targets": config.get("target_modules")}
    return {k: v for k, v in out.items() if v is not None}


def linear_modules(arch, layer: int = 0) -> dict[str, tuple[int, int]]:
    """Block `layer`'s linear layers: module path inside the block -> (out, in) of its weight (not a
    router: a mixture of experts' `mlp.gate`, its spec's NOT_ADAPTED, which PEFT does not adapt either)."""
    out = {}
    skip = getattr(arch.spec, "NOT_ADAPTED", ())
    for name, shape in arch.block_shapes(layer).items():
        if name.endswith(".weight") and len(shape) == 2 and name[: -len(".weight")] not in skip:
            out[name[: -len(".weight")]] = shape
    return out


def matches(name: str, target: str) -> bool:
    """Whether target `target` adapts the linear layer of full name `name`, by PEFT's rule (module docstring)."""
    if target == ALL_LINEAR:
        return True
    if is_pattern(target):
        return re.fullmatch(target, name) is not None
    return name == target or name.endswith("." + target)


def _block_linears(arch) -> dict[str, tuple[int, int]]:
    """Every linear layer of every block by full name (`model.layers.3.self_attn.q_proj`) -> (out, in)."""
    return {f"{arch.block_prefix}.{layer}.{module}": shape
            for layer in range(arch.n_layer) for module, shape in linear_modules(arch, layer).items()}


def check_targets(arch, spec: LoraSpec, where: str = "model.lora.targets") -> None:
    """Every target names at least one linear layer of the blocks, and a pattern no module outside them (the
    embedding, the head: never adapted); else ConfigError listing the names."""
    modules = _block_linears(arch)
    names = sorted({m.rpartition(".")[2] for m in modules})
    example = next(iter(modules))
    for target in spec.targets:
        if is_pattern(target):
            others = {n.rpartition(".")[0] for n in arch.param_shapes() if not n.startswith(arch.block_prefix + ".")}
            outside = sorted(m for m in others if re.fullmatch(target, m))
            if outside:
                raise ConfigError(f"{where}: the pattern '{target}' matches {outside[0]}, which zerodp never adapts "
                                  f"(the blocks' linear layers only); narrow the pattern")
            if not any(matches(m, target) for m in modules):
                raise ConfigError(f"{where}: the pattern '{target}' matches no linear layer of {arch.family}'s blocks "
                                  f"(it is matched against whole names such as {example}); its linear layers are "
                                  f"{', '.join(names)}")
        elif not any(matches(m, target) for m in modules):
            if target in (*getattr(arch.spec, "UNADAPTED", ()), *getattr(arch.spec, "PEFT_EXPERT_NAMES", ())):
                raise ConfigError(f"{where}: {target!r} is the router or the stacked experts of {arch.family}'s "
                                  f"mixture of experts, which take no adapter; adapters go on {', '.join(names)} (or "
                                  f"all-linear), or train without model.lora")
            close = difflib.get_close_matches(target.rpartition(".")[2], names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: {target!r} names no linear layer of {arch.family}'s blocks; {hint}"
                              f"its linear layers are {', '.join(names)} (or {ALL_LINEAR})")


def adapted_modules(arch, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Every adapted module's full name (`model.layers.3.self_attn.q_proj`) -> (out, in) of its weight."""
    return {m: shape for m, shape in _block_linears(arch).items() if any(matches(m, t) for t in spec.targets)}


def adapter_shapes(arch, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """The adapters' parameter names and shapes: `<m>.lora_A.weight` (rank, in), `<m>.lora_B.weight` (out, rank)."""
    out = {}
    for module, (fan_out, fan_in) in adapted_modules(arch, spec).items():
        out[f"{module}.lora_A.weight"] = (spec.rank, fan_in)
        out[f"{module}.lora_B.weight"] = (fan_out, spec.rank)
    return out


def adapter_count(arch, spec: LoraSpec) -> int:
    """Trainable parameters: rank x (in + out) per adapted module."""
    return sum(math.prod(s) for s in adapter_shapes(arch, spec).values())


def _targets_words(spec: LoraSpec) -> str:
    """The targets in a few words: as given, or, for many full names (a PEFT folder's all-linear), how many
    and the layers' short names."""
    if len(spec.targets) <= 7:
        return ", ".join(spec.targets)
    return f"{len(spec.targets)} targets: " + ", ".join(sorted({t.rpartition(".")[2] for t in spec.targets}))


def summary(arch, spec: LoraSpec, precision: str) -> str:
    """One line for a run's start: what is adapted, how much trains, and the frozen base."""
    modules, trained, base = adapted_modules(arch, spec), adapter_count(arch, spec), arch.param_count()
    share = 100 * trained / (trained + base)
    start = f"; adapters from {spec.init_from}" if spec.init_from else ""
    return (f"LoRA rank {spec.rank}, alpha {spec.alpha:g} (scale {spec.scaling:g}) on {len(modules)} linear layers "
            f"({_targets_words(spec)}): {trained:,} adapter parameters trained ({share:.2f}%), the base's {base:,} "
            f"frozen in {precision}{start}")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (trained) rather than the base model's (frozen)."""
    return name.endswith(ADAPTER_SUFFIXES)
