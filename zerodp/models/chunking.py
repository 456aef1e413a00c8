"""How the loss and the activations are computed, as numbers the model and the planner share (torch-free):
how many chunks the LM head and its loss run in (`model.loss_chunks`, zerodp.models.loss) and the
activation checkpointing modes (`model.activation_checkpointing`, zerodp.models.recompute)."""

from __future__ import annotations

import math

AUTO_CHUNK_LOGITS = 1 << 26
"""model.loss_chunks=auto: at most this many logits per chunk (256 MB in fp32 for the loss)."""

CHECKPOINTING = ("off", "selective", "full")
"""model.activation_checkpointing's modes: keep every activation; recompute only the element-wise work
(the matmul and attention outputs kept); recompute each block's whole forward."""


def loss_chunks(setting: int | str, tokens: int, vocab: int, hidden: int) -> int:
    """How many chunks the head and loss of `tokens` tokens (micro batch x sequence) run in: 0 for the whole
    logits at once. `setting` is model.loss_chunks: a count (0: whole; more chunks than tokens: one token
    each), or auto: whole when the logits hold at most AUTO_CHUNK_LOGITS values or the micro batch has at
    most 2 x hidden tokens (the chunked loss keeps an fp32 vocab x hidden weight gradient from the forward
    to the backward, as big as the fp32 logits of `hidden` tokens), else chunks of at most
    AUTO_CHUNK_LOGITS logits."""
    if setting != "auto":
        return min(int(setting), tokens)
    if tokens * vocab <= AUTO_CHUNK_LOGITS or tokens <= 2 * hidden:
        return 0
    return math.ceil(tokens * vocab / AUTO_CHUNK_LOGITS)


def checkpointing_mode(value: bool | str) -> str:
    """model.activation_checkpointing as one of CHECKPOINTING: true and false are full and off. Anything else
    raises ValueError."""
    if value is True or value is False:
        return "full" if value else "off"
    if value not in CHECKPOINTING:
        raise ValueError(value)
    return value
