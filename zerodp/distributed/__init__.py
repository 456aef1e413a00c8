"""The runtime: process groups and small collectives of host values (`process_group`), the devices a
launch uses (`devices`) and deterministic kernels (`determinism`).

Layer: the lowest beside config and errors; everything above may import it.
"""
