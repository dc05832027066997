"""Knowledge-graph embeddings (`--task kge`, `kge_planted`): data, models, scoring, schedule,
export. May import: config, runtime, embedding, tasks.
"""
