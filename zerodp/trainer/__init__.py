"""The trainer: the training loop (`loop`), where a run starts (`start`: resume, init_from, starting
over) and the end-of-run sample (`sample`).

Layer: above strategies, checkpoint, data, telemetry and resilience, which it composes; below the
entry points (`zerodp.cli`, `zerodp.api`).
"""
