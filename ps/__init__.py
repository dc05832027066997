"""The shard server: its entry points here (`python -m ps`, config.py, `python -m ps.admin`).
core/ holds the transport-free state, edge/ the gRPC around it; entry imports both."""
