import pytest
import torch.distributed as dist


@pytest.fixture
def group():
    """The default process group: one rank, gloo, in this process (no process launch)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
