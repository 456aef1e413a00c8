"""Mixture-of-experts settings described, torch-free: `model.moe`'s keys checked (`moe_spec`), and which
blocks hold experts. Every MoE family reads this (qwen3_moe today); the modules that compute with it are
zerodp.models.moe's.

A sparse MLP block routes each token to `num_experts_per_tok` of its `num_experts` SwiGLU experts (width
`moe_intermediate_size`): a bias-free router `gate` gives E logits, their softmax (in fp32) ranks the
experts, the token goes to the top k, weighted by their probabilities (renormalised to sum 1 when
`norm_topk_prob`). Routing is dropless: every token reaches its k experts, whatever the load.

The balance loss (Switch Transformer's, as transformers' `load_balancing_loss_func` computes it) over a
set of tokens S and the L sparse layers pooled:

    f_e = (times expert e is among a token's top k) / (L |S|)     P_e = (sum of e's router probability) / (L |S|)
    balance(S) = E * sum_e f_e P_e                                  (k when perfectly balanced)

`balance: micro_batch` takes S = a micro batch (what transformers computes for a batch: a run equals one
trained with transformers at the same micro batch size, but it changes with the micro batch size);
`balance: sequence` (the default) takes S = one sequence and averages over the sequences (DeepSeek-V3's
sequence-wise form), which neither the micro batch size nor the world size changes. Either way the
micro batches of a global batch weigh the same, and every token counts, a loss mask's non-targets too:
each passes the router and its experts, so each is load. The training loss is the LM loss plus
`router_aux_loss_coef` x balance.

Layer: beside the family specs (imports zerodp.errors only)."""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass

from zerodp.errors import ConfigError

BALANCE = ("sequence", "micro_batch")
"""model.moe.balance's modes."""
KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
        "mlp_only_layers", "balance", "router_aux_loss_coef")
"""model.moe's keys (Hugging Face's config.json names), each documented in MoeSpec."""


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int = 8
    """Experts per sparse block (E)."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k), 1..num_experts."""
    moe_intermediate_size: int | None = None
    """Width of one expert's SwiGLU inner layer; null: model.intermediate_size."""
    norm_topk_prob: bool = False
    """Renormalise the k chosen experts' probabilities to sum 1 (Qwen3-30B-A3B: true)."""
    decoder_sparse_step: int = 1
    """Block i is sparse when (i + 1) is a multiple of this (1: every block), and i not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks that keep a dense MLP of width model.intermediate_size."""
    balance: str = "sequence"
    """sequence | micro_batch: the tokens each balance loss is taken over (see the module's docstring)."""
    router_aux_loss_coef: float = 0.001
    """The balance loss's weight in the training loss (0: not added, still logged)."""

    def dense_layers(self, n_layer: int) -> tuple[int, ...]:
        """The blocks whose MLP is dense, as transformers' Qwen3MoeDecoderLayer decides."""
        return tuple(i for i in range(n_layer)
                     if i in self.mlp_only_layers or (i + 1) % self.decoder_sparse_step)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        return out


def _whole(where: str, key: str, value, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}.{key}={value!r} must be a whole number >= {minimum}; {hint}")
    return value


def moe_spec(section: dict | None, where: str = "model.moe") -> MoeSpec:
    """The MoeSpec of a `model.moe` mapping (empty: every default). Raises ConfigError naming the bad
    key and how to fix it."""
    section = {} if section is None else section
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a mapping such as {{num_experts: 8, num_experts_per_tok: 2}}, "
                          f"got {section!r}")
    for key in section:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(KEYS)}"
            raise ConfigError(f"unknown key {key!r} in {where}{hint}")
    d = MoeSpec()
    experts = _whole(where, "num_experts", section.get("num_experts", d.num_experts), 1,
                     "a mixture of experts needs at least one expert (8, 64, 128 are usual)")
    k = _whole(where, "num_experts_per_tok", section.get("num_experts_per_tok", d.num_experts_per_tok), 1,
               "each token goes to at least one expert")
    if k > experts:
        raise ConfigError(f"{where}.num_experts_per_tok={k} is above {where}.num_experts={experts}: a token cannot "
                          f"go to more experts than there are; set num_experts_per_tok <= {experts}")
    width = section.get("moe_intermediate_size")
    if width is not None:
        _whole(where, "moe_intermediate_size", width, 1, "the width of one expert's inner layer")
    norm = section.get("norm_topk_prob", d.norm_topk_prob)
    if not isinstance(norm, bool):
        raise ConfigError(f"{where}.norm_topk_prob={norm!r} must be true or false")
    step = _whole(where, "decoder_sparse_step", section.get("decoder_sparse_step", d.decoder_sparse_step), 1,
                  "1 makes every block sparse")
    dense = section.get("mlp_only_layers", [])
    if not isinstance(dense, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in dense):
        raise ConfigError(f"{where}.mlp_only_layers={dense!r} must be a list of block indices such as [0, 1]")
    balance = section.get("balance", d.balance)
    if balance not in BALANCE:
        close = difflib.get_close_matches(str(balance), BALANCE, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{where}.balance={balance!r} is not a balance mode; {hint}choose sequence (per sequence, "
                          f"the same at any micro batch or world size) or micro_batch (transformers' loss)")
    coef = section.get("router_aux_loss_coef", d.router_aux_loss_coef)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ConfigError(f"{where}.router_aux_loss_coef={coef!r} must be a number >= 0 (0.001 is usual; 0 trains "
                          f"without the balance loss)")
    return MoeSpec(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=norm,
                   decoder_sparse_step=step, mlp_only_layers=tuple(sorted(set(dense))), balance=balance,
                   router_aux_loss_coef=float(coef))
