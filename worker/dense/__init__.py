"""The dense part: its parallelism (FSDP2 / HSDP / DDP wrapping, precision, clipping, the
per-step gradient work) and the run's optimizers (optimizer.py). May import: config,
runtime, embedding.
"""
