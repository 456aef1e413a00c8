"""Surviving failures: preemption signals (`preemption`), the heartbeat and the peer watch that name a
dead or hung rank (`peers`), and straggler detection with the timing it reads (`stragglers`).

Layer: above distributed; below the trainer.
"""
