"""zerodp's configuration: typed sections, strict YAML loading, `section.key=value` overrides.

This module imports neither torch nor deepspeed, so the planner (`zerodp plan`) can read a training
config instantly. Every field is documented where it is declared; `validate()` checks the values that
do not depend on the world size, `check_batch_split()` the ones that do.

Layer: above errors and the model specs (zerodp.models, whose Hugging Face config.json reader it
uses) and nothing else; torch-free. Every other layer may import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from zerodp.errors import ConfigError, UserError

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "auto")
from zerodp.models.arch import FAMILIES as ARCHS  # noqa: E402  (model.arch: the families zerodp.models registers)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class ModelConfig:
    arch: str = "gpt2"
    """gpt2 (learned positions, LayerNorm, GELU) or llama (Llama 2/3, Mistral, Qwen2: rotary positions,
    RMSNorm, SwiGLU, grouped-query attention) or qwen3 (llama with per-head q/k RMSNorm). See docs/models.md."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_kv_head: Optional[int] = None
    """llama: key/value heads (grouped-query attention), a divisor of n_head; null: n_head."""
    head_dim: Optional[int] = None
    """llama: width of one attention head; null: n_embd / n_head."""
    n_embd: int = 128
    """Hidden width."""
    intermediate_size: Optional[int] = None
    """Width of the MLP's inner layer; null: 4 x n_embd (gpt2), or 8/3 x n_embd rounded up to a multiple
    of 256 (llama)."""
    vocab_size: int = 256
    """Vocabulary size. 256 covers the built-in byte-level tokenizer; GPT-2 uses 50257. Left unset (in
    neither the YAML nor an override, no hf_config) with a `zerodp prepare` folder as data.source: its
    meta.json vocab_size, the tokenizer's; a value written is kept, and one below that is an error."""
    block_size: int = 128
    """Context length, and the sequence length every training sample has."""
    bias: Optional[bool] = None
    """gpt2: biases in Linear and LayerNorm layers, as in GPT-2; null: true for gpt2, false for llama
    (which has none; see qkv_bias)."""
    qkv_bias: bool = False
    """llama: biases on the q, k and v projections (Qwen2)."""
    tie_embeddings: Optional[bool] = None
    """The output head shares the token embedding's weight; null: true for gpt2, false for llama."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm (gpt2) or RMSNorm (llama)."""
    rope_theta: float = 10000.0
    """llama: base of the rotary position embedding's frequencies (Llama 3: 500000)."""
    rope_scaling: dict = field(default_factory=dict)
    """llama: Llama 3.1's rope scaling, as in config.json (rope_type llama3, factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings); empty: none."""
    hf_config: Optional[str] = None
    """A Hugging Face config.json (or the model folder holding one) that sets arch and every dimension;
    a model key given as well must agree with it."""
    dropout: float = 0.0
    """Dropout probability. 0 keeps runs at different world sizes bit-comparable."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of storing them."""
    init_from: Optional[str] = None
    """Start from these weights (safetensors file, Hugging Face model folder or convertible checkpoint)
    instead of random init; checked against this model section before the run starts."""


