"""One mixture-of-experts block against a dense SwiGLU MLP with the same active parameters: forward and
backward time of zerodp.models.moe.SparseMoeBlock (router, E stacked SwiGLU experts of width I, k per
token, tokens sorted by expert: torch's grouped matmul on a CUDA GPU in bf16, a loop over the experts
elsewhere) and of llama's MLP (zerodp.models.llama.model.MLP) of width k x I, on the same tokens. Each
token then multiplies the same number of weights (3 k I h; the router's E h beside them), so the ratio
is what routing costs: the router, the sort and gather of the (token, expert) pairs, the smaller matmuls
and the weighted scatter back. Issue 46's goal: at most 1.5x.

    python benchmarks/moe_block.py                                  # CPU, fp32: h 512, 32 experts of 256, 4 per token
    python benchmarks/moe_block.py --device cuda --dtype bf16       # the grouped matmul
    python benchmarks/moe_block.py --experts 128 --top-k 8 --expert-ffn 256 --tokens 8192

The step is timed as the median of --repeats forward+backward passes after two warm-up passes (on CUDA
synchronised before each clock read).

Measured on this project's 2-core CPU machine (`OMP_NUM_THREADS=1 python benchmarks/moe_block.py --repeats 5`,
the defaults): dense 128.3 ms, MoE 182.2 ms, 1.42x. With both cores under other load the ratio moves with the
load (2.7x wall, 5.7x CPU seconds once): pin one thread to compare. The loop over experts cuts its pieces with
`rows.split(counts)` and `unbind(0)`: slicing (`rows[a:b]`, `w1[e]`) had each piece's backward make a
gradient the size of the whole tensor, summed over the E experts (15.4x before).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zerodp.models.llama.model import MLP
from zerodp.models.llama.spec import llama_arch
from zerodp.models.moe import RouterLog, SparseMoeBlock
from zerodp.models.moe_spec import MoeSpec


def timed(module: torch.nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of one forward and backward of `module` on `x`. On a shared
    machine the wall time moves with the load, the CPU seconds far less."""
    def sync():
        if x.is_cuda:
            torch.cuda.synchronize()

    wall, cpu = [], []
    for i in range(repeats + 2):
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        module(x).float().square().mean().backward()
        sync()
        if i >= 2:  # the first two warm up the allocator and kernels
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per pass (micro batch x sequence)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)

    h, E, k, width = args.hidden, args.experts, args.top_k, args.expert_ffn
    moe = SparseMoeBlock(h, width, MoeSpec(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=width,
                                       norm_topk_prob=True), RouterLog())
    for w in (moe.experts.gate_up_proj, moe.experts.down_proj):
        torch.nn.init.normal_(w, std=0.02)
    dense = MLP(llama_arch(h, 1, 8, 8, k * width, 128, 128), dropout=0.0)
    moe, dense = (m.to(args.device, dtype).train() for m in (moe, dense))
    x = torch.randn(1, args.tokens, h, device=args.device, dtype=dtype, requires_grad=True)

    t_dense, t_moe = timed(dense, x, args.repeats), timed(moe, x, args.repeats)
    active = sum(p.numel() for p in dense.parameters())
    print(f"{args.tokens:,} tokens, hidden {h}, {args.dtype} on {args.device} ({torch.get_num_threads()} threads)")
    print(f"dense SwiGLU MLP of width {k * width}: {active / 1e6:.2f}M parameters, forward+backward "
          f"{t_dense[0] * 1e3:.1f} ms ({t_dense[1] * 1e3:.1f} ms CPU)")
    print(f"MoE block, {E} experts of {width}, {k} per token: {active / 1e6:.2f}M active (+{E * h / 1e6:.3f}M router) "
          f"of {sum(p.numel() for p in moe.parameters()) / 1e6:.2f}M, forward+backward {t_moe[0] * 1e3:.1f} ms "
          f"({t_moe[1] * 1e3:.1f} ms CPU)")
    print(f"ratio MoE / dense: {t_moe[0] / t_dense[0]:.2f}x wall, {t_moe[1] / t_dense[1]:.2f}x CPU "
          "(goal: at most 1.5x)")


if __name__ == "__main__":
    main()
