"""Dynamic tables: raw ids -> slots at their owners, admission, eviction, paging, prefetch.
May import: config, runtime, embedding (not its sharded tables).
"""