@dataclass
class DataConfig:
    source: str = "builtin"
    """'builtin' (the Python standard library's source, byte-level), a text file, a folder of text
    files, a pre-tokenized token file (.bin, nanoGPT layout), or a `zerodp prepare` folder (train.bin,
    val.bin and meta.json: dtype, vocabulary and tokenizer come from meta.json; docs/data.md)."""
    token_dtype: str = "uint16"
    """Element type of a pre-tokenized .bin file: uint16 or uint32 (a prepare folder says its own)."""
    val_fraction: float = 0.05
    """Fraction of the tokens held out for validation (taken from the end of the stream; a prepare
    folder has its own val.bin)."""
    cache_dir: Optional[str] = None
    """Where tokenized data is cached as a memory-mapped file; default ~/.cache/zerodp."""
    max_bytes: int = 4_000_000
    """Bytes of the built-in corpus read (its first files up to this many; keeps the demo fast). A text
    file or folder of your own is always read whole; what was read is printed when training starts."""
    prefetch: int = 2
    """Global batches prepared ahead of the training step by a background thread."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many optimizer steps."""
    decay_steps: Optional[int] = None
    """Steps of the cosine decay after warmup; default: train.max_steps - warmup_steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not biases, norms or embeddings)."""
    beta1: float = 0.9
    """AdamW's decay rate of the first moment (the gradient's running mean)."""
    beta2: float = 0.95
    """AdamW's decay rate of the second moment (the squared gradient's running mean)."""
    eps: float = 1e-8
    """Added to the root of the second moment in AdamW's denominator."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    scale_lr_with_batch: bool = False
    """Scale lr and min_lr linearly by global_batch_size / base_batch_size."""
    base_batch_size: int = 32
    """Reference global batch for the linear lr scaling."""


@dataclass
class TrainConfig:
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over all ranks and accumulation steps."""
    micro_batch_size: typing.Union[int, str] = 8
    """Sequences per rank per forward/backward pass, or 'auto': at launch the planner picks the divisor of
    global_batch_size / world_size with the highest predicted tokens/s that fits the device, with
    activation checkpointing on only if that is faster or needed (zerodp plan --global-batch)."""
    max_steps: int = 100
    """Optimizer steps to train for."""
    seed: int = 1337
    """Seeds initialisation and the data order; the batch of step k depends on (seed, k) only."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (mixed precision with fp32 master weights)."""
    deterministic: bool = False
    """CUDA: deterministic kernels only (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8,
    cuDNN deterministic), so a repeated or resumed run reproduces the bits; costs speed (attention
    backward without split-key parallelism, no cuDNN attention). CPU runs are bit-reproducible without it."""
    compile: bool = False
    """torch.compile each transformer block (in place: names, checkpoints and the strategy unchanged).
    Costs a compilation at the first steps (and for the end-of-run sample); then fused kernels run each
    block faster with fewer saved activations. Needs a C++ compiler on the CPU, Triton on CUDA."""
    out_dir: str = "runs/tiny"
    """Run directory: resolved config, metrics.jsonl, checkpoints."""
    eval_every: int = 50
    """Validate every this many steps (and at the end); 0 disables validation."""
    eval_batches: int = 4
    """Micro batches per rank used for one validation."""
    progress: bool = True
    """Show a live progress bar on rank 0; false prints one line every log_every steps instead."""
    log_every: int = 10
    """The host-sync interval: loss, grad norm and the per-rank timings stay on the device and are fetched
    (and exchanged between ranks, with any preemption request) once every this many steps, and at every
    checkpoint, validation and the last step; metrics.jsonl still gets every step's line. Without a
    progress bar (train.progress=false) a console line is printed at each of these steps too."""
    tensorboard: bool = False
    """Write every scalar of metrics.jsonl to <out_dir>/tensorboard (pip install 'zerodp[tensorboard]')."""
    wandb: str = ""
    """A Weights & Biases project to log every scalar of metrics.jsonl to (pip install 'zerodp[wandb]');
    empty: off. WANDB_MODE=offline keeps the run in <out_dir>/wandb."""
    peak_tflops: float = 0.0
    """One device's peak TFLOP/s for the MFU figure; 0: the planner's table for the CUDA device and
    train.precision (no MFU on a CPU or an unknown device)."""
    sample_tokens: int = 200
    """Tokens generated from the final model and printed at the end; 0 disables."""
    device: str = "auto"
    """'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'."""
    preempt_grace_s: float = 120.0
    """After SIGTERM/SIGUSR1: finish the step, save and exit within this many seconds, else exit hard."""
    straggler_margin: float = 0.2
    """A rank whose step takes this fraction longer than the median of the other ranks' is slow..."""
    straggler_patience: int = 5
    """...and is reported as a straggler (once per slow spell) after this many consecutive slow steps."""
    measure_comm: bool = True
    """Count the bytes each step hands to collectives (`comm_bytes` in metrics.jsonl) and compare them
    with the planner's prediction at the end (zerodp/comm.py); false counts nothing."""
    grad_noise_scale: bool = True
    """Estimate the gradient noise scale, the critical batch (`grad_noise_scale` in metrics.jsonl, in
    sequences and tokens, and a line in the run summary; docs/grad_noise.md): from each micro batch's own
    gradient norm, taken before the reduction, and the reduced one. Costs one norm per parameter per micro
    batch; false takes none. Needs two batch sizes: skipped on one process without accumulation."""
    grad_noise_ema: float = 0.99
    """Decay of the exponential moving averages that smooth the estimate over steps (0.99: about the
    last 100 steps); in [0, 1), 0 reports each step's own, very noisy, estimate."""


