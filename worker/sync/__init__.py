"""The shard server as an update source: the Sync stream, its messages and exactly-once
ledger, gRPC, shared memory. May import: config, runtime, embedding, dense, tasks, updates.
"""
