"""Measurement: per-step figures and the run summary (`step_metrics`), the metric loggers (`loggers`:
metrics.jsonl, TensorBoard, Weights & Biases), the collectives' bytes and the planner's prediction
beside them (`comm`), and the gradient noise scale (`grad_noise`).

Layer: above config and distributed; below the trainer.
"""
