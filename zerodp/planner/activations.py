"""What one micro batch keeps on the device beyond the model states, as zerodp's modules run it
(`activation_bytes`): the blocks' activations (Korthikanti's count, `layer_activation_factor`, and what
zerodp's modules keep beyond it) under each checkpointing mode (off, selective, full), the LM head's
logits and loss (whole or in chunks: model.loss_chunks), the 16-bit weight copies autocast makes, and the
document mask. Torch-free
arithmetic; the formulas, and the measurement they are calibrated on, are in docs/memory_model.md
("Activations", "Logits and loss")."""

from __future__ import annotations

from zerodp.models.chunking import loss_chunks
from zerodp.planner.lora import adapter_activation_bytes
from zerodp.planner.moe import routed_bytes_per_token, sparse_layers
from zerodp.planner.types import Checkpointing, ModelSpec, Workload
from zerodp.planner.units import COMPUTE_BYTES

SELECTIVE_RECOMPUTE = 0.1
"""Share of the forward's time outside the matmuls and attention (norms, rotary, activation, residual adds,
casts): what selective checkpointing runs again in the backward. An estimate (element-wise kernels are
memory-bound; profiles of Llama-sized blocks put them near a tenth of the forward), not a measurement."""


def compute_factor(mode: str) -> float:
    """Training compute relative to no checkpointing (forward 1, backward 2): full runs the forward again
    (4/3), selective its element-wise share (SELECTIVE_RECOMPUTE of the forward)."""
    return {"off": 1.0, "selective": 1 + SELECTIVE_RECOMPUTE / 3, "full": 4 / 3}[mode]


def explicit_attention_extra(m: ModelSpec, seq_len: int, precision: str) -> float:
    """Bytes per s*b*h (16-bit units, as `layer_activation_factor`) that zerodp's explicit attention keeps
    beyond Korthikanti's unfused count (zerodp.models.dropout.KeyedDropout.attend, the path of every model
    that trains with dropout): per element of the (b, a, s, s) probabilities the fp32 softmax output (4
    bytes), the bool keep mask (1) and the dropped probabilities in the compute dtype (what `@ v` keeps),
    where the paper counts 5 in 16-bit units; and K and V repeated to every query head (grouped-query
    attention), kept by the two matmuls at Q's width. Measured on CPU (tests/unit/test_planner.py,
    test_explicit_attention_keeps_what_the_planner_counts). 0 for SDPA/flash attention."""
    if m.fused_attention:
        return 0.0
    half = {"fp32": 2.0}.get(precision, 1.0)  # bytes of the compute dtype / 2
    probs = 4 + (1 if m.dropout else 0) + 2 * half  # fp32 softmax, keep mask, the probabilities @ v keeps
    scores = (probs / half - (5 if m.dropout else 2)) * m.n_head * seq_len / m.hidden
    return scores + 4 * (m.q_dim - m.kv_dim) / m.hidden


def qk_norm_extra(m: ModelSpec, precision: str) -> float:
    """Bytes per s*b*h (16-bit units, as `layer_activation_factor`) that Qwen3's per-head q and k RMSNorms
    keep: per element of q and k their fp32 input and normalised output (8 bytes; in 16 bits, autocast or
    a 16-bit module, the fp32 copy and the 16-bit result, 6), and one fp32 reciprocal root per token and
    head. Measured on CPU
    (tests/unit/test_planner.py, test_qk_norms_keep_what_the_planner_counts). 0 without them."""
    if not m.qk_norm:
        return 0.0
    half = {"fp32": 2.0}.get(precision, 1.0)  # bytes of the compute dtype / 2
    per_element = 8 if precision == "fp32" else 6
    heads = m.n_head * (1 + m.kv_dim / m.q_dim)  # q heads and kv heads: kv_dim / head_dim
    return ((m.q_dim + m.kv_dim) * per_element + 4 * heads) / m.hidden / half