@dataclass
class StrategyConfig:
    name: str = "auto"
    """single | ddp | zero1 | zero2 | zero3 | fsdp | auto."""
    bucket_size_mb: int = 25
    """Gradient bucket size for DDP and the DeepSpeed reduce/allgather buckets, in MB."""
    overlap_comm: bool = True
    """DeepSpeed: overlap gradient reduction with the backward pass."""
    contiguous_gradients: bool = True
    """DeepSpeed: copy gradients into one contiguous buffer as they are produced."""
    offload_optimizer: bool = False
    """Keep optimizer state (and the fp32 master weights) in CPU memory (zero1-3, fsdp)."""
    offload_params: bool = False
    """Keep parameters in CPU memory between uses (zero3, fsdp)."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3-like); false keeps them (ZeRO-2-like)."""
    fsdp_defer_grad_reduce: bool = False
    """FSDP with gradient accumulation: keep full fp32 gradients between micro batches and
    reduce-scatter once per step (less traffic, but 4P bytes per rank that sharding does not divide);
    false reduce-scatters every micro batch, as ZeRO-2/3 do."""
    hybrid_shard: bool = False
    """FSDP: shard within groups of shard_group_size ranks (a node), replicate across groups (HSDP)."""
    shard_group_size: int = 0
    """FSDP hybrid sharding: ranks per shard group; 0 means the ranks of one node (LOCAL_WORLD_SIZE)."""
    timeout_s: int = 600
    """Collective timeout: a rank that waits longer than this for its peers stops with an error."""
    deepspeed: dict = field(default_factory=dict)
    """Extra DeepSpeed config keys; they override the generated ones unless they contradict zerodp."""
    hpz_partition_size: int = 1
    """zero3, ZeRO++ hpZ (DeepSpeed's zero_hpz_partition_size): ranks holding a secondary copy of the
    parameters, so that the all-gathers of backward stay inside a node; 1 = off, 0 = the ranks of one
    node (LOCAL_WORLD_SIZE). Needs more than one node. See docs/strategies.md, "ZeRO++"."""
    quantized_weights: bool = False
    """zero3, ZeRO++ qwZ (DeepSpeed's zero_quantized_weights): all-gather the parameters in int8 (GPUs only)."""
    quantized_gradients: bool = False
    """zero3, ZeRO++ qgZ (DeepSpeed's zero_quantized_gradients): reduce-scatter the gradients in int4
    through all-to-all (GPUs only)."""


