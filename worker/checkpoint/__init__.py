"""Step-consistent checkpoints and resume: per-table and dense files, the run's claim.
May import: config, runtime, embedding, dense, tasks, updates, sync, report.
"""
