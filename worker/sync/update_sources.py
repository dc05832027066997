"""The update sources behind one registry: `build_update_source` is the one place a source
is constructed, from the kind the run's sync section chose once (`SyncConfig.update_kind`,
worker/config/update_kinds.py: "server" builds `ShardClient`, "local" builds
`LocalSparseOptimizer`). Callers ask the kind's facts instead of branching on the flag or
on the source's class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridps.optim import OptimizerSpec
from worker.config.train_config import SyncConfig
from worker.config.update_kinds import UpdateKind
from worker.embedding.sharded import ShardedEmbedding
from worker.sync.client import WIRE_DTYPES, ShardClient
from worker.updates.local_spill import LocalBudget
from worker.updates.source import LocalSparseOptimizer, UpdateSource


def _build_local(embedding: ShardedEmbedding, spec: OptimizerSpec, sync: SyncConfig,
                 **_: Any) -> UpdateSource:
    budget = LocalBudget.from_flags(sync.local_memory_budget_mb, sync.local_spill_dir,
                                    sync.local_spill_max_gb, sync.local_spill_page_kb)
    return LocalSparseOptimizer(embedding, spec, sync.ps_timeout, budget)


def _build_server(embedding: ShardedEmbedding, spec: OptimizerSpec, sync: SyncConfig, *,
                  run_id: str, rank: int, world_size: int, node: dict[str, Any],
                  restore: tuple[str, int] | None, security: Any, run_secret: Any,
                  restore_secret: Any, checkpoint_dir: str) -> UpdateSource:
    units = embedding.units
    return ShardClient(
        sync.ps_address, run_id=run_id, rank=rank, world_size=world_size,
        # per unit (worker/embedding/groups.py): a group of tables registers as one table
        tables=[u.table_config() if u.grouped else embedding.tables[n] for n, u in units.items()],
        ranges={n: (u.start, u.end) for n, u in units.items()},
        members={n: u.members for n, u in units.items() if u.grouped},
        optimizer=spec, timeout_s=sync.ps_timeout, max_chunk_bytes=sync.max_chunk_bytes,
        wire_dtype=WIRE_DTYPES[sync.wire_dtype], **node, restore=restore, security=security,
        row_dtype=embedding.row_dtype, initial_rows=embedding.initial_row_blocks,
        run_secret=run_secret, restore_secret=restore_secret, checkpoint_dir=checkpoint_dir)


# kind name (worker/config/update_kinds.py UPDATE_KINDS) -> its source's constructor
BUILDERS: dict[str, Callable[..., UpdateSource]] = {"server": _build_server, "local": _build_local}


def build_update_source(kind: UpdateKind, embedding: ShardedEmbedding,
                        spec: OptimizerSpec, sync: SyncConfig, **server_args: Any) -> UpdateSource:
    """The source of `kind`; `server_args` (run_id, rank, ...) are used by the server kind."""
    return BUILDERS[kind.name](embedding, spec, sync, **server_args)