@dataclass
class CheckpointConfig:
    every: int = 50
    """Save every this many optimizer steps (and always at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Intact checkpoints kept on disk; older ones are deleted after a newer one is complete. A damaged
    checkpoint does not count: it is set aside (renamed `*.damaged`), never deleted."""
    resume: bool = True
    """Resume from the newest checkpoint in out_dir when one exists (`--fresh` sets false)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "Config":
        """Check every value that does not depend on the world size; return self."""
        m, t, o, s, c, d = self.model, self.train, self.optim, self.strategy, self.checkpoint, self.data
        _positive("model.n_layer", m.n_layer)
        _positive("model.n_head", m.n_head)
        _positive("model.n_embd", m.n_embd)
        _positive("model.vocab_size", m.vocab_size)
        _positive("model.block_size", m.block_size)
        _one_of("model.arch", m.arch, ARCHS)
        if m.arch == "gpt2":
            for key, value, default in (("n_kv_head", m.n_kv_head, m.n_head), ("head_dim", m.head_dim, None),
                                        ("qkv_bias", m.qkv_bias, False), ("rope_scaling", m.rope_scaling, {})):
                if value not in (default, None) and value != default:
                    raise ConfigError(f"model.{key}={value!r} applies to model.arch=llama; gpt2 has none "
                                      f"(remove the key or set model.arch=llama)")
        elif m.bias:
            raise ConfigError("model.bias=true applies to gpt2; llama has no biases (Qwen2's q/k/v biases: "
                              "model.qkv_bias=true)")
        if m.n_kv_head is not None and (m.n_kv_head <= 0 or m.n_head % m.n_kv_head):
            raise ConfigError(f"model.n_kv_head={m.n_kv_head} must divide model.n_head={m.n_head}; "
                              f"choose one of {[d for d in range(1, m.n_head + 1) if m.n_head % d == 0]}")
        if m.head_dim is not None:
            _positive("model.head_dim", m.head_dim)
        if m.intermediate_size is not None:
            _positive("model.intermediate_size", m.intermediate_size)
        _positive("model.norm_eps", m.norm_eps)
        _positive("model.rope_theta", m.rope_theta)
        if m.n_embd % m.n_head and m.head_dim is None:
            raise ConfigError(
                f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; "
                f"choose n_head among the divisors of n_embd (e.g. {_divisor_near(m.n_embd, m.n_head)})"
            )
        if not 0.0 <= m.dropout < 1.0:
            raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
        if d.token_dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.token_dtype={d.token_dtype!r} must be 'uint16' or 'uint32'")
        if not 0.0 < d.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 0.5)")
        _positive("data.max_bytes", d.max_bytes)
        _non_negative("data.prefetch", d.prefetch)
        _positive("optim.lr", o.lr, hint="a learning rate such as 3e-4")
        _non_negative("optim.min_lr", o.min_lr)
        if o.min_lr > o.lr:
            raise ConfigError(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}; set min_lr <= lr")
        _non_negative("optim.warmup_steps", o.warmup_steps)
        if o.decay_steps is not None:
            _positive("optim.decay_steps", o.decay_steps)
        _non_negative("optim.weight_decay", o.weight_decay)
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(o, key) < 1.0:
                raise ConfigError(f"optim.{key}={getattr(o, key)} must be in [0, 1)")
        _positive("optim.eps", o.eps)
        _non_negative("optim.grad_clip", o.grad_clip, hint="0 disables clipping")
        _positive("optim.base_batch_size", o.base_batch_size)
        _positive("train.global_batch_size", t.global_batch_size)
        if t.micro_batch_size != "auto":
            _positive("train.micro_batch_size", t.micro_batch_size)
        if t.micro_batch_size != "auto" and t.global_batch_size % t.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={t.micro_batch_size}; make the global batch "
                f"micro_batch_size x world_size x grad_accum_steps"
            )
        _positive("train.max_steps", t.max_steps)
        _non_negative("train.seed", t.seed)
        _one_of("train.precision", t.precision, PRECISIONS)
        _one_of("train.device", t.device, ("auto", "cpu", "cuda"))
        _non_negative("train.eval_every", t.eval_every)
        _positive("train.eval_batches", t.eval_batches)
        _positive("train.log_every", t.log_every)
        _non_negative("train.peak_tflops", t.peak_tflops)
        _non_negative("train.sample_tokens", t.sample_tokens)
        _positive("train.preempt_grace_s", t.preempt_grace_s)
        _positive("train.straggler_margin", t.straggler_margin)
        _positive("train.straggler_patience", t.straggler_patience)
        if not 0.0 <= t.grad_noise_ema < 1.0:
            raise ConfigError(f"train.grad_noise_ema={t.grad_noise_ema} must be in [0, 1) (0.99 averages about "
                              f"the last 100 steps)")
        if not t.out_dir:
            raise ConfigError("train.out_dir is empty; set it to the run directory, e.g. runs/my_run")
        _one_of("strategy.name", s.name, STRATEGIES)
        _positive("strategy.bucket_size_mb", s.bucket_size_mb)
        _positive("strategy.timeout_s", s.timeout_s)
        _non_negative("strategy.shard_group_size", s.shard_group_size)
        _non_negative("strategy.hpz_partition_size", s.hpz_partition_size,
                      hint="1 turns hpZ off, 0 takes the ranks of one node")
        if refusal := zeropp_refusal(s, s.name):
            raise ConfigError(refusal)
        _non_negative("checkpoint.every", c.every)
        _positive("checkpoint.keep_last", c.keep_last)
        return self

    def check_batch_split(self, world_size: int) -> int:
        """Return gradient accumulation steps for this world size, or explain why the split fails.
        train.micro_batch_size=auto must be resolved first (zerodp.trainer.loop.resolve_strategy)."""
        assert self.train.micro_batch_size != "auto", "resolve train.micro_batch_size=auto before splitting"
        return batch_split(self.train.global_batch_size, self.train.micro_batch_size, world_size)


def zeropp_settings(s: StrategyConfig) -> list[str]:
    """The ZeRO++ settings `s` turns on, as `strategy.key=value` (empty when none is)."""
    on = [f"strategy.hpz_partition_size={s.hpz_partition_size}"] if s.hpz_partition_size != 1 else []
    return on + [f"strategy.{key}=true" for key in ("quantized_weights", "quantized_gradients") if getattr(s, key)]


def zeropp_refusal(s: StrategyConfig, name: str) -> str | None:
    """Why strategy `name` cannot run the ZeRO++ settings of `s` (DeepSpeed has them for ZeRO-3 only),
    or None. `validate` asks, and zerodp.strategies.zero again for its stage. auto is refused too: the
    planner never chooses ZeRO++ (its quantisation changes the numerics), so the settings would be
    ignored whenever it chose another strategy."""
    on = zeropp_settings(s)
    if not on or name == "zero3":
        return None
    which = "strategy.name=auto never chooses it" if name == "auto" else f"not {name}'s"
    return (f"{', '.join(on)}: ZeRO++ is DeepSpeed ZeRO-3's, {which}; set strategy.name=zero3 "
            f"or remove {'the settings' if len(on) > 1 else 'the setting'}")


def batch_split(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Gradient accumulation steps that make `global_batch_size` sequences out of micro batches of
    `micro_batch_size` on `world_size` ranks or, when they do not divide it, a ConfigError naming the
    world sizes that would. The one split `zerodp train`, `zerodp plan --config` and `strategy: auto` use."""
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        ok = [w for w in range(1, 65) if global_batch_size % (micro_batch_size * w) == 0]
        where = f", or run on one of {ok[:8]} processes" if ok else " (no process count up to 64 divides it)"
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} is not divisible by "
            f"train.micro_batch_size={micro_batch_size} x world_size={world_size} = {per_step}; "
            f"change micro_batch_size or global_batch_size{where}"
        )
    return global_batch_size // per_step


