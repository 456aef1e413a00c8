"""Config.validate()'s checks, one function per section: every value that does not depend on the world
size (Config.check_batch_split() checks the ones that do). A new key's check goes in its section's function.
Torch-free."""

from __future__ import annotations

from zerodp.config.checks import _divisor_near, _non_negative, _one_of, _positive, zeropp_refusal
from zerodp.config.schema import (
    ARCHS,
    DECAY_SHAPES,
    DOCUMENT_ATTENTION,
    DPO_LOSSES,
    DPO_REFERENCES,
    OBJECTIVES,
    PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    StrategyConfig,
    TrainConfig,
)
from zerodp.config.sources import check_sources, check_unpacked
from zerodp.errors import ConfigError
from zerodp.models.arch import arch_of, spec_of
from zerodp.models.chunking import CHECKPOINTING, checkpointing_mode
from zerodp.models.lora_spec import check_targets, lora_spec
from zerodp.models.moe_spec import moe_spec


def validate(cfg: Config) -> None:
    """Check every section of `cfg`; raise ConfigError naming the first bad key."""
    check_model(cfg.model)
    check_data(cfg.data)
    check_optim(cfg.optim)
    check_train(cfg.train)
    check_strategy(cfg.strategy)
    check_checkpoint(cfg.checkpoint)
    check_no_checkpoint(cfg)
    check_objective(cfg)


def check_model(m: ModelConfig) -> None:
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
    _one_of("model.document_attention", m.document_attention, DOCUMENT_ATTENTION)
    if getattr(spec_of(m.arch), "MOE", False):
        moe_spec(m.moe)
    elif m.moe:
        raise ConfigError(f"model.moe applies to a mixture of experts (model.arch=qwen3_moe), not {m.arch}; "
                          f"remove model.moe or set model.arch=qwen3_moe")
    spec = lora_spec(m.lora)
    if spec is not None:
        check_targets(arch_of(m), spec)
    try:  # one spelling from here on: true and false are full and off
        m.activation_checkpointing = checkpointing_mode(m.activation_checkpointing)
    except ValueError:
        _one_of("model.activation_checkpointing", m.activation_checkpointing, CHECKPOINTING)
    if m.loss_chunks != "auto" and m.loss_chunks < 0:
        raise ConfigError(f"model.loss_chunks={m.loss_chunks} must be 0 (the whole logits), a number of chunks "
                          f"or auto")
    if m.document_attention == "flex" and m.dropout:
        raise ConfigError(f"model.document_attention=flex has no attention dropout (model.dropout={m.dropout}); "
                          f"set model.document_attention=sdpa or model.dropout=0")


def check_data(d: DataConfig) -> None:
    if d.token_dtype not in ("uint16", "uint32"):
        raise ConfigError(f"data.token_dtype={d.token_dtype!r} must be 'uint16' or 'uint32'")
    if not 0.0 < d.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in (0, 0.5)")
    _positive("data.max_bytes", d.max_bytes)
    check_sources(d)
    _non_negative("data.prefetch", d.prefetch)
    if not d.packing:
        check_unpacked(d)


def check_optim(o: OptimConfig) -> None:
    _positive("optim.lr", o.lr, hint="a learning rate such as 3e-4")
    _non_negative("optim.min_lr", o.min_lr)
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}; set min_lr <= lr")
    _non_negative("optim.warmup_steps", o.warmup_steps)
    if o.decay_steps is not None:
        _positive("optim.decay_steps", o.decay_steps)
    _one_of("optim.schedule", o.schedule, SCHEDULES)
    _one_of("optim.decay_shape", o.decay_shape, DECAY_SHAPES)
    if not 0.0 < o.decay_fraction <= 1.0:
        raise ConfigError(f"optim.decay_fraction={o.decay_fraction} must be in (0, 1] (0.2 decays over the "
                          f"last fifth of the steps)")
    for key in ("decay_fraction", "decay_shape"):
        if o.schedule != "wsd" and getattr(o, key) != getattr(OptimConfig, key):
            raise ConfigError(f"optim.{key}={getattr(o, key)!r} applies to optim.schedule=wsd, not "
                              f"{o.schedule} (remove the key or set optim.schedule=wsd)")
    _non_negative("optim.weight_decay", o.weight_decay)
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optim.{key}={getattr(o, key)} must be in [0, 1)")
    _positive("optim.eps", o.eps)
    _non_negative("optim.grad_clip", o.grad_clip, hint="0 disables clipping")
    _positive("optim.base_batch_size", o.base_batch_size)


def check_train(t: TrainConfig) -> None:
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
    _non_negative("train.check_replicas_every", t.check_replicas_every)
    if not 0.0 <= t.grad_noise_ema < 1.0:
        raise ConfigError(f"train.grad_noise_ema={t.grad_noise_ema} must be in [0, 1) (0.99 averages about "
                          f"the last 100 steps)")
    if not t.out_dir:
        raise ConfigError("train.out_dir is empty; set it to the run directory, e.g. runs/my_run")


def check_strategy(s: StrategyConfig) -> None:
    _one_of("strategy.name", s.name, STRATEGIES)
    if s.bucket_size_mb is not None:
        _positive("strategy.bucket_size_mb", s.bucket_size_mb)
    _one_of("strategy.grad_reduce_dtype", s.grad_reduce_dtype, ("fp32", "bf16"))
    _positive("strategy.timeout_s", s.timeout_s)
    _non_negative("strategy.shard_group_size", s.shard_group_size)
    _non_negative("strategy.hpz_partition_size", s.hpz_partition_size,
                  hint="1 turns hpZ off, 0 takes the ranks of one node")
    if refusal := zeropp_refusal(s, s.name):
        raise ConfigError(refusal)


