"""How a Plan is shown: the table `zerodp plan` prints and the JSON object of `--json`.

The JSON field names are a stable interface, documented in docs/memory_model.md.
"""

from __future__ import annotations

from zerodp.planner.activations import loss_line, loss_setting
from zerodp.planner.lora import comparison_lines, describe
from zerodp.planner.memory import MARGIN
from zerodp.planner.moe import gather_lines
from zerodp.planner.preference import REFERENCE_WORDS, comparison_lines as dpo_comparison_lines
from zerodp.planner.units import aligned, gb, human_count, seconds

SCHEMA_VERSION = 2

_COLUMNS = ("strategy", "micro", "accum", "ckpt", "frozen", "params", "grads", "optim", "extra", "buffers", "refer",
            "activ", "overhd", "total", "startup", "fits", "headroom", "comm/step", "inter/node", "step", "tok/s/gpu",
            "effic", "cpu/node")
"""Column names; on CPU ranks 'tok/s/gpu' reads 'tok/s/rank' (`_column_names`); 'frozen' (a LoRA run's base
weights, 'params' then the adapters') only under LoRA, 'refer' (DPO's live reference) only with
--objective dpo, 'inter/node' only across nodes."""


_SEARCH_FIELDS = ("micro_batch", "grad_accum_steps", "activation_checkpointing", "fits", "total_bytes", "step_s",
                  "tokens_per_s_per_gpu")


CKPT_COLUMN = {"off": "off", "selective": "sel", "full": "full"}
"""The table's `ckpt` column: each activation checkpointing mode in at most four letters."""


def _header(plan) -> list[str]:
    m, c, w = plan.model, plan.cluster, plan.workload
    shape = f"{m.n_layer} layers, hidden {m.hidden}, {m.n_head} heads, vocab {m.vocab_size}"
    nodes = f"{c.nodes} nodes x {c.gpus_per_node}" if c.nodes > 1 else f"1 node x {c.gpus_per_node}"
    ckpt = "planner's choice" if plan.requested_checkpointing is None else plan.requested_checkpointing
    active = f", {human_count(m.active_params)} active per token" if m.active_params != m.params else ""
    lora = [f"adapters: {describe(m)}; params, grads, optim: the adapters'; frozen: the base weights in "
            f"{plan.workload.precision} (sharded under zero3 and fsdp)"] if m.lora is not None else []
    w = plan.workload
    dpo = [f"objective: dpo (preference pairs, micro batches of whole pairs), dpo.reference={w.dpo_reference}: "
           f"{REFERENCE_WORDS[w.dpo_reference]}" if w.dpo_reference else
           "objective: dpo, dpo.loss=simpo: no reference"] if w.objective == "dpo" else []
    return [
        f"zerodp plan: {m.name}, {human_count(m.params)} parameters ({m.params:,}{active}; {shape})",
        *lora, *dpo,
        f"cluster: {c.world_size} x {c.gpu.name} {gb(c.gpu.hbm_bytes)} ({nodes}), {c.link}, "
        f"MFU {c.mfu:.0%}" + (f", CPU RAM {gb(c.cpu_ram_bytes)}/node" if c.cpu_ram_bytes else ""),
        (f"step: global batch {plan.global_batch} sequences x {w.seq_len} tokens, micro batch searched among the "
         f"divisors of {plan.global_batch // c.world_size} per {c.device}, " if plan.global_batch else
         f"step: micro batch {w.micro_batch} x {w.seq_len} tokens x {w.grad_accum_steps} accumulation, ")
        + f"{w.precision}, activation checkpointing: {ckpt}, loss: {_loss(plan)}",
        f"memory per {c.device} in GB (1e9 bytes); fits = total and startup (start-up peak) within {1 - MARGIN:.0%} "
        f"of {gb(c.gpu.hbm_bytes)}" + (f", start-up host RAM within {gb(c.cpu_ram_bytes)} per node"
                                       if c.cpu_ram_bytes else ""),
    ] + (["async/node: checkpoint.async_save's host copy of each rank's checkpoint on the node of rank 0, held "
          "from the first save to the end of the run"] if plan.async_save else [])


def _loss(plan) -> str:
    """How the head and loss run (zerodp.planner.activations.loss_line), at each micro batch the rows use."""
    m, w = plan.model, plan.workload
    micro = sorted({e.micro_batch for e in plan.estimates} or {w.micro_batch})
    lines = {b: loss_line(w.loss_chunks, b * w.seq_len, m.vocab_size, m.hidden) for b in micro}
    if len(set(lines.values())) == 1:
        return lines[micro[0]] + loss_setting(w.loss_chunks)
    return "; ".join(f"{text} at micro batch {b}" for b, text in lines.items()) + loss_setting(w.loss_chunks)