def precision_extra(m: ModelSpec, precision: str, autocast: bool) -> float:
    """Bytes per s*b*h (in 16-bit units, as `layer_activation_factor`) that zerodp's blocks keep beyond
    Korthikanti's count: the attention output SDPA keeps beside the output projection's (contiguous) input;
    and the norms. A llama-style RMSNorm (computed in fp32) keeps its fp32 input and output: under autocast,
    whose residual stream is fp32 (fp32 parameters, 16-bit matmuls), 8 bytes, and each projection then
    casts its fp32 input to 16 bits itself (q, k, v: two more copies; gate, up: one); over a 16-bit module
    6 bytes (the fp32 copy and the 16-bit result); in fp32 8 (= 4 in 16-bit units). LayerNorm keeps its
    input only: 4 bytes under autocast (the fp32 residual stream), else as counted."""
    sdpa_out = 2 * m.q_dim / m.hidden if m.fused_attention else 0  # unfused: the out-proj input is all
    if m.mlp == "swiglu":  # RMSNorm in fp32; separate q, k, v and gate, up projections
        if precision == "fp32":
            return sdpa_out + 2 * m.norms_per_block
        if autocast:
            return sdpa_out + 6 * m.norms_per_block + 4 + 2
        return sdpa_out + 4 * m.norms_per_block
    return sdpa_out + (2 * m.norms_per_block if autocast and precision != "fp32" else 0)


def selective_factor(m: ModelSpec, autocast: bool) -> float:
    """Bytes per s*b*h (16-bit units) one block keeps under selective checkpointing: its input (fp32 under
    autocast), the output of every matmul (q, k, v, the output projection; gate and up or fc, down or
    proj) and of attention; everything else is recomputed."""
    h = m.hidden
    mlp = (2 if m.mlp == "swiglu" else 1) * m.ffn_hidden + h  # gate and up (or fc), down (or proj)
    matmuls = 2 * (m.q_dim + 2 * m.kv_dim + h + mlp) / h
    return (4 if autocast else 2) + matmuls + 2 * m.q_dim / h


def loss_line(chunks_setting: int | str, tokens: int, vocab: int, hidden: int) -> str:
    """How the LM head and its loss run for `tokens` tokens (micro batch x sequence), as the start-up and
    `zerodp plan` say it: what model.loss_chunks (auto, or a count) resolves to, "whole logits" or "N chunks
    of M tokens" (zerodp.models.loss splits the tokens as evenly as it can: "of M-(M+1) tokens" when they
    do not divide)."""
    chunks = loss_chunks(chunks_setting, tokens, vocab, hidden)
    if chunks == 0:
        return "whole logits"
    low, high = tokens // chunks, -(-tokens // chunks)
    return f"{chunks:,} chunks of {low:,} tokens" if low == high else f"{chunks:,} chunks of {low:,}-{high:,} tokens"


def loss_setting(chunks_setting: int | str) -> str:
    """What follows `loss_line` when model.loss_chunks chose it: " (model.loss_chunks=auto)", else nothing."""
    return " (model.loss_chunks=auto)" if chunks_setting == "auto" else ""


