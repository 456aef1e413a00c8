"""The trainer: the training loop (`loop`), its start-up checks shared with `--dry-run` (`preflight`),
where a run starts (`start`: resume, init_from, starting over), what records the steps (`records`) and
guards them (`guards`), and the end-of-run sample (`sample`).

Layer: above strategies, checkpoint, data, telemetry and resilience, which it composes; below the
entry points (`zerodp.cli`, `zerodp.api`).
"""
