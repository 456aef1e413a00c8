import os
import tempfile
from pathlib import Path

import pytest

# Tokenized-data cache shared by the test processes (and their children) of one session.
os.environ.setdefault("ZERODP_CACHE", str(Path(tempfile.gettempdir()) / "zerodp-test-cache"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# A small model that trains in well under a second per step on 2 CPU cores.
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "model.vocab_size=256",
    "data.max_bytes=200000", "data.prefetch=0",
    "train.global_batch_size=12", "train.micro_batch_size=2", "train.eval_every=0", "train.sample_tokens=0",
    "train.progress=false", "optim.warmup_steps=2", "optim.lr=1e-2", "optim.min_lr=1e-3", "optim.grad_clip=1.0",
    "checkpoint.every=0",
]


@pytest.fixture
def tiny():
    return list(TINY)
