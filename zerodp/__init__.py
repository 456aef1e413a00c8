"""zerodp: one GPT training pipeline under any data-parallel strategy (DDP, ZeRO-1/2/3, FSDP)."""

__version__ = "0.1.0"