def head_loss_bytes(m: ModelSpec, tokens: int, precision: str, chunks_setting: int | str,
                    autocast: bool = False) -> int:
    """Bytes the LM head and its loss hold at their peak, with every block's activations still kept, for
    `tokens` tokens (micro batch x sequence). The whole logits (0 chunks): at the loss's backward, the fp32
    log-probabilities the loss kept, their gradient and the logits' (fp32) gradient, 12 bytes per logit
    (more than the forward's 16-bit logits, fp32 copy and log-probabilities). In chunks (zerodp.models.loss):
    one chunk's logits in the compute dtype, their fp32 copy and their gradient (in fp32 all three are one
    tensor, worked in place), the head weight cast to 16 bits for the chunks' gradients (under `autocast`:
    fp32 parameters), the fp32 weight gradient and the hidden states' gradient kept for the backward (in
    their dtype: fp32 under autocast, whose norms compute in fp32)."""
    V, h = m.vocab_size, m.hidden
    chunks = loss_chunks(chunks_setting, tokens, V, h)
    if chunks == 0:
        return 12 * tokens * V
    per_chunk = -(-tokens // chunks)
    if precision == "fp32":
        return per_chunk * V * 4 + V * h * 4 + tokens * h * 4
    cast, hidden = (2, 4) if autocast else (0, 2)
    return per_chunk * V * (2 * 2 + 4) + V * h * (4 + cast) + tokens * h * hidden


def autocast_copy_bytes(m: ModelSpec, precision: str, autocast: bool) -> int:
    """Autocast's 16-bit copies of the weights (fp32 parameters, 16-bit compute), cast once per forward and
    kept for the backward: 2 bytes per parameter that multiplies (every one but a lookup-only embedding)."""
    if not autocast or precision == "fp32":
        return 0
    if m.lora is not None:  # the frozen base is stored in the compute dtype: only the fp32 adapters are cast
        return 2 * m.trainable_params
    lookups = m.vocab_size * m.hidden if m.arch is not None and not m.arch.tied else 0
    return 2 * (m.params - lookups)


def layer_activation_factor(m: ModelSpec, seq_len: int) -> float:
    """Bytes per s*b*h one block keeps for backward in 16-bit, after Korthikanti et al. (2022):
    34 + 5*a*s/h for GPT-2 with dropout and unfused attention."""
    h = m.hidden
    drop = 1 if m.dropout else 0
    # QKV input, Q, K and V, out-proj input, dropout mask (Q and the out-proj input are q_dim wide)
    attn = 2 + 2 * m.q_dim / h + 4 * m.kv_dim / h + 2 * m.q_dim / h + drop
    if not m.fused_attention:  # softmax output (+ its dropout mask and output) per head: a*s^2*b
        attn += (5 if m.dropout else 2) * m.n_head * seq_len / h
    if m.mlp == "swiglu":
        mlp = 2 + 4 * 2 * m.ffn_hidden / h + drop  # input; gate, up, silu(gate), product; dropout mask
    else:
        mlp = 2 + 2 * 2 * m.ffn_hidden / h + drop  # input; GELU input, proj input; dropout mask
    return attn + mlp + 2 * m.norms_per_block  # + the norms' inputs


FLEX_BLOCK = 128
"""torch's flex attention block (create_block_mask's default)."""


def document_mask_bytes(m: ModelSpec, w: Workload, cuda: bool) -> int:
    """The document mask of one micro batch (data.document_masking), built once per forward and shared by
    every block (checkpointed or not): SDPA's additive mask b*s*s in the compute dtype, or flex's block
    mask, 8 int32 tensors of n = ceil(s/128) blocks a side (4 of b*n, 4 of b*n*n). 0 without masking."""
    if not w.document_masking:
        return 0
    kind = w.document_attention
    if kind == "flex" or (kind == "auto" and cuda and not m.dropout):
        n = -(-w.seq_len // FLEX_BLOCK)
        return 4 * 4 * w.micro_batch * n * (n + 1)
    return w.micro_batch * w.seq_len * w.seq_len * COMPUTE_BYTES[w.precision]


def activation_bytes(m: ModelSpec, w: Workload, checkpointing: bool | str, cuda: bool = True,
                     autocast: bool = False) -> int:
    """Activations kept for backward for one micro batch under `checkpointing` (off, selective, full), a
    mixture of experts' routed tokens and router (zerodp.planner.moe), the head's logits and loss, the
    document mask (on a `cuda` device or not: the mask's kernel) and, with `autocast` (fp32 parameters,
    16-bit compute: `autocasts`), its 16-bit weight copies included."""
    s, b, h = w.seq_len, w.micro_batch, m.hidden
    scale = COMPUTE_BYTES[w.precision] / 2  # the factors above are for 16-bit activations
    factor = layer_activation_factor(m, s) + precision_extra(m, w.precision, autocast) \
        + explicit_attention_extra(m, s, w.precision) + qk_norm_extra(m, w.precision)
    one_layer = s * b * h * factor * scale
    mode = Checkpointing(checkpointing)
    # a mixture of experts: each sparse block's routed copies and router (zerodp.planner.moe)
    routed = s * b * routed_bytes_per_token(m, w.precision, autocast)
    if mode == "full":  # each block keeps its input (fp32 under autocast); one block is recomputed at a time
        layers = m.n_layer * (4 if autocast else 2 * scale) * s * b * h + one_layer + routed
    elif mode == "selective":  # each block keeps its matmul and attention outputs; one recomputed at a time
        layers = m.n_layer * s * b * h * selective_factor(m, autocast) * scale + one_layer \
            + sparse_layers(m) * routed
    else:
        layers = m.n_layer * one_layer + sparse_layers(m) * routed
    head = head_loss_bytes(m, b * s, w.precision, w.loss_chunks, autocast)
    copies = autocast_copy_bytes(m, w.precision, autocast)
    adapters = adapter_activation_bytes(m, w, mode)  # a LoRA run's x A products (zerodp.planner.lora)
    return int(layers) + head + copies + adapters + document_mask_bytes(m, w, cuda)
