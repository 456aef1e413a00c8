"""Surviving failures: preemption signals, the heartbeat and the peer watch that name a dead or hung
rank, and straggler detection (`faults`).

Layer: above distributed; below the trainer.
"""
