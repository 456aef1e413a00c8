"""Low-rank adapters as modules (the description, torch-free, is zerodp.models.lora_spec).

`add_adapters(model, spec)` turns each target nn.Linear of a freshly constructed model into a LoRALinear
in place: its `weight` and `bias` keep their names (checkpoints, the Hugging Face table and the strategies
see the base model unchanged) and it gains two bias-free linear submodules, `lora_A` (in -> rank) and
`lora_B` (rank -> out). Every base parameter is frozen (requires_grad False), so AdamW
(zerodp.optim.param_groups) and every strategy's gradient reduction see the adapters only.

Called by zerodp.models.construct, so the adapters are created wherever the model is: on the meta device
(single, ddp, zero1/2, fsdp materialise them like any parameter) or inside deepspeed.zero.Init (zero3
partitions them as created). Their forward is their own module's: ZeRO-3's fetch hooks and FSDP's
gathers treat them as any submodule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerodp.models.dropout import KeyedDropout
from zerodp.models.lora_spec import LoraSpec, adapted_modules, is_adapter


class LoRALinear(nn.Linear):
    """nn.Linear plus (alpha / rank) * lora_B(lora_A(dropout(x))); `weight` and `bias` frozen."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)  # (..., out)
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def add_adapters(model: nn.Module, spec: LoraSpec) -> int:
    """Adapt `spec`'s target modules of `model` (a DecoderLM just constructed) and freeze everything
    else; return the number of modules adapted."""
    wanted = adapted_modules(model.arch, spec)
    for name in wanted:
        module = model.get_submodule(name)
        assert type(module) is nn.Linear, f"{name} is a {type(module).__name__}, not an nn.Linear"
        module.__class__ = LoRALinear
        # created like the module's own parameters: on the current default device (meta) or under zero.Init
        module.lora_A = nn.Linear(module.in_features, spec.rank, bias=False)
        module.lora_B = nn.Linear(spec.rank, module.out_features, bias=False)
        # keyed by (row, position, input feature, this layer): the same mask at any layout (zerodp.models.dropout)
        module.lora_dropout = KeyedDropout(spec.dropout) if spec.dropout else nn.Identity()
        module.scaling = spec.scaling
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return len(wanted)


def merge_adapters(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scaling: float) -> dict:
    """Full weights with each adapted `<m>.weight` replaced by W + scaling * B A (fp32), the adapters
    dropped: the model the adapters compute, as plain weights (`zerodp convert --to hf --merge`)."""
    merged = dict(weights)
    for name in [n for n in adapters if n.endswith(".lora_A.weight")]:
        module = name[: -len(".lora_A.weight")]
        a, b = adapters[name].float(), adapters[f"{module}.lora_B.weight"].float()  # (r, in), (out, r)
        w = weights[f"{module}.weight"]
        merged[f"{module}.weight"] = (w.float() + scaling * (b @ a)).to(w.dtype)  # (out, in)
    return merged