def _positive(key: str, value, hint: str = "") -> None:
    if not value > 0:
        raise ConfigError(f"{key}={value} must be positive" + (f" ({hint})" if hint else ""))


def _non_negative(key: str, value, hint: str = "") -> None:
    if value < 0:
        raise ConfigError(f"{key}={value} must not be negative" + (f" ({hint})" if hint else ""))


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {' | '.join(allowed)}{hint}")


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------

_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in _SECTIONS}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _coerce(where: str, key: str, value: Any, typ: Any) -> Any:
    """Check `value` against the declared type `typ`; return it converted where lossless."""
    origin = typing.get_origin(typ)
    if origin is typing.Union and set(typing.get_args(typ)) == {int, str}:  # a count, or 'auto'
        if value == "auto":
            return value
        try:
            return _coerce(where, key, value, int)
        except ConfigError:
            raise ConfigError(f"{key} in {where} must be an integer or auto, got {value!r}") from None
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(typ) if a is not type(None)]
        return _coerce(where, key, value, inner)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} in {where} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:  # YAML reads 1e6 as a string; accept it when it is a whole number
                f = float(value)
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
        raise ConfigError(f"{key} in {where} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads 3e-4 (no dot) as a string
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} in {where} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} in {where} must be a string, got {value!r}")
    if typ is dict:
        if value is None:  # an empty YAML section (`deepspeed:`)
            return {}
        if isinstance(value, dict):
            return _numbers(value)
        raise ConfigError(f"{key} in {where} must be a mapping, got {value!r}")
    raise AssertionError(f"unhandled config type {typ}")


