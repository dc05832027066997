"""The sharded tables: rows a rank owns, table groups, the input dist, the all_to_all, the
lookups (dynamic tables in embedding/dynamic/). May import: config, runtime.
"""
