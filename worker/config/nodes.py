"""Which shard server does this rank use, and how does it reach it? (torch-free)

One shard server runs on every node; each rank talks only to its own node's
server. `--ps` (or HYBRIDPS_PS) is either
- one HOST:PORT: every rank of this launch uses it (the usual multi-node
  recipe: each node's torchrun passes its local server, e.g. 127.0.0.1:50051);
- a comma list `A,B,...` indexed by node: rank r uses entry r // LOCAL_WORLD_SIZE
  (torchrun numbers ranks node by node, LOCAL_WORLD_SIZE ranks per node), so
  the same command line works on every node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def split_ps(ps: str) -> list[str]:
    """'a:1, b:2' -> ['a:1', 'b:2'] (ValueError on an empty entry)."""
    entries = [part.strip() for part in ps.split(",")]
    if any(not e for e in entries):
        raise ValueError(f"ps={ps!r} has an empty entry; use HOST:PORT or HOST:PORT,HOST:PORT,...")
    return entries


def rank_layout(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(RANK, LOCAL_WORLD_SIZE) from torchrun's environment; (0, 1) without it."""
    environ = os.environ if environ is None else environ
    rank = int(environ.get("RANK", "0") or 0)
    local_world_size = int(environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return rank, max(local_world_size, 1)


def node_index(rank: int, local_world_size: int) -> int:
    if rank < 0 or local_world_size < 1:
        raise ValueError(f"rank={rank}, local_world_size={local_world_size}: need rank >= 0 "
                         "and local_world_size >= 1")
    return rank // local_world_size


def node_ps_address(ps: str, rank: int, local_world_size: int) -> str:
    """The server of rank `rank`'s node (see the module doc)."""
    entries = split_ps(ps)
    if len(entries) == 1:
        return entries[0]
    node = node_index(rank, local_world_size)
    if node >= len(entries):
        raise ValueError(
            f"ps={ps!r} lists {len(entries)} servers (one per node) but rank {rank} is on node "
            f"{node} (rank // LOCAL_WORLD_SIZE = {rank} // {local_world_size}); give one "
            "HOST:PORT per node, or this node's server alone")
    return entries[node]

