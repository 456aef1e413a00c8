"""The planner's start-up peak (docs/memory_model.md, "Start-up: construction and loading"): each
strategy's figure computed by hand from P, N and the largest parameter, rows refused because only
their start-up does not fit (on the GPU, in host RAM), and strategy.name=auto avoiding them."""

import math

import pytest

from zerodp.config import Config, ModelConfig
from zerodp.planner import Cluster, Layout, Workload, choose, estimate, gpu_preset, plan_for_training, preset
from zerodp.planner.memory import CUDA_OVERHEAD
from zerodp.planner.models import spec_from_params

GB = 10**9
LLAMA3_70B = 70_553_706_496
LLAMA3_EMBED = 128_256 * 8192  # the largest parameter: the (untied) embedding, vocab x hidden


def cluster(gpu="h100", n=8, nodes=1, **kw):
    return Cluster(gpu=gpu_preset(gpu), gpus_per_node=n, nodes=nodes, **kw)


def row(plan, name):
    return next(e for e in plan.estimates if e.name == name)


def test_the_model_knows_its_largest_parameter_and_block():
    m = preset("llama3-70b")
    assert m.params == LLAMA3_70B and m.largest_param == LLAMA3_EMBED
    h, kv, f = 8192, 1024, 28672
    assert m.largest_block_params == 2 * h * h + 2 * kv * h + 3 * h * f + 2 * h  # q, o; k, v; MLP; 2 norms
    mixtral = preset("mixtral-8x7b")  # the stacked experts outweigh the embedding
    assert mixtral.largest_param == 8 * 2 * 14336 * 4096
    guess = spec_from_params(7 * 10**9, layers=32, hidden=4096)
    assert guess.largest_param == 32000 * 4096 and guess.largest_block_params == 12 * 4096 * 4096


def test_zero3_bf16_llama3_70b_on_32_gpus_by_hand():
    e = estimate(preset("llama3-70b"), Layout("zero3", cluster(nodes=4), Workload(1, 4096),
                                              activation_checkpointing=True))
    shard = math.ceil(LLAMA3_70B / 32)  # 2,204,803,328
    # the gradient partition in fp32 (strategy.grad_reduce_dtype); the fp32 reduce bucket of hidden^2 elements,
    # at least the largest parameter: the embedding
    assert LLAMA3_EMBED > 8192**2
    partitions, master, grads, bucket = 2 * shard, 4 * shard, 4 * shard, 4 * LLAMA3_EMBED
    by_hand = partitions + master + grads + bucket + 4 * LLAMA3_EMBED + CUDA_OVERHEAD
    # 22.0 GB of partitions, master and gradients + 4.2 GB bucket + 4.2 GB embedding in fp32 + 1 GiB
    assert e.startup_bytes == by_hand == 31_527_160_320
    assert e.startup_host_bytes_per_node == 8 * 4 * LLAMA3_EMBED  # one checkpoint tensor per rank
    assert e.startup_host_fits is None and e.fits  # no --cpu-ram: the host is not checked


def test_zero3_fp32_keeps_a_separate_master():
    """Measured (benchmarks/startup_memory.py): in fp32 too DeepSpeed's stage 3 copies the flat
    partitions into a separate fp32 master, next to an fp32 gradient partition buffer; the fp32 reduce bucket
    holds the largest parameter."""
    e = estimate(preset("llama3-70b"), Layout("zero3", cluster(nodes=4), Workload(1, 4096, "fp32")))
    shard = math.ceil(LLAMA3_70B / 32)
    assert e.startup_bytes == 12 * shard + 4 * LLAMA3_EMBED + 4 * LLAMA3_EMBED + CUDA_OVERHEAD


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fsdp_is_its_fp32_shards(precision):
    m, c = preset("llama3-70b"), cluster(nodes=4)
    e = estimate(m, Layout("fsdp", c, Workload(1, 4096, precision)))
    assert e.startup_bytes == 4 * math.ceil(LLAMA3_70B / 32) + CUDA_OVERHEAD
    off = estimate(m, Layout("fsdp", c, Workload(1, 4096, precision), True, True))
    assert off.startup_bytes == CUDA_OVERHEAD  # CPUOffloadPolicy: the shards live in host RAM
    assert off.startup_host_bytes_per_node == 8 * (4 * LLAMA3_EMBED + 4 * math.ceil(LLAMA3_70B / 32))


