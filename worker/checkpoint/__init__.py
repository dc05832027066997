"""Step-consistent checkpoints and resume: one part per component (rows, slot maps, window,
source, dense, data), the sequence that runs them, the run's claim.
May import: config, runtime, embedding, dense, tasks, updates, sync, report.
"""
