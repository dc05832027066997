"""Training from files: the record formats (Parquet, TorchRec's Criteo .npy, Criteo TSV), the
columns a task reads, the per-rank sharded, seeded and resumable reading, `--task files`.
May import: config, runtime, embedding, dense, tasks.
"""
