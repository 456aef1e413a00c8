"""A sparse mixture-of-experts MLP block and its balance loss, for every MoE family (settings and the
loss's definition: zerodp.models.moe_spec).

The experts are held as two stacked parameters, `experts.gate_up_proj` (E, 2I, C) (each expert's
gate_proj rows, then its up_proj rows) and `experts.down_proj` (E, C, I): transformers' own layout for
Qwen3-MoE and Mixtral in memory, so the names are theirs, and a few large tensors rather than 3E small
modules. That is what the strategies need: ZeRO-3 fetches the block's two expert tensors whole on every
rank whatever the routing (E modules called in a routing-dependent order is what makes DeepSpeed's
prefetch trace diverge and hang), FSDP shards the block as one unit, DDP never sees an unused parameter,
and a grouped matmul takes the stacked weights as they are.

Each expert computes on the tokens routed to it only: the (token, expert) pairs are sorted by expert,
then one grouped matmul per projection on CUDA in 16 bits (torch.nn.functional.grouped_mm), else a
loop over the experts (never over tokens); FLOPs follow the active parameters. Dropless: every token
reaches its k experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerodp.models.moe_spec import MoeSpec


class RouterLog:
    """What the sparse blocks of one forward pass record for the balance loss, per sequence: the times
    each expert was among a token's top k (B, E) and the sum of each expert's router probability (B, E),
    summed over the sparse blocks. Recorded only while `recording` (the model's training forward): an
    activation-checkpointed block run again in the backward pass records nothing twice.

    Across forwards, for the router's telemetry (zerodp.telemetry.router): each sparse block's tokens per
    expert (its top-k slots), added up on the device until `take_load` hands them over."""

    def __init__(self):
        self.recording = False
        self.chosen: torch.Tensor | None = None  # (B, E), no gradient
        self.probs: torch.Tensor | None = None   # (B, E), fp32, with the router's gradient
        self.layers = 0
        self.tokens = 0  # per sequence (T)
        self.load: list[torch.Tensor] = []  # per sparse block in order, (E,) fp32: kept across forwards

    def start(self, recording: bool) -> None:
        self.recording, self.chosen, self.probs, self.layers, self.tokens = recording, None, None, 0, 0

    def add(self, chosen: torch.Tensor, probs: torch.Tensor, tokens: int) -> None:
        if not self.recording:
            return
        self.chosen = chosen if self.chosen is None else self.chosen + chosen
        self.probs = probs if self.probs is None else self.probs + probs
        counts = chosen.sum(0)  # (E,) this block's tokens per expert
        if len(self.load) <= self.layers:
            self.load.append(counts)
        else:
            self.load[self.layers] = self.load[self.layers] + counts
        self.layers += 1
        self.tokens = tokens

    def take_load(self) -> torch.Tensor | None:
        """The tokens each sparse block sent to each expert (L, E) since the last call, on the device (no
        host sync); None when no training forward ran."""
        if not self.load:
            return None
        load, self.load = torch.stack(self.load), []
        return load

    def balance(self, mode: str) -> torch.Tensor:
        """The balance loss of what was recorded (zerodp.models.moe_spec): over the micro batch's tokens
        (`micro_batch`, transformers' load_balancing_loss_func) or per sequence, averaged (`sequence`)."""
        E = self.probs.shape[-1]
        rows = self.layers * self.tokens
        if mode == "micro_batch":
            n = rows * self.probs.shape[0]
            return E * torch.sum(self.chosen.sum(0) / n * (self.probs.sum(0) / n))
        return E * torch.sum(self.chosen / rows * (self.probs / rows), dim=-1).mean()  # (B,) -> mean


class Router(nn.Linear):
    """The bias-free router `gate` (E, C): softmax over the experts in fp32, the top k, renormalised to sum
    1 when `norm_topk_prob` (as transformers' Qwen3MoeTopKRouter)."""

    def __init__(self, n_embd: int, moe: MoeSpec):
        super().__init__(n_embd, moe.num_experts, bias=False)
        self.k, self.norm = moe.num_experts_per_tok, moe.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities (N, E) fp32, the top k's weights (N, k) in the logits' dtype, their experts (N, k))."""
        logits = super().forward(x)                              # (N, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)   # (N, E)
        top, experts = torch.topk(probs, self.k, dim=-1)         # (N, k)
        if self.norm:
            top = top / top.sum(dim=-1, keepdim=True)
        return probs, top.to(logits.dtype), experts


def _grouped(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs here: CUDA, 16-bit, a GPU of compute capability 8.0 or above."""
    return (x.is_cuda and hasattr(F, "grouped_mm") and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


class Experts(nn.Module):
    """E SwiGLU experts as two stacked parameters (the module's docstring)."""

    def __init__(self, n_embd: int, width: int, n_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * width, n_embd))  # (E, 2I, C)
        self.down_proj = nn.Parameter(torch.empty(n_experts, n_embd, width))         # (E, C, I)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x): x (N, C), experts and weights (N, k)."""
        N, k = experts.shape
        E = self.gate_up_proj.shape[0]
        flat = experts.reshape(-1)                                 # (N k,)
        order = torch.argsort(flat, stable=True)                   # the (token, expert) pairs by expert
        token = order // k                                         # (N k,)
        counts = torch.bincount(flat, minlength=E)                 # (E,) tokens per expert
        rows = x[token]                                            # (N k, C)
        w1, w2 = self.gate_up_proj, self.down_proj
        if torch.is_autocast_enabled(x.device.type):  # grouped_mm is not autocast's: cast as a linear would
            dtype = torch.get_autocast_dtype(x.device.type)
            rows, w1, w2 = rows.to(dtype), w1.to(dtype), w2.to(dtype)
        if _grouped(rows, w1):
            offs = counts.cumsum(0).to(torch.int32)                # (E,) the end of each expert's rows
            gate, up = F.grouped_mm(rows, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)  # (N k, I) each
            out = F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)           # (N k, C)
        else:  # one matmul per expert on its rows: the counts on the host (free on the CPU)
            # split/unbind, not slices: a slice's backward is a gradient the size of the whole tensor it
            # was cut from, summed over the E experts (2/3 of the pass on the CPU); split's and unbind's
            # assemble one gradient for all their pieces
            sizes, pieces = counts.tolist(), []
            for part, g_u, down, n in zip(rows.split(sizes), w1.unbind(0), w2.unbind(0), sizes):
                if n:
                    gate, up = F.linear(part, g_u).chunk(2, dim=-1)                        # (n, I) each
                    pieces.append(F.linear(F.silu(gate) * up, down))                        # (n, C)
            out = torch.cat(pieces)                                                        # (N k, C)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros(N, out.shape[-1], device=x.device, dtype=out.dtype).index_add_(0, token, out)  # (N, C)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse block: router `gate`, then `experts`; records the balance loss's figures in
    the model's RouterLog."""

    def __init__(self, n_embd: int, width: int, moe: MoeSpec, log: RouterLog):
        super().__init__()
        self.gate = Router(n_embd, moe)
        self.experts = Experts(n_embd, width, moe.num_experts)
        self.log = [log]  # in a list: a plain attribute, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)                                    # (N, C), N = B T
        probs, weights, experts = self.gate(flat)                  # (N, E), (N, k), (N, k)
        log = self.log[0]
        if log.recording:
            E = probs.shape[-1]
            chosen = F.one_hot(experts, E).sum(1).reshape(B, T, E).sum(1).float()  # (B, E)
            log.add(chosen, probs.reshape(B, T, E).sum(1), T)
        return self.experts(flat, experts, weights).reshape(B, T, C)