def _numbers(value: Any) -> Any:
    """Recursively turn number-like strings (YAML 1.1 reads 1e6 and 3e-4 as strings) into numbers in a
    free-form mapping. Only plain decimal forms: 'inf', 'nan' or '1_000' stay strings."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if not isinstance(value, str) or not _NUMBER.fullmatch(value):
        return value
    number = float(value)
    return int(number) if number.is_integer() and not ("." in value) else number


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _unknown(key: str, valid, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(valid)}"
    return ConfigError(f"unknown key {key!r} in {where}{hint}")


def from_dict(raw: dict, where: str = "config") -> Config:
    """Build a validated-type Config from nested dicts, rejecting unknown keys."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of sections (model:, train:, ...), got {type(raw).__name__}")
    sections = _section_types()
    built = {}
    for name, body in raw.items():
        if name not in sections:
            raise _unknown(str(name), sections, where)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f"section {name!r} in {where} must be a mapping of keys, got {body!r}")
        cls = sections[name]
        types = _field_types(cls)
        kwargs = {}
        for key, value in body.items():
            if key not in types:
                raise _unknown(f"{name}.{key}", [f"{name}.{k}" for k in types], where)
            kwargs[key] = _coerce(where, f"{name}.{key}", value, types[key])
        built[name] = cls(**kwargs)
    return Config(**built)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse `section.key=value` (value read as YAML, so 3e-4, true, null work)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. train.max_steps=50)")
    path, value = text.split("=", 1)
    section, key = path.split(".", 1)
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    return section, key, parsed


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or start from defaults when path is None), apply overrides, validate."""
    raw, where = _read(path, overrides)
    cfg = from_dict(raw, where)
    given = {k for k, v in (raw.get("model") or {}).items() if v is not None}
    if cfg.model.hf_config:
        apply_hf_config(cfg.model, given, where)
    elif "vocab_size" not in given:
        take_prepared_vocab(cfg)
    return resolve_model(cfg).validate()


def _read(path: str | os.PathLike | None, overrides: list[str]) -> tuple[dict, str]:
    """The sections the YAML at `path` holds with `overrides` applied, as nested dicts (nothing checked
    beyond the YAML and the overrides' form), and what errors call it: 'configs/tiny.yaml (with overrides)'."""
    raw: dict = {}
    where = "defaults"
    if path is not None:
        p = Path(path)
        where = str(p)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found; pass a path such as configs/tiny.yaml")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"{p} is not UTF-8 text; save the config as UTF-8 YAML") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or "invalid YAML"
            raise ConfigError(f"YAML syntax error in {p}{at}: {problem}; fix the file's indentation/quoting") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p} must be a mapping of sections (model:, train:, ...)")
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        body = raw.setdefault(section, {})
        if not isinstance(body, dict):
            body = raw[section] = {}
        if section == "strategy" and key.startswith("deepspeed."):
            _set_nested(body, key.split("."), value)
        else:
            body[key] = value
    return raw, where if not overrides else f"{where} (with overrides)"


