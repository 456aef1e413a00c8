"""The planner's shared types, below every formula: what a model is (`ModelSpec`), what one step does
(`Workload`), one way to run it (`Layout`, its `Checkpointing` mode) and what the estimate of that way says
(`MemoryEstimate`). The formula modules (activations, lora, traffic, persistence) read these and the units
only; zerodp/planner/memory.py composes them into `estimate`. Data and their own small checks only: no
formula lives here, and nothing of the planner above zerodp.planner.units and hardware is imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from zerodp.models.arch import Arch
from zerodp.models.chunking import CHECKPOINTING
from zerodp.models.lora_spec import LoraSpec
from zerodp.planner.hardware import Cluster
from zerodp.strategies.catalog import StrategySpec, spec

ZERO3_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default stage3_param_persistence_threshold (elements)."""
ZERO3_KEEP_WINDOW = 1_000_000_000
"""max(stage3_max_reuse_distance, stage3_prefetch_bucket_size) at DeepSpeed's defaults (1e9, 5e7 elements)."""


class Checkpointing(str):
    """An activation checkpointing mode, one of zerodp.models.chunking.CHECKPOINTING, that is false when
    "off": `if row.activation_checkpointing` asks whether anything is recomputed, and the text says which
    mode. `Checkpointing(True)` is full, `Checkpointing(False)` off."""

    def __new__(cls, value: bool | str = "off"):
        if value is True or value is False:
            value = "full" if value else "off"
        assert value in CHECKPOINTING, value
        return super().__new__(cls, value)

    def __bool__(self) -> bool:
        return self != "off"

    @property
    def rank(self) -> int:
        """0 off, 1 selective, 2 full: the order of preference at equal speed."""
        return CHECKPOINTING.index(self)


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a decoder-only transformer."""

    name: str
    params: int
    """Every parameter memory holds, a tied embedding counted once, every expert included, a LoRA run's
    adapters included."""
    n_layer: int
    hidden: int
    n_head: int
    vocab_size: int
    ffn_hidden: int
    """Width of the MLP's inner layer one token passes through: 4*hidden for GPT-2, intermediate_size for
    Llama; a mixture of experts: experts_per_token x the expert's width (+ the shared expert's)."""
    kv_dim: int
    """Width of K (and of V): kv_heads * head_dim; equals hidden without grouped-query attention."""
    context: int
    """Longest sequence the model accepts (block_size, n_positions, max_position_embeddings)."""
    largest_unit_params: int
    """Biggest group of parameters ZeRO-3/FSDP gathers at once: one block, or the embeddings."""
    mlp: str = "gelu"
    """'gelu' (GPT-2: fc, GELU, proj) or 'swiglu' (Llama: gate, up, down; Gemma's GeGLU alike)."""
    dropout: bool = False
    """Dropout active in training: its 1-byte masks are kept for backward."""
    fused_attention: bool = True
    """SDPA/flash attention: the s x s score matrices are never stored. False for a model that trains with
    dropout: zerodp computes its attention explicitly (zerodp.models.dropout.KeyedDropout.attend) and keeps
    the (b, a, s, s) probabilities (`zerodp.planner.activations.explicit_attention_extra`)."""
    shape_assumed: bool = False
    """Layer dimensions were guessed from the parameter count alone."""
    active_params: Optional[int] = None
    """Parameters one token computes with (a mixture of experts: the experts it is routed to); step
    time uses it. None: `params`."""
    q_dim: Optional[int] = None
    """Width of Q and of the attention output: n_head * head_dim (Gemma's exceeds hidden). None: hidden."""
    norms_per_block: int = 2
    """Norms in one block whose inputs backward keeps (Gemma 2: four)."""
    qk_norm: bool = False
    """Qwen3: an RMSNorm over each head's q and k before attention (`qk_norm_extra`)."""
    arch: Optional[Arch] = field(default=None, repr=False, hash=False)
    """The description it was derived from (names and shapes); None for a --params guess."""
    largest_param: int = 0
    """Elements of the largest single parameter (the embedding, vocab x hidden, or a MoE layer's stacked
    experts): what loading a checkpoint holds in host memory at once. 0: `largest_unit_params`."""
    largest_block_params: int = 0
    """Elements of the largest transformer block. 0: `largest_unit_params`."""
    trainable_params: Optional[int] = None
    """Parameters that get gradients and optimizer states: a LoRA run's adapters (`zerodp.planner.lora`), the
    rest frozen. None: `params` (full fine-tuning)."""
    lora: Optional[LoraSpec] = None
    """The adapters' settings of a LoRA run (`zerodp.planner.lora.with_lora`); None: full fine-tuning."""

    def __post_init__(self):
        for name in ("largest_param", "largest_block_params"):  # unknown: the larger bound, never less
            if not getattr(self, name):
                object.__setattr__(self, name, self.largest_unit_params)
        if self.active_params is None:
            object.__setattr__(self, "active_params", self.params)
        if self.q_dim is None:
            object.__setattr__(self, "q_dim", self.hidden)
        if self.trainable_params is None:
            object.__setattr__(self, "trainable_params", self.params)

    @property
    def frozen_params(self) -> int:
        """Parameters without gradients or optimizer states: a LoRA run's base model; 0 in full fine-tuning."""
        return self.params - self.trainable_params


@dataclass(frozen=True)
class Workload:
    """What one step does on each GPU."""

    micro_batch: int = 1
    seq_len: int = 1024
    precision: str = "bf16"
    grad_accum_steps: int = 1
    bucket_mb: Optional[int] = None
    """strategy.bucket_size_mb: DDP buckets and DeepSpeed reduce/all-gather buckets; None: each engine's
    recommended size (zerodp.planner.buckets)."""
    fsdp_defer_grad_reduce: bool = False
    """strategy.fsdp_defer_grad_reduce: FSDP keeps unsharded fp32 gradients while accumulating."""
    fsdp_reshard_after_forward: bool = True
    """strategy.reshard_after_forward: FSDP frees a block's gathered parameters after its forward and
    all-gathers them again in backward."""
    zero3_persistence_threshold: int = ZERO3_PERSISTENCE_THRESHOLD
    """DeepSpeed's stage3_param_persistence_threshold: ZeRO-3 keeps parameters of at most this many
    elements gathered; they are all-gathered once per step, after the optimizer step."""
    zero3_keep_window: int = ZERO3_KEEP_WINDOW
    """ZeRO-3 keeps a parameter gathered after its forward when at most this many parameter elements are
    fetched before backward uses it again: the larger of DeepSpeed's stage3_max_reuse_distance and
    stage3_prefetch_bucket_size (a parameter the prefetcher finds still gathered is not released)."""
    grad_reduce_dtype: str = "fp32"
    """strategy.grad_reduce_dtype: what zero1-3 accumulate and reduce bf16 gradients in."""
    document_masking: bool = False
    """data.document_masking: one document mask per micro batch (`document_mask_bytes`)."""
    document_attention: str = "auto"
    """model.document_attention: the kernel the mask is for (auto: flex on CUDA without dropout, else sdpa)."""
    loss_chunks: int | str = "auto"
    """model.loss_chunks: the head and loss in chunks (zerodp.planner.activations.head_loss_bytes)."""
    objective: str = "sft"
    """train.objective: "dpo" takes whole preference pairs, so its micro batch is even (zerodp.planner.rows.search)."""
    dpo_reference: Optional[str] = None
    """train.objective=dpo's reference as dpo.reference resolves it (live, adapters-off, precomputed;
    zerodp.planner.preference); None: SFT, or dpo.loss=simpo (no reference)."""


@dataclass(frozen=True)
class Layout:
    """One way to run the job: a strategy and its options on a cluster."""

    strategy: str
    cluster: Cluster
    workload: Workload
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: Checkpointing | bool | str = Checkpointing("off")
    """off | selective | full (true: full, false: off); held as a `Checkpointing`, false when off."""
    hybrid: bool = False
    """Across nodes: fsdp shards within a node and replicates across nodes (HSDP, strategy.hybrid_shard);
    zero3 runs with ZeRO++ (hpZ secondary partition within the node, int8 weight all-gather, int4
    gradient reduction: strategy.hpz_partition_size, quantized_weights, quantized_gradients)."""
    hpz: bool = False
    """zero3 with only some of ZeRO++ (a training config's own settings): hpZ's secondary partition..."""
    qwz: bool = False
    """...the int8 weight all-gather..."""
    qgz: bool = False
    """...the int4 gradient reduction."""

    def __post_init__(self):
        object.__setattr__(self, "activation_checkpointing", Checkpointing(self.activation_checkpointing))

    @property
    def spec(self) -> StrategySpec:
        """The strategy's entry in the catalog."""
        return spec(self.strategy)

    @property
    def zeropp(self) -> tuple[bool, bool, bool]:
        """(hpZ, qwZ, qgZ) as this row runs them: all three for the zero3+zero++ row."""
        if not self.spec.zeropp:
            return False, False, False
        return self.hpz or self.hybrid, self.qwz or self.hybrid, self.qgz or self.hybrid

    @property
    def name(self) -> str:
        """The row name: 'zero2', 'zero3+offload_optimizer+offload_params', 'fsdp+offload', 'fsdp+hybrid',
        'zero3+zero++' (or 'zero3+hpz+qwz' for some of it)."""
        if self.hybrid and self.spec.hybrid_row:
            return self.spec.hybrid_row
        if any(self.zeropp):
            return "+".join([self.strategy] + [k for k, on in zip(("hpz", "qwz", "qgz"), self.zeropp) if on])
        if self.spec.offload_together and (self.offload_optimizer or self.offload_params):
            return f"{self.strategy}+offload"  # FSDP's CPUOffloadPolicy moves parameters, gradients and optimizer
        parts = [self.strategy]
        parts += ["offload_optimizer"] if self.offload_optimizer else []
        parts += ["offload_params"] if self.offload_params else []
        return "+".join(parts)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory and per-step time of one layout. Bytes are per GPU unless named otherwise."""

    name: str
    strategy: str
    offload_optimizer: bool
    offload_params: bool
    activation_checkpointing: Checkpointing
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    model_states_bytes: int
    """params + grads + optimizer states resident on the GPU: the ZeRO paper's figure (16P, 4P + 12P/N,
    2P + 14P/N, 16P/N), however the engine splits it between the three fields above."""
    frozen_bytes: int
    """Of params_bytes, the frozen base of a LoRA run (compute dtype, sharded under zero3/fsdp); 0 in full
    fine-tuning (zerodp.planner.lora)."""
    engine_master_bytes: int
    """DeepSpeed (zero1-3) in fp32: the separate fp32 master copy of this rank's shard (4P/N) that the
    optimizer steps and copies back, on top of the fp32 parameters; 0 otherwise."""
    unsharded_grads_bytes: int
    """FSDP with grad_accum_steps > 1: the full (unsharded) fp32 gradients it accumulates between micro
    batches, reduce-scattering only on the last (4P); 0 otherwise."""
    secondary_bytes: int
    """zero3+zero++: hpZ's secondary partition, this rank's 1/(GPUs per node) of the 16-bit parameters
    kept after the forward all-gather so that backward gathers within the node; 0 otherwise."""
    persistent_bytes: int
    """zero3: the parameters of at most stage3_param_persistence_threshold elements, kept whole on every rank
    beside their partitions (zerodp/planner/persistence.py); 0 otherwise."""
    gathered_bytes: int
    """ZeRO-3/FSDP: full parameters (and gradients) of the units being computed."""
    bucket_bytes: int
    activations_bytes: int
    overhead_bytes: int
    total_bytes: int
    hbm_bytes: int
    usable_bytes: int
    headroom_bytes: int
    """usable_bytes - total_bytes: negative exactly when training does not fit (the MARGIN kept free)."""
    offloaded_bytes: int
    """States this GPU's rank keeps in CPU memory."""
    cpu_bytes_per_node: int
    cpu_fits: Optional[bool]
    startup_bytes: int
    """Start-up peak on this GPU, from building the model to the first step (overhead included, as in
    total_bytes): what the engine materialises plus its transients (docs/memory_model.md, "Start-up")."""
    startup_host_bytes_per_node: int
    """Start-up peak in host RAM per node: a checkpoint tensor being loaded, DeepSpeed zero1/2 staging its
    16-bit groups, states offloaded from the start; on a CPU device, every rank's start-up peak."""
    startup_host_fits: Optional[bool]
    """startup_host_bytes_per_node within the cluster's cpu_ram_bytes; None when that is not known."""
    fits: bool
    """total_bytes and startup_bytes within usable_bytes, and the CPU side (offloaded states, start-up
    host peak) within cpu_ram_bytes where that is known."""
    comm_bytes: int
    """Bytes each GPU sends per optimizer step (ring collectives)."""
    inter_node_bytes: int
    """Bytes each node sends to the other nodes per optimizer step (0 on one node): what the slow link
    carries."""
    micro_batch: int
    grad_accum_steps: int
    exact: bool
    """The row computes the same gradients as one process (every row but zero3+zero++, whose int8
    weights and int4 gradients are approximations)."""
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    offload_s: float
    step_s: float
    scaling_efficiency: float
    """compute_s / step_s: the share of the step spent computing rather than waiting."""
    tokens_per_s_per_gpu: float
    reference_bytes: int = 0
    """train.objective=dpo with dpo.reference=live: what the frozen reference holds on this rank, within
    total_bytes (zerodp.planner.preference); 0 for adapters-off, precomputed and SFT."""
    reference_avoidable_bytes: int = 0
    """Of reference_bytes, what the engine builds for any model it sets up and a frozen one never uses
    (DeepSpeed's fp32 master partition and gradient buffers, the reducers' buckets)."""
    reference_unreached_bytes: int = 0
    """Of reference_bytes, ddp's reducer buckets: held, but by no tensor strategy.state_bytes() reaches."""
    reference_s: float = 0.0
    """Of compute_s, the reference's forward (live, adapters-off)."""
    expert_gather_bytes: int = 0
    """Of comm_bytes, what the all-gathers of a mixture of experts' expert weights send (zero3, fsdp: every
    expert of every sparse block, forward and backward, whatever the routing; zerodp.planner.moe); 0 for
    a dense model and for the strategies that keep parameters whole."""
    expert_gather_s: float = 0.0
    """Those all-gathers' seconds per step on the cluster's links (within comm_s)."""
    expert_gather_share: float = 0.0
    """expert_gather_bytes over all the parameter all-gathers' bytes: what expert parallelism would keep
    local."""

    def to_dict(self) -> dict:
        return asdict(self)
