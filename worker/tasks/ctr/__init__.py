"""Click-through-rate prediction (`--task dlrm`): Criteo TSV and synthetic CTR data, the DLRM
model. May import: config, runtime, embedding, tasks.
"""