def user_settings(path: str | os.PathLike | None, overrides: list[str] = ()) -> dict[str, Any]:
    """`section.key` -> value, typed as the schema reads it, for every key the YAML at `path` or an override
    sets (a strategy.deepspeed.* override as strategy.deepspeed), before anything is filled in: what the
    user wrote, as opposed to what load_config resolves (model.arch's defaults, model.hf_config)."""
    raw, where = _read(path, overrides)
    typed = from_dict(raw, where)
    return {f"{section}.{key}": getattr(getattr(typed, section), key)
            for section, body in raw.items() if isinstance(body, dict) for key in body}


def take_prepared_vocab(cfg: Config) -> Config:
    """model.vocab_size from meta.json when data.source is a `zerodp prepare` folder (the caller knows the
    config leaves the key unset), said on stderr by rank 0 (every rank loads the config). The resolved
    config, config.yaml and a checkpoint's meta.json then record the number, so a resume of the same
    command finds the same model. Returns cfg, changed in place."""
    if cfg.data.source == "builtin":
        return cfg
    from zerodp.config.sources import prepared_meta

    vocab = (prepared_meta(cfg.data.source) or {}).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        return cfg  # not a prepare folder, or a damaged meta.json that loading the data reports
    cfg.model.vocab_size = vocab
    if os.environ.get("RANK", "0") == "0":
        print(f"zerodp: model.vocab_size={vocab} taken from {Path(cfg.data.source) / 'meta.json'} (the tokenizer's "
              f"vocabulary; the config leaves model.vocab_size unset)", file=sys.stderr, flush=True)
    return cfg


def apply_hf_config(m: ModelConfig, given: set[str], where: str = "the config") -> ModelConfig:
    """Set arch and every dimension from the Hugging Face config.json `m.hf_config` names (before
    resolve_model). A key in `given` (set in the YAML or an override) must agree with the file, else a
    ConfigError names both values; a llama-family model's block_size is the exception: the length to
    train at, not a property of the weights (zerodp.models.hf.model_config_from_hf). Returns m."""
    from zerodp.models.hf import model_config_from_hf, read_hf_config

    try:
        raw, path = read_hf_config(m.hf_config)
        derived = model_config_from_hf(raw, str(path), m.block_size if "block_size" in given else None)
    except UserError as e:
        raise ConfigError(str(e)) from None
    for key, value in derived.items():
        if value is None:
            continue
        if key not in given:
            setattr(m, key, value)
        elif getattr(m, key) != value:
            raise ConfigError(f"model.{key}={getattr(m, key)!r} in {where} contradicts model.hf_config {path}, which "
                              f"gives {key}={value!r}; remove model.{key} or set it to {value!r}")
    return m


def resolve_model(cfg: Config) -> Config:
    """Fill the model keys left null with their architecture's defaults, so that the resolved config
    (config.yaml, a checkpoint's meta.json) records every dimension. Returns cfg, changed in place."""
    m = cfg.model
    _one_of("model.arch", m.arch, ARCHS)
    if m.bias is None:
        m.bias = m.arch == "gpt2"
    if m.tie_embeddings is None:
        m.tie_embeddings = m.arch == "gpt2"
    if m.n_kv_head is None:
        m.n_kv_head = m.n_head
    return cfg