def test_the_other_strategies_by_hand():
    m = preset("llama2-7b")
    P, big, c = m.params, m.largest_param, cluster()
    shard = math.ceil(P / 8)
    expect = {"ddp": 8 * P, "zero1": 2 * P + 4 * shard, "zero2": 2 * P + 4 * shard}
    for name, device in expect.items():
        e = estimate(m, Layout(name, c, Workload(1, 4096)))
        assert e.startup_bytes == device + CUDA_OVERHEAD, name
    assert estimate(m, Layout("single", cluster(n=1), Workload(1, 4096))).startup_bytes == 4 * P + CUDA_OVERHEAD
    z1 = estimate(m, Layout("zero1", c, Workload(1, 4096, "fp32")))
    assert z1.startup_bytes == 4 * P + 4 * shard + CUDA_OVERHEAD  # the fp32 module and a cloned master
    z2 = estimate(m, Layout("zero2", c, Workload(1, 4096)))
    assert z2.startup_host_bytes_per_node == 8 * (4 * big + 2 * P)  # checkpoint tensor + 16-bit staging
    z2o = estimate(m, Layout("zero2", c, Workload(1, 4096), offload_optimizer=True))
    assert z2o.startup_bytes == 2 * P + CUDA_OVERHEAD
    assert z2o.startup_host_bytes_per_node == 8 * (4 * big + 2 * P + 4 * shard)


@pytest.mark.parametrize("model,ckpt,ram,refused,chosen", [
    ("llama2-13b", True, 200, ["zero2"], "fsdp"),  # zero1 does not fit the GPUs even with checkpointing
    ("llama2-7b", None, 100, ["zero1", "zero2"], "fsdp"),
])
def test_host_ram_too_small_for_deepspeed_staging(model, ckpt, ram, refused, chosen):
    m = preset(model)
    without = choose(m, cluster(), Workload(1, 4096), ckpt)
    assert all(e.fits for e in without.estimates if e.name in refused)  # before the host was checked
    plan = choose(m, cluster(cpu_ram_bytes=ram * GB), Workload(1, 4096), ckpt)
    assert plan.choice_name == chosen
    for name in refused:
        e = row(plan, name)
        assert e.total_bytes <= e.usable_bytes and e.startup_bytes <= e.usable_bytes  # the GPUs would do
        assert e.startup_host_bytes_per_node == 8 * (2 * m.params + 4 * m.largest_param) > ram * GB
        assert e.startup_host_fits is False and not e.fits
        reason = next(r for r in plan.reasons if r.startswith(f"{name}:"))
        assert reason.startswith(f"{name}: does not fit at start-up in host RAM: start-up peak ")
        assert "DeepSpeed staging each rank's 16-bit module" in reason and f"> {ram:.1f} GB per node." in reason
    assert row(plan, chosen).startup_host_fits is True


def test_cpu_training_checks_the_node_ram():
    """On CPU ranks the device is host memory: plan_for_training passes the node's RAM, and a rank's
    start-up peak holds its host transients too (the checkpoint tensor, zero1/2's staging)."""
    cfg = Config()  # fp32, the default precision
    cfg.model = ModelConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=128)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 4
    plan = plan_for_training(cfg, 4, 8 * GB, "cpu")
    assert plan.cluster.cpu_ram_bytes == 4 * 8 * GB
    m = plan.model
    P, shard = m.params, math.ceil(m.params / 4)
    z2 = row(plan, "zero2")
    assert z2.startup_bytes == 4 * P + 4 * shard + 4 * m.largest_param + 4 * P  # no CUDA overhead on CPU
    assert z2.startup_host_bytes_per_node == 4 * z2.startup_bytes and z2.startup_host_fits is True
    assert z2.bucket_bytes == 2 * 4 * (P + P % 2) and P < 500_000_000  # two fp32 buckets, capped at the model
    assert plan.choice == "ddp"
    # 1.35 GB per rank (1.215 usable), with 25 MiB buckets (DeepSpeed's default 5e8 elements would be two
    # fp32 buckets of the whole model here, 1 GB, in training only): ddp and zero1 do not fit in training;
    # zero2 would (1.169 GB), but its start-up holds the fp32 module, its staging copy and the master
    # (1.268 GB): auto picks fsdp.
    cfg.strategy.bucket_size_mb = 25
    tight = plan_for_training(cfg, 4, int(1.35 * GB), "cpu")
    e = row(tight, "zero2")
    assert e.total_bytes <= e.usable_bytes < e.startup_bytes and not e.fits
    assert not e.activation_checkpointing  # checkpointing cannot help a start-up peak
    reason = next(r for r in tight.reasons if r.startswith("zero2:"))
    assert reason.startswith("zero2: does not fit at start-up: start-up peak 1.3 GB per CPU rank"), reason
    assert tight.choice == "fsdp" and not tight.activation_checkpointing


def test_no_number_of_gpus_helps_a_node_too_small_to_load_a_checkpoint():
    plan = choose(preset("llama3-70b"), cluster(cpu_ram_bytes=30 * GB), Workload(1, 4096))
    assert 8 * 4 * LLAMA3_EMBED > 30 * GB and plan.choice is None
    assert plan.suggestion == (
        "No number of GPUs helps: at start-up each node needs 33.6 GB of host RAM (loading a checkpoint reads one "
        "full fp32 tensor per rank), more than 30.0 GB; give the node more RAM (--cpu-ram) or fewer ranks per node.")
