"""The config's schema: its typed sections, every field documented where it is declared (the text
`zerodp config` prints, zerodp.config.docs), and `Config.validate()`, which checks the values that do
not depend on the world size (`check_batch_split()` the ones that do). Torch-free."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from zerodp.config.checks import batch_split
from zerodp.models.arch import FAMILIES
from zerodp.strategies.catalog import CATALOG

STRATEGIES = (*CATALOG, "auto")  # zerodp.strategies.catalog: the one list of strategies
ARCHS = FAMILIES  # model.arch: the families zerodp.models registers

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("cosine", "linear", "wsd")
"""optim.schedule's names; zerodp.optim.schedules holds a function for each."""
DECAY_SHAPES = ("linear", "1-sqrt")
DOCUMENT_ATTENTION = ("auto", "flex", "sdpa")
OBJECTIVES = ("sft", "dpo")
"""train.objective: the loss a step minimises (zerodp.trainer.objective)."""
DPO_LOSSES = ("sigmoid", "ipo", "simpo")
"""dpo.loss's names (zerodp.models.preference.LOSSES)."""
DPO_REFERENCES = ("live", "adapters-off", "precomputed")
"""dpo.reference's names."""
"""model.document_attention's kernels (zerodp.models.docmask)."""


@dataclass
class ModelConfig:
    arch: str = "gpt2"
    """gpt2 (learned positions, LayerNorm, GELU) or llama (Llama 2/3, Mistral, Qwen2: rotary positions,
    RMSNorm, SwiGLU, grouped-query attention) or qwen3 (llama with per-head q/k RMSNorm) or qwen3_moe (qwen3
    with mixture-of-experts MLPs: model.moe). See docs/models.md."""
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
    """Dropout probability (attention, residual, MLP), keyed by (seed, step, global row, position, feature):
    the same masks at every world size and strategy (zerodp.models.dropout)."""
    activation_checkpointing: typing.Union[bool, str] = "off"
    """off | selective | full (true: full, false: off): full recomputes each block's forward in the backward
    pass (it keeps only the block's input; one more forward of compute), selective keeps the matmul and
    attention outputs and recomputes the element-wise work between them (zerodp.models.recompute;
    docs/memory_model.md)."""
    loss_chunks: typing.Union[int, str] = "auto"
    """The LM head and its loss over this many chunks of the micro batch's tokens, each chunk's logits
    existing only while its loss and gradients are computed (zerodp.models.loss); 0: the whole logits at
    once; auto: chunks of at most 2^26 logits, whole when they are fewer or the micro batch has at most
    2 x n_embd tokens (zerodp.models.chunking). The same loss and gradients either way, to fp32 rounding."""
    document_attention: str = "auto"
    """The attention kernel under document masking (data.document_masking): flex (torch's flex attention
    with a block mask, nothing T x T; no dropout, no CPU backward), sdpa (SDPA with one (B, 1, T, T)
    additive mask per micro batch), or auto: flex on CUDA without dropout, else sdpa. See docs/models.md."""
    init_from: Optional[str] = None
    """Start from these weights (safetensors file, Hugging Face model folder or convertible checkpoint)
    instead of random init; checked against this model section before the run starts."""
    lora: dict = field(default_factory=dict)
    """Low-rank adapters (LoRA) instead of full fine-tuning: `{rank: 16, alpha: 32, dropout: 0.0, targets:
    [q_proj, v_proj], init_from: PEFT_FOLDER}` (only rank is required; alpha 2 x rank, targets all-linear).
    The base weights (model.init_from's) are frozen, held at train.precision; only the adapters are trained,
    reduced and checkpointed (zerodp.models.lora_spec, docs/fine_tuning.md). Empty: every weight trains."""
    moe: dict = field(default_factory=dict)
    """qwen3_moe: the mixture of experts, Hugging Face's names: `{num_experts: 8, num_experts_per_tok: 2,
    moe_intermediate_size: null (intermediate_size), norm_topk_prob: false, decoder_sparse_step: 1,
    mlp_only_layers: [], balance: sequence, router_aux_loss_coef: 0.001}` (each key optional; model.hf_config
    sets all but balance). balance: the tokens each balance loss is taken over, `sequence` (per sequence,
    averaged: the same at any micro batch size or world size) or `micro_batch` (transformers' loss, over each
    micro batch: changes with train.micro_batch_size); the training loss adds router_aux_loss_coef x the
    balance loss, logged apart as balance_loss (zerodp.models.moe_spec, docs/models.md)."""


