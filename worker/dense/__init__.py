"""The dense part's parallelism: FSDP2 / HSDP / DDP wrapping, precision, clipping, the
per-step gradient work. May import: config, runtime, embedding.
"""
