"""The model zoo: one folder per family, each a torch-free spec and a module.

    model = build_model(cfg.model, seed)            # the module model.arch names (GPT, Llama, Qwen3)
    meta = build_model(cfg.model, device="meta")    # no memory: what the strategies materialise
    arch_of(cfg.model).param_shapes()               # names and shapes, without torch

`zerodp/models/<family>/spec.py` (torch-free) holds what the rest of zerodp reads about a family:
MODEL (the class in model.py), MODEL_TYPES (the Hugging Face model_type values it reads),
DEFAULT_BIAS, DEFAULT_TIED, EMBEDDING, BLOCK_PREFIX, default_ffn(n_embd), block_shapes(arch, layer),
param_shapes(arch), LEARNED_POSITIONS; the Hugging Face name table TABLE (zerodp name, HF name,
transform), IMPORT_PREFIX, BUFFERS; config.json in both directions (NORM_EPS_KEY,
model_config_from_hf, hf_config); the planner's reading (PLANNER_DEFAULTS, planner_arch) and PRESETS.
`zerodp/models/<family>/model.py` is the module. Adding a family is one folder and one line of
FAMILY_PACKAGES.

A family's constructor only declares modules; it never initialises (torch's own per-module init would
draw every weight on every rank). Initial values come from `DecoderLM.initial_values(name, seed)`.

Layer: above errors only (the specs are torch-free; the modules import torch); config, convert, the
planner, strategies and the trainer import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: zerodp.config imports zerodp.models.hf, never the reverse
    import torch

    from zerodp.config import ModelConfig

FAMILY_PACKAGES = {
    "gpt2": "zerodp.models.gpt2",
    "llama": "zerodp.models.llama",
    "qwen3": "zerodp.models.qwen3",
    "qwen3_moe": "zerodp.models.qwen3_moe",
}
"""model.arch -> the family's package. Defined before the import below: zerodp.models.arch reads it."""

from zerodp.models.arch import Arch, arch_of, spec_of  # noqa: E402
from zerodp.models.lora_spec import lora_spec  # noqa: E402


def _model_class(family: str):
    return getattr(importlib.import_module(FAMILY_PACKAGES[family] + ".model"), spec_of(family).MODEL)


def __getattr__(name: str):  # the modules' classes (GPT, Llama, Qwen3), imported on use: the specs are torch-free
    for family in FAMILY_PACKAGES:
        if name == spec_of(family).MODEL:
            return _model_class(family)
    raise AttributeError(f"module 'zerodp.models' has no attribute {name!r}")


def construct(cfg: ModelConfig):
    """The module `cfg.arch` names, as its constructor leaves it: on torch's current default device
    (nothing allocated under `torch.device("meta")`; partitioned as created under `deepspeed.zero.Init`),
    its values not yet the model's initial weights. With `cfg.lora` the target layers carry low-rank
    adapters and every base parameter is frozen (zerodp.models.lora)."""
    model = _model_class(arch_of(cfg).family)(cfg)
    spec = lora_spec(getattr(cfg, "lora", None))
    if spec is not None:  # low-rank adapters: created here, wherever the model is (meta, zero.Init)
        from zerodp.models.lora import add_adapters

        add_adapters(model, spec)
    return model


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device | None = None):
    """The model `cfg.arch` names with its initial weights for `seed` (train.seed) on `device` (default:
    torch's default device), or on the meta device without memory or values. Built on the meta device
    first: no throw-away init."""
    import torch

    device = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        model = construct(cfg)
    if device.type == "meta":
        return model
    return materialise(model, device, seed)


def materialise(model, device, seed: int, dtype=None):
    """A model built on the meta device made real on `device` (in `dtype` if given: zero1/zero2 keep
    their working copy in 16 bits), every parameter filled with its initial values for `seed`: how the
    strategies that hold the whole model (single, ddp, zero1, zero2) build it, instead of building it on
    the CPU and moving it. One parameter's fp32 values at a time exist in host memory."""
    if dtype is not None:
        model.to(dtype)  # on the meta device: no memory, no values
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    return model


def compile_blocks(model, **options) -> int:
    """torch.compile each transformer block of `model` (or of the model a DDP wrapper or DeepSpeed engine
    holds) in place; `options` go to torch.compile. What is compiled is the block's `forward`, not the
    module's call: the hooks on the block (FSDP2's gather and reshard, DeepSpeed ZeRO-3's fetches,
    zerodp's own measurements) run eagerly around the compiled code wherever they were registered, as
    around torchtitan's compiled block that fully_shard wraps, and cause no graph break; parameter
    names do not change, so checkpoints and the strategies do not either. A block already compiled is
    left as it is (fsdp compiles before sharding, the loop after setup). Returns the blocks compiled now."""
    import torch

    core = model
    while not hasattr(core, "blocks") and hasattr(core, "module"):
        core = core.module
    compiled = 0
    for block in core.blocks():
        if "forward" in vars(block):  # compiled already: the instance's own forward
            continue
        block.forward = torch.compile(block.forward, **options)
        compiled += 1
    return compiled


def param_count(cfg: ModelConfig) -> int:
    """Exact parameter count from the config alone (a tied head counted once)."""
    return arch_of(cfg).param_count()


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token at sequence length block_size (zerodp.models.arch.Arch.flops_per_token)."""
    return arch_of(cfg).flops_per_token()


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape (a tied head listed once), from the description alone."""
    return arch_of(cfg).param_shapes()


__all__ = ["Arch", "FAMILY_PACKAGES", "GPT", "Llama", "Qwen3", "arch_of", "build_model", "compile_blocks", "construct",
           "materialise", "flops_per_token", "param_count", "param_shapes"]
