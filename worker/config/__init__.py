"""Settings of a run and their checks before work starts: TrainConfig, its sections, the flag
parsing, the per-task defaults, the output paths and the preflight. Imports no other room.
"""