def _cells(e) -> list[str]:
    """One row. 'extra' is what an engine holds beyond the paper's model states (DeepSpeed's fp32 master
    copy in fp32, FSDP's unsharded gradients while accumulating, hpZ's secondary partition, ZeRO-3's
    persistent parameters); 'buffers' gathered layers and buckets; 'refer' what DPO's live reference holds;
    'startup' the peak from building the model to the first step (the host side is in the JSON); 'inter/node'
    what each node sends to the others per step."""
    g = lambda b: f"{b / 1e9:.1f}"  # noqa: E731
    return [
        e.name, str(e.micro_batch), str(e.grad_accum_steps), CKPT_COLUMN.get(e.activation_checkpointing, "off"),
        g(e.frozen_bytes), g(e.params_bytes - e.frozen_bytes), g(e.grads_bytes),
        g(e.optimizer_bytes), g(e.engine_master_bytes + e.unsharded_grads_bytes + e.secondary_bytes
                                 + e.persistent_bytes),
        g(e.gathered_bytes + e.bucket_bytes), g(e.reference_bytes), g(e.activations_bytes),
        g(e.overhead_bytes), g(e.total_bytes), g(e.startup_bytes), "yes" if e.fits else "NO", g(e.headroom_bytes),
        g(e.comm_bytes), g(e.inter_node_bytes) if e.inter_node_bytes else "-", seconds(e.step_s),
        f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.scaling_efficiency:.0%}",
        g(e.cpu_bytes_per_node) if e.offloaded_bytes else "-",
    ]


def _column_names(plan) -> list[str]:
    per = "gpu" if plan.cluster.gpu.cuda else "rank"
    names = [f"tok/s/{per}" if name == "tok/s/gpu" else name for name in _COLUMNS]
    return names + ["async/node"] if plan.async_save else names


def _drop(rows: list[list[str]], column: str) -> list[list[str]]:
    i = rows[0].index(column)
    return [r[:i] + r[i + 1:] for r in rows]


def render_table(plan) -> str:
    """The header, one row per strategy, then the choice and one sentence per rejected option."""
    # checkpoint.async_save: the snapshot's host memory per node, beside the offloaded states'
    rows = [_column_names(plan)] + [_cells(e) + ([f"{plan.snapshot_bytes_per_node(e) / 1e9:.1f}"]
                                                 if plan.async_save else []) for e in plan.estimates]
    if plan.cluster.nodes == 1:  # nothing crosses nodes
        rows = _drop(rows, "inter/node")
    if plan.model.lora is None:  # full fine-tuning: nothing is frozen
        rows = _drop(rows, "frozen")
    if plan.workload.objective != "dpo":  # no reference
        rows = _drop(rows, "refer")
    lines = _header(plan) + [""] + aligned(rows)
    lines.append("")
    if plan.full_fine_tuning is not None:
        lines += comparison_lines(plan.estimates, plan.full_fine_tuning) + [""]
    if plan.sft is not None:
        lines += dpo_comparison_lines(plan.estimates, plan.sft, plan.workload.dpo_reference) + [""]
    experts = gather_lines(plan.model, plan.estimates, plan.workload.precision)
    lines += experts + ([""] if experts else [])
    lines += plan.reasons
    lines += [f"note: {a}" for a in plan.assumptions]
    return "\n".join(lines)


def plan_dict(plan) -> dict:
    """The plan as plain JSON types, field names as documented in docs/memory_model.md."""
    m, c, w = plan.model, plan.cluster, plan.workload
    return {
        "schema_version": SCHEMA_VERSION,
        "model": m.name,
        "params": m.params,
        "active_params": m.active_params,
        "trainable_params": m.trainable_params,
        "lora": m.lora.to_dict() if m.lora is not None else None,
        "shape": {"n_layer": m.n_layer, "hidden": m.hidden, "n_head": m.n_head, "vocab_size": m.vocab_size,
                  "ffn_hidden": m.ffn_hidden, "kv_dim": m.kv_dim, "context": m.context, "assumed": m.shape_assumed},
        "cluster": {"gpu": c.gpu.name, "hbm_bytes": c.gpu.hbm_bytes, "gpus_per_node": c.gpus_per_node,
                    "nodes": c.nodes, "world_size": c.world_size, "interconnect": c.link,
                    "ring_bandwidth_bytes_per_s": c.ring_bandwidth, "intra_node_bandwidth_bytes_per_s":
                    c.intra_bandwidth, "inter_node_bandwidth_bytes_per_s": c.inter_bandwidth if c.nodes > 1 else None,
                    "cpu_ram_bytes": c.cpu_ram_bytes, "mfu": c.mfu},
        "workload": {"micro_batch": w.micro_batch, "seq_len": w.seq_len, "precision": w.precision,
                     "grad_accum_steps": w.grad_accum_steps, "bucket_mb": w.bucket_mb, "loss_chunks": w.loss_chunks},
        "margin": MARGIN,
        "activation_checkpointing_requested": plan.requested_checkpointing,
        "choice": plan.choice_name,
        "strategy": plan.choice,
        "offload_optimizer": plan.offload_optimizer,
        "offload_params": plan.offload_params,
        "activation_checkpointing": plan.activation_checkpointing,
        "hybrid": plan.hybrid,
        "micro_batch": plan.micro_batch,
        "global_batch": plan.global_batch,
        "search": {name: [{k: getattr(e, k) for k in _SEARCH_FIELDS} for e in tried]
                   for name, tried in plan.search.items()},
        "reasons": list(plan.reasons),
        "suggestion": plan.suggestion,
        "assumptions": list(plan.assumptions),
        "async_save": plan.async_save,
        "strategies": [dict(e.to_dict(), async_save_host_bytes_per_node=plan.snapshot_bytes_per_node(e))
                       for e in plan.estimates],
        "full_fine_tuning": None if plan.full_fine_tuning is None else [e.to_dict() for e in plan.full_fine_tuning],
        "objective": w.objective,
        "dpo_reference": w.dpo_reference,
        "sft": None if plan.sft is None else [e.to_dict() for e in plan.sft],
    }
