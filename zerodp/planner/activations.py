"""What one micro batch keeps on the device beyond the model states, as zerodp's modules run it: the
blocks' activations under each checkpointing mode (off, selective, full), the LM head's logits and loss
(whole or in chunks: model.loss_chunks), and the 16-bit weight copies autocast makes. Torch-free
arithmetic; the formulas, and the measurement they are calibrated on, are in docs/memory_model.md
("Activations", "Logits and loss")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from zerodp.models.chunking import CHECKPOINTING, loss_chunks

if TYPE_CHECKING:
    from zerodp.planner.models import ModelSpec

SELECTIVE_RECOMPUTE = 0.1
"""Share of the forward's time outside the matmuls and attention (norms, rotary, activation, residual adds,
casts): what selective checkpointing runs again in the backward. An estimate (element-wise kernels are
memory-bound; profiles of Llama-sized blocks put them near a tenth of the forward), not a measurement."""


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


def compute_factor(mode: str) -> float:
    """Training compute relative to no checkpointing (forward 1, backward 2): full runs the forward again
    (4/3), selective its element-wise share (SELECTIVE_RECOMPUTE of the forward)."""
    return {"off": 1.0, "selective": 1 + SELECTIVE_RECOMPUTE / 3, "full": 4 / 3}[mode]


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
    lookups = m.vocab_size * m.hidden if m.arch is not None and not m.arch.tied else 0
    return 2 * (m.params - lookups)
