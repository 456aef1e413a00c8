"""Storage: the run's `Checkpointer` (`checkpointer`: saving, retention, `latest`, what the fault
handling asks), saving, loading and finding checkpoints (`store`), their integrity manifest and the one rule
for which checkpoint a run continues from (`manifest`), and outputs written under a temporary name and
swapped in whole (`safe_output`).

Layer: above config, models and distributed; below strategies' callers (the trainer) and beside
`zerodp.convert`, which reads checkpoints through `manifest`. `manifest` and `safe_output` need no
torch: the convert command hashes a checkpoint before torch is imported.
"""
