"""GPUs and links: memory, peak FLOPs and ring bandwidth the planner assumes.

Figures are datasheet values: HBM in GB (1e9 bytes; the driver reports a little more, e.g. an
H100 80GB shows 81,559 MiB = 85.5 GB, which the planner leaves as extra margin), dense tensor-core
peak for 16-bit and plain fp32 peak (torch does not use TF32 for matmuls by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerodp.planner.units import lookup


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes: int
    peak_flops_16: float
    """Dense bf16/fp16 tensor-core FLOP/s."""
    peak_flops_32: float
    """fp32 FLOP/s without TF32."""
    cuda: bool = True
    """A CUDA device: the CUDA context and library workspaces take memory outside torch's allocator."""


GPUS = {
    "h100": GpuSpec("h100", 80 * 10**9, 989e12, 67e12),          # SXM
    "h100-pcie": GpuSpec("h100-pcie", 80 * 10**9, 756e12, 51e12),
    "h200": GpuSpec("h200", 141 * 10**9, 989e12, 67e12),
    "b200": GpuSpec("b200", 180 * 10**9, 2250e12, 80e12),
    "a100": GpuSpec("a100", 80 * 10**9, 312e12, 19.5e12),        # 80GB SXM
    "a100-40gb": GpuSpec("a100-40gb", 40 * 10**9, 312e12, 19.5e12),
    "l40s": GpuSpec("l40s", 48 * 10**9, 362e12, 91.6e12),
    "a10": GpuSpec("a10", 24 * 10**9, 125e12, 31.2e12),
    "l4": GpuSpec("l4", 24 * 10**9, 121e12, 30.3e12),
    "v100": GpuSpec("v100", 32 * 10**9, 125e12, 15.7e12),          # fp16 only: no bf16
    "rtx4090": GpuSpec("rtx4090", 24 * 10**9, 165e12, 82.6e12),
    "mi300x": GpuSpec("mi300x", 192 * 10**9, 1307e12, 163e12),
}

# Bus bandwidth a collective reaches (what NCCL's nccl-tests report as busbw for large messages, not
# the datasheet peak), bytes/s. Links inside a node are per GPU; links between nodes are per node (all
# its NICs together): in a ring over several nodes every GPU sends its share to a neighbour, and one
# share per ring crosses each node boundary, so a node's NICs carry what one GPU sends.
# Sources and caveats: docs/memory_model.md, "Bandwidths".
INTRA_NODE = {
    "nvlink": 300e9,       # NVLink 3/4 + NVSwitch: nccl-tests 8xA100 230-250 GB/s, 8xH100 up to 460-480
    "pcie": 20e9,          # Gen4 x16 through the host, no NVLink
    "shm": 10e9,           # CPU processes on one machine (gloo over shared memory / loopback)
}
INTER_NODE = {
    "infiniband": 45e9,        # one 400 Gb/s NDR NIC's worth per node (the conservative default)
    "infiniband-rail": 400e9,  # 8 x 400 Gb/s NDR, one NIC per GPU (rail-optimised H100/H200 nodes):
                               # multi-node nccl-tests all_reduce busbw 400-450 GB/s
    "ethernet": 10e9,          # 100 GbE per node
}
INTERCONNECTS = {**INTRA_NODE, **INTER_NODE}
"""Every link `--interconnect` accepts: on one node it is the link between the GPUs, across nodes the
link between the nodes (the GPUs of a node then talk over nvlink, or shm for CPU processes)."""

MFU = 0.40
"""Model FLOPs utilisation assumed for the compute time (torchtitan reports 33-39% on H100)."""


def gpu_preset(name: str) -> GpuSpec:
    """The GPU preset `name` (case-insensitive); UserError naming the known ones."""
    return lookup(GPUS, name, "GPU", "or give its memory with --hbm, e.g. --hbm 80GB")


def gpu_from_device_name(device_name: str, memory_bytes: int) -> tuple[GpuSpec, Optional[str]]:
    """A GpuSpec for a device as torch names it ('cpu', 'NVIDIA H100 80GB HBM3', ...) with the
    measured memory; and a note when its speed had to be assumed."""
    low = device_name.lower()
    if low == "cpu" or low.startswith("cpu"):
        return GpuSpec("cpu", memory_bytes, 1e12, 1e12, cuda=False), None
    for key in sorted(GPUS, key=len, reverse=True):  # 'h100-pcie' before 'h100'
        base = key.split("-")[0]
        if base in low.replace(" ", "") and (key == base or key.split("-")[1] in low):
            g = GPUS[key]
            return GpuSpec(g.name, memory_bytes, g.peak_flops_16, g.peak_flops_32), None
    a100 = GPUS["a100"]
    note = f"unknown device {device_name!r}: step time assumes A100 peak FLOPs"
    return GpuSpec(device_name, memory_bytes, a100.peak_flops_16, a100.peak_flops_32), note


@dataclass(frozen=True)
class Cluster:
    """The machines a job runs on; every GPU is alike."""

    gpu: GpuSpec = GPUS["h100"]
    gpus_per_node: int = 1
    nodes: int = 1
    interconnect: Optional[str] = None
    """The slowest link: on one node between its GPUs (nvlink, pcie), across nodes between the nodes
    (infiniband, infiniband-rail, ethernet). None: nvlink on one node, infiniband across nodes (shm for
    CPU processes)."""
    cpu_ram_bytes: Optional[int] = None
    """CPU memory per node available for offloaded states; None: not checked."""
    mfu: float = MFU

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def device(self) -> str:
        """What each rank computes on, as the plan's sentences name it: 'GPU', or 'CPU rank' (CPU
        processes share the machine's RAM and cores, so memory and tokens/s are per process)."""
        return "GPU" if self.gpu.cuda else "CPU rank"

    @property
    def link(self) -> str:
        """The slowest link a collective over every rank crosses."""
        if self.interconnect:
            return self.interconnect
        if not self.gpu.cuda:
            return "shm"
        return "nvlink" if self.nodes == 1 else "infiniband"

    @property
    def intra_bandwidth(self) -> float:
        """Bytes/s each GPU sends to a GPU of its own node."""
        if self.nodes == 1:
            return INTERCONNECTS[self.link]
        return INTRA_NODE["nvlink" if self.gpu.cuda else "shm"]

    @property
    def inter_bandwidth(self) -> float:
        """Bytes/s one node sends to the others, all its NICs together (inf on one node)."""
        return INTERCONNECTS[self.link] if self.nodes > 1 else float("inf")

    @property
    def ring_bandwidth(self) -> float:
        """Bytes/s each GPU sends in a ring collective over every rank: the slowest hop's bandwidth."""
        return min(self.intra_bandwidth, self.inter_bandwidth)
