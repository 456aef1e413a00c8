import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.harness import gpu_skip_reason, pin_cpu
from tests.support.shards import SHARD_ENV, keep
from zerodp.cli.allocator import default_allocator

# Tokenized-data cache shared by the test processes (and their children) of one session.
os.environ.setdefault("ZERODP_CACHE", str(Path(tempfile.gettempdir()) / "zerodp-test-cache"))
# The tests run on the CPU on any machine (a GPU machine's included): CUDA is hidden from this process
# before anything uses it, and from every process it starts. Only @pytest.mark.gpu tests see GPUs.
pin_cpu(os.environ)
# One intra-op thread for this process and every process it starts (OMP_NUM_THREADS, as base_env gives the
# ranks): the suite runs several processes per core (two shares, their ranks), and torch's threads spin
# waiting for each other on a busy core: a forward pass took 8x the CPU time on 2 threads as on 1 beside
# the other share. The tests of thread sizing pass their own environment (size_threads(environ)).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The allocator setting every zerodp command makes at its start (zerodp.cli.allocator), made once here: a
# command run in this process (zerodp.cli.commands.main) would otherwise change the environment midway, and
# every pooled World started before it (tests.support.harness) would be started again for the change.
default_allocator(os.environ)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu(n): needs n GPUs (default 1); skipped on a machine with fewer. Its processes see the "
                   "machine's GPUs through tests.support.harness.gpu_env / run_distributed(device='cuda')")


def pytest_collection_modifyitems(config, items):
    """Under tests.support.shards (ZERODP_TEST_SHARD=k/n) keep this process's share of the files."""
    value = os.environ.get(SHARD_ENV)
    if not value:
        return
    files = keep(sorted({Path(str(item.path)) for item in items}), value)
    kept = [item for item in items if Path(str(item.path)) in files]
    config.hook.pytest_deselected(items=[item for item in items if Path(str(item.path)) not in files])
    items[:] = kept


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is not None:
        reason = gpu_skip_reason(marker.args[0] if marker.args else 1)
        if reason:
            pytest.skip(reason)

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