def check_no_checkpoint(cfg: Config) -> None:
    """checkpoint.enabled=false with a setting that asks for a checkpoint: the run would lose what the
    user expects saved, so it is refused (the torchrun restarts are checked at launch: preflight)."""
    if cfg.checkpoint.enabled:
        return
    if cfg.checkpoint.async_save:
        raise ConfigError("checkpoint.enabled=false writes no checkpoint, but checkpoint.async_save=true asks for "
                          "background saves; remove one of the two")
    if cfg.train.preempt_grace_s != TrainConfig.preempt_grace_s:
        raise ConfigError(f"checkpoint.enabled=false writes no checkpoint, but train.preempt_grace_s="
                          f"{cfg.train.preempt_grace_s:g} asks for a save on preemption; remove one of the two")


def check_checkpoint(c: CheckpointConfig) -> None:
    _non_negative("checkpoint.every", c.every)
    _positive("checkpoint.keep_last", c.keep_last)


def check_objective(cfg: Config) -> None:
    """train.objective and the dpo section; the data a DPO run (or an SFT run) reads."""
    from zerodp.config.sources import prepared_meta, source_entries

    t, d = cfg.train, cfg.dpo
    _one_of("train.objective", t.objective, OBJECTIVES)
    paths = [p for _, p, _ in source_entries(cfg.data)] or [cfg.data.source]
    preference = [p for p in paths if "preference" in (prepared_meta(p) or {})]
    if t.objective != "dpo":
        if preference:
            raise ConfigError(f"{preference[0]} holds preference pairs (zerodp prepare --preference): train them with "
                              f"train.objective=dpo, or give an SFT folder (zerodp prepare --chat)")
        return
    if not d.beta > 0:
        raise ConfigError(f"dpo.beta={d.beta} must be > 0 (0.1 is DPO's usual; smaller moves further from the "
                          f"reference)")
    _one_of("dpo.loss", d.loss, DPO_LOSSES)
    if not 0.0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={d.label_smoothing} must be in [0, 0.5): the share of pairs "
                          f"assumed mislabelled")
    if d.label_smoothing and d.loss == "ipo":
        raise ConfigError("dpo.label_smoothing applies to dpo.loss=sigmoid or simpo; ipo takes none (set it to 0)")
    if d.simpo_gamma is not None and d.loss != "simpo":
        raise ConfigError(f"dpo.simpo_gamma={d.simpo_gamma} applies to dpo.loss=simpo; remove it, or set "
                          f"dpo.loss=simpo")
    if d.simpo_gamma is not None and d.simpo_gamma < 0:
        raise ConfigError(f"dpo.simpo_gamma={d.simpo_gamma} must be >= 0 (the target reward margin)")
    _non_negative("dpo.rpo_alpha", d.rpo_alpha)
    check_reference(cfg)
    if len(paths) > 1:
        raise ConfigError("train.objective=dpo reads one preference folder; a mixture would part a pair's two "
                          "sequences (give data.source one zerodp prepare --preference folder)")
    if not preference:
        raise ConfigError(f"train.objective=dpo trains on preference pairs, and {paths[0]} holds none; run zerodp "
                          f"prepare PAIRS.jsonl --preference and point data.source at its folder")
    if cfg.data.packing:
        raise ConfigError("train.objective=dpo takes one sequence a row (a pair is two rows): set data.packing=false")
    for key, n in (("train.global_batch_size", t.global_batch_size), ("train.micro_batch_size", t.micro_batch_size)):
        if n == "auto":
            raise ConfigError(f"{key}=auto is not planned for train.objective=dpo yet; give an even number")
        if n % 2:
            raise ConfigError(f"{key}={n} would split a preference pair (its chosen and rejected sequences are two "
                              f"adjacent rows); give an even number")


def dpo_reference(cfg: Config) -> str | None:
    """The reference dpo.reference resolves to: None for simpo, else the value given, else adapters-off with
    model.lora and live without."""
    d = cfg.dpo
    if d.loss == "simpo":
        return None
    return d.reference or ("adapters-off" if cfg.model.lora else "live")


def check_reference(cfg: Config) -> None:
    """dpo.reference: what exists, under the strategies it exists for."""
    from zerodp.strategies.catalog import CATALOG

    d, given = cfg.dpo, cfg.dpo.reference
    if given is not None:
        _one_of("dpo.reference", given, DPO_REFERENCES)
        if d.loss == "simpo":
            raise ConfigError(f"dpo.reference={given} is for sigmoid and ipo; simpo takes no reference (remove "
                              f"dpo.reference)")
    d = type(d)(**{**vars(d), "reference": dpo_reference(cfg)})  # the checks below apply to the one resolved
    if d.reference is None:
        return
    if d.reference == "adapters-off" and not cfg.model.lora:
        raise ConfigError("dpo.reference=adapters-off switches model.lora's adapters off; without model.lora use "
                          "dpo.reference=live")
    if d.reference == "live" and cfg.model.lora:
        raise ConfigError("dpo.reference=live holds a second copy of the model; with model.lora the base with the "
                          "adapters off is the reference at no cost: use dpo.reference=adapters-off (or leave it "
                          "unset)")
    if d.reference == "live" and cfg.strategy.name == "auto":
        raise ConfigError(f"dpo.reference=live holds a frozen copy of the model the planner does not price yet, so "
                          f"strategy.name=auto cannot choose for it; name the strategy (one of "
                          f"{', '.join(CATALOG)})")