def _set_nested(d: dict, keys: list[str], value: Any) -> None:
    """d[k0][k1]...[kn] = value for an override strategy.deepspeed.a.b=value, creating mappings."""
    for i, k in enumerate(keys[:-1]):
        if d.get(k) is None:
            d[k] = {}
        if not isinstance(d[k], dict):
            path = ".".join(["strategy", *keys[: i + 1]])
            raise ConfigError(f"{path} is {d[k]!r}, not a mapping, so strategy.{'.'.join(keys)} cannot be set "
                              f"inside it; remove one of the two settings")
        d = d[k]
    d[keys[-1]] = value


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def lr_scale(cfg: Config) -> float:
    o = cfg.optim
    return cfg.train.global_batch_size / o.base_batch_size if o.scale_lr_with_batch else 1.0


def lr_at(cfg: Config, step: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    o = cfg.optim
    scale = lr_scale(cfg)
    lr, min_lr = o.lr * scale, o.min_lr * scale
    if step < o.warmup_steps:
        return lr * (step + 1) / o.warmup_steps
    decay = o.decay_steps if o.decay_steps is not None else max(1, cfg.train.max_steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / decay)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


# ---------------------------------------------------------------------------------------------------
# Discoverability: `zerodp config` and `--dry-run`
# ---------------------------------------------------------------------------------------------------


@dataclass
class FieldDoc:
    key: str
    """`section.key`, as written in overrides."""
    type: str
    default: Any
    doc: str


def field_docs() -> list[FieldDoc]:
    """Every config key with its type, default and docstring, in declaration order.

    The docstrings are the string literals under each field in this file (read with `ast`, so they
    stay where a reader of the code sees them); a field whose doc continues the previous one's
    sentence (`...`) shares it."""
    import ast
    import inspect

    docs: dict[tuple[str, str], str] = {}
    tree = ast.parse(inspect.getsource(inspect.getmodule(Config)))
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs[(node.name, stmt.target.id)] = " ".join(nxt.value.value.split())
    out = []
    defaults = Config()
    for section, cls in _section_types().items():
        for name, typ in _field_types(cls).items():
            out.append(FieldDoc(f"{section}.{name}", _type_name(typ), getattr(getattr(defaults, section), name),
                                docs.get((cls.__name__, name), "")))
    return out


def _type_name(typ: Any) -> str:
    if typing.get_origin(typ) is typing.Union and set(typing.get_args(typ)) == {int, str}:
        return "int or auto"
    if typing.get_origin(typ) is typing.Union:
        (inner,) = [a for a in typing.get_args(typ) if a is not type(None)]
        return f"{_type_name(inner)} or null"
    return {dict: "mapping"}.get(typ, getattr(typ, "__name__", str(typ)))


def format_field_docs(section: str | None = None) -> str:
    """`zerodp config`'s text: keys grouped by section, each with type, default and what it does."""
    lines, current = [], None
    for f in field_docs():
        sec = f.key.split(".", 1)[0]
        if section is not None and sec != section:
            continue
        if sec != current:
            if current is not None:
                lines.append("")
            lines.append(f"{sec}:")
            current = sec
        default = yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"  {f.key} ({f.type}, default {default})")
        if f.doc:
            lines.append(f"      {f.doc}")
    return "\n".join(lines)


def set_and_resolved(given: dict[str, Any], cfg: Config) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """What `--dry-run` lists, each as (section.key, value) in the schema's order: the keys `given` (from
    user_settings) sets to something other than their default, with the value given; and the keys where
    `cfg`, the config to run, holds something the user did not set: neither the value given nor, for a key
    not given, the default (model.arch's defaults for keys left null, model.hf_config's dimensions, the
    planner's choices for strategy.name and train.micro_batch_size auto)."""
    defaults, mine, resolved = Config(), [], []
    for section in _SECTIONS:
        for f in dataclasses.fields(getattr(defaults, section)):
            key, default = f"{section}.{f.name}", getattr(getattr(defaults, section), f.name)
            wrote, value = given.get(key, default), getattr(getattr(cfg, section), f.name)
            if key in given and wrote != default:
                mine.append((key, wrote))
            if value != wrote:
                resolved.append((key, value))
    return mine, resolved