@dataclass
class DataConfig:
    source: str = "builtin"
    """'builtin' (the Python standard library's source, byte-level), a text file, a folder of text
    files, a pre-tokenized token file (.bin, nanoGPT layout), or a `zerodp prepare` folder (train.bin,
    val.bin and meta.json: dtype, vocabulary and tokenizer come from meta.json; docs/data.md)."""
    sources: list = field(default_factory=list)
    """A mixture in place of data.source: `[{path: DIR, weight: w, name: N (optional)}, ...]`, prepare folders
    of one tokenizer blended by weight (docs/data.md); an override is YAML: 'data.sources=[{path: a, weight: 1}]'."""
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
    document_masking: bool = False
    """Attention stays within each document of a packed sample, and positions restart at 0 at each one
    (after every end-of-text token), so a packed sample trains as its documents alone would. The kernel
    is model.document_attention's; the planner counts the mask (docs/models.md, docs/memory_model.md)."""
    packing: bool = True
    """Pack documents end to end into samples of block_size + 1 tokens (with document_masking, none
    attends to another). false: one document per sample (a conversation of `zerodp prepare --chat`),
    cut at block_size + 1 tokens and padded, the padding never a target; needs a prepare folder with a
    document index (docs/fine_tuning.md)."""


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    schedule: str = "cosine"
    """cosine | linear | wsd: after the warmup, the lr falls to min_lr along half a cosine or a line over
    decay_steps; wsd (warmup-stable-decay) holds lr, then decays over the last decay_fraction of the steps."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over this many optimizer steps."""
    decay_steps: Optional[int] = None
    """Steps after warmup until the lr reaches min_lr (wsd: its stable phase and decay together); default:
    train.max_steps - warmup_steps. Set it when a run is trained in parts with different max_steps."""
    decay_fraction: float = 0.2
    """wsd: the fraction of the schedule's warmup_steps + decay_steps steps that its decay takes, at the end."""
    decay_shape: str = "linear"
    """wsd: the decay's shape, linear or 1-sqrt (lr falls with the square root of the decay's progress)."""
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
    objective: str = "sft"
    """sft: the mean cross-entropy of the targets (every token, or a loss mask's); dpo: a preference loss on
    the pairs of a `zerodp prepare --preference` folder, set in the dpo section (docs/fine_tuning.md,
    "Preference tuning")."""
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
    """Show a live progress bar on rank 0's terminal; false, or stderr not a terminal (a log file), prints one
    line every log_every steps instead."""
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
    check_replicas_every: int = 100
    """Compare the state every rank holds the same copy of (ddp's weights and AdamW moments, zero1/zero2's
    working weights, the data order) across the ranks every this many steps, at a sync point, and before
    every checkpoint: a rank whose hash differs is named and the run stops before saving (exit 1;
    docs/operations.md). 0: off. zero3/fsdp hold no shard twice: each parameter as the forwards gathered it
    is compared (not under train.compile); HSDP compares each shard across its replica groups."""


