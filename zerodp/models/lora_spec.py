"""Low-rank adapters (LoRA) described, torch-free: `model.lora`'s settings checked, and which weights get
adapters and of what shapes, from the architecture's description alone (the config, the planner and the
conversions read this; zerodp.models.lora builds the modules).

A target linear layer W (out, in) computes

    y = W x + b + (alpha / rank) * B A dropout(x)        A: (rank, in), B: (out, rank)

with W and b frozen and A, B trained. B starts at 0, so step 0 is the base model; A starts at
N(0, 1/(3 in)), the variance of PEFT's kaiming-uniform default. The adapters of module `<m>` are the
parameters `<m>.lora_A.weight` and `<m>.lora_B.weight`: PEFT's names inside the model, so an adapter
export is the same tensors under `base_model.model.` (zerodp.convert).

A target names a linear layer of the blocks by its Hugging Face module name (q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj; gpt2: c_attn, c_proj, c_fc, or attn.c_proj / mlp.c_proj for one of
the two c_proj), matched as PEFT matches a name: the module's path ends with it. `all-linear` (the
default) adapts every linear layer of every block. The embedding and the output head are never adapted.

Layer: beside the family specs (imports zerodp.models.arch and zerodp.errors only)."""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass

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
    """The linear layers adapted, by their Hugging Face module names, or ('all-linear',)."""
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
    Raises ConfigError naming the bad key and how to fix it."""
    if not section:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a mapping such as {{rank: 16, targets: [q_proj, v_proj]}}, got {section!r}")
    for key in section:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(KEYS)}"
            raise ConfigError(f"unknown key {key!r} in {where}{hint}")
    rank = section.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"{where}.rank={rank!r} must be a positive whole number such as 16 (the adapters' rank); "
                          f"for full fine-tuning remove {where}")
    alpha = section.get("alpha", 2 * rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConfigError(f"{where}.alpha={alpha!r} must be a positive number (the update is scaled by alpha / rank; "
                          f"2 x rank = {2 * rank} is the usual start)")
    dropout = section.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"{where}.dropout={dropout!r} must be in [0, 1)")
    targets = section.get("targets", [ALL_LINEAR])
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"{where}.targets={targets!r} must be a list of module names such as [q_proj, v_proj], "
                          f"or [{ALL_LINEAR}]")
    init_from = section.get("init_from")
    if init_from is not None and not isinstance(init_from, str):
        raise ConfigError(f"{where}.init_from={init_from!r} must be the path of a PEFT adapter folder")
    return LoraSpec(rank=rank, alpha=float(alpha), dropout=float(dropout), targets=tuple(targets), init_from=init_from)


def linear_modules(arch, layer: int = 0) -> dict[str, tuple[int, int]]:
    """Block `layer`'s linear layers: module path inside the block -> (out, in) of its weight (not a
    router: a mixture of experts' `mlp.gate`, its spec's NOT_ADAPTED, which PEFT does not adapt either)."""
    out = {}
    skip = getattr(arch.spec, "NOT_ADAPTED", ())
    for name, shape in arch.block_shapes(layer).items():
        if name.endswith(".weight") and len(shape) == 2 and name[: -len(".weight")] not in skip:
            out[name[: -len(".weight")]] = shape
    return out


def _matches(module: str, target: str) -> bool:
    return target == ALL_LINEAR or module == target or module.endswith("." + target)


def check_targets(arch, spec: LoraSpec, where: str = "model.lora.targets") -> None:
    """Every target names at least one linear layer of the blocks; else ConfigError listing the names."""
    modules = {m for layer in range(arch.n_layer if arch.n_experts else 1) for m in linear_modules(arch, layer)}
    names = sorted({m.rpartition(".")[2] for m in modules})
    for target in spec.targets:
        if not any(_matches(m, target) for m in modules):
            close = difflib.get_close_matches(target, names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: {target!r} names no linear layer of {arch.family}'s blocks; {hint}"
                              f"its linear layers are {', '.join(names)} (or {ALL_LINEAR})")


def adapted_modules(arch, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Every adapted module's full name (`model.layers.3.self_attn.q_proj`) -> (out, in) of its weight."""
    out = {}
    for layer in range(arch.n_layer):
        for module, shape in linear_modules(arch, layer).items():
            if any(_matches(module, t) for t in spec.targets):
                out[f"{arch.block_prefix}.{layer}.{module}"] = shape
    return out


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


def summary(arch, spec: LoraSpec, precision: str) -> str:
    """One line for a run's start: what is adapted, how much trains, and the frozen base."""
    modules, trained, base = adapted_modules(arch, spec), adapter_count(arch, spec), arch.param_count()
    share = 100 * trained / (trained + base)
    start = f"; adapters from {spec.init_from}" if spec.init_from else ""
    return (f"LoRA rank {spec.rank}, alpha {spec.alpha:g} (scale {spec.scaling:g}) on {len(modules)} linear layers "
            f"({', '.join(spec.targets)}): {trained:,} adapter parameters trained ({share:.2f}%), the base's {base:,} "
            f"frozen in {precision}{start}")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (trained) rather than the base model's (frozen)."""
    return name.endswith(ADAPTER_SUFFIXES)
