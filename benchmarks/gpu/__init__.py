"""The GPU checks behind benchmarks/gpu_checks.py, by group: verdicts (pure, tested on CPU), runner (the
worker process and its launch), one module per group of checks, and the list of checks (checklist)."""