@dataclass
class StrategyConfig:
    name: str = "auto"
    """single | ddp | zero1 | zero2 | zero3 | fsdp | auto."""
    bucket_size_mb: Optional[int] = None
    """Gradient bucket size for DDP and the DeepSpeed reduce/allgather buckets, in MiB; null: each engine's
    recommended size (DDP 25 MiB; zero1/2 5e8 elements, at most the model; zero3 hidden^2, docs/strategies.md)."""
    grad_reduce_dtype: str = "fp32"
    """bf16 runs of zero1-3: fp32 accumulates and reduces the gradients in fp32, as ddp and fsdp always do; bf16
    halves that traffic and buffer at some accuracy (DeepSpeed's default). docs/strategies.md, "Precision"."""
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
    enabled: bool = True
    """false: the run writes no checkpoint at all, not even at the end (benchmarks, smoke tests), and says
    so in its first lines; a SIGTERM/SIGUSR1/Ctrl-C then stops it after the step without saving. Refused
    with what would need one: checkpoint.async_save, train.preempt_grace_s set (a preemption save asked
    for) or torchrun restarts (--max-restarts)."""
    every: int = 50
    """Save every this many optimizer steps (and always at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Intact checkpoints kept on disk; older ones are deleted after a newer one is complete. A damaged
    checkpoint does not count: it is set aside (renamed `*.damaged`), never deleted."""
    resume: bool = True
    """Resume from the newest checkpoint in out_dir when one exists (`--fresh` sets false)."""
    async_save: bool = False
    """Save in the background: each rank copies what a save writes into host memory (one copy of its
    checkpoint, reused from save to save) and training continues while a thread writes and hashes it;
    `latest` moves only once every rank's files are complete. The end-of-run and preemption saves go
    through the same writer and are waited for. Off by default: the host copy is held for the whole
    run (`zerodp plan --async-save` shows it per node), and the writer competes with training for the
    host's cores: measured on CPU ranks, the stall it saves returns as slower steps (docs/checkpoints.md,
    "Background saves")."""


@dataclass
class DpoConfig:
    """train.objective=dpo's settings (zerodp.models.preference holds the formulas)."""

    beta: float = 0.1
    """The strength of the pull toward the reference (sigmoid, ipo) or the reward scale (simpo); > 0. Smaller
    lets the policy move further from the reference: 0.1 is DPO's usual, 0.01 to 0.5 its range; simpo takes
    2 to 10."""
    loss: str = "sigmoid"
    """sigmoid (DPO, summed completion log-probs), ipo (per-token means, squared) or simpo (per-token means,
    reference-free, with simpo_gamma)."""
    label_smoothing: float = 0.0
    """sigmoid and simpo: the share of pairs assumed mislabelled, in [0, 0.5) (conservative DPO):
    -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d). ipo takes none."""
    simpo_gamma: Optional[float] = None
    """simpo: the target reward margin gamma (d = mean logp chosen - mean logp rejected - gamma / beta); null:
    0.5, TRL's default. Set only with loss=simpo."""
    rpo_alpha: float = 0.0
    """The weight of an NLL term on the chosen completions (RPO): alpha times the mean negative log-prob of the
    global batch's chosen completion tokens is added to the loss; 0: none."""
    reference: Optional[str] = None
    """The model the policy's log-ratios are taken against: live (a frozen copy of the starting weights, held
    under the run's strategy, sharded as the policy under zero3/fsdp, never updated or saved; not with
    strategy.name=auto); adapters-off (model.lora: the base with the adapters switched off, no copy);
    precomputed (one pass at step 0 writes every pair's reference log-probs beside the data, keyed by the
    reference's and the data's sha256; training then holds no reference). null: adapters-off with
    model.lora, else live; none for simpo, which takes no reference."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "Config":
        """Check every value that does not depend on the world size (zerodp.config.validation); return self."""
        from zerodp.config.validation import validate

        validate(self)
        return self

    def check_batch_split(self, world_size: int) -> int:
        """Return gradient accumulation steps for this world size, or explain why the split fails.
        train.micro_batch_size=auto must be resolved first (zerodp.trainer.loop.resolve_strategy)."""
        assert self.train.micro_batch_size != "auto", "resolve train.micro_batch_size=auto before splitting"
        return batch_split(self.train.global_batch_size, self.train.micro_batch_size, world_size)



_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in _SECTIONS}


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)
