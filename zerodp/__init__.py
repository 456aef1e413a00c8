"""zerodp: one GPT training pipeline under any data-parallel strategy (DDP, ZeRO-1/2/3, FSDP)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "load_model":  # imported on use: `zerodp plan` and `zerodp --help` never import torch
        from zerodp.api import load_model

        return load_model
    raise AttributeError(f"module 'zerodp' has no attribute {name!r}")


__all__ = ["__version__", "load_model"]
