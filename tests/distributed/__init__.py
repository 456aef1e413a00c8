"""The multi-process tier: real process groups (gloo on the CPU), the real DeepSpeed engine and FSDP2,
the command line run as a user runs it (`zerodp train`, torchrun, the launchers), real files on disk."""
