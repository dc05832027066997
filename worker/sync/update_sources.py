"""The update sources behind one registry, chosen once from the config.

`source_kind(sync_cfg)` picks the kind ("server": the node's shard server, `ShardClient`;
"local": `LocalSparseOptimizer`, --local-optimizer); callers ask its facts (needs a
server? the mode name in results.json and the manifest, whether the run claims a resume)
instead of branching on the flag or on the source's class, and `build_update_source`
is the one place a source is constructed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridps.cli import ConfigError
from hybridps.optim import OptimizerSpec
from worker.config.train_config import SyncConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.sync.client import WIRE_DTYPES, ShardClient
from worker.updates.source import LocalSparseOptimizer, UpdateSource


@dataclass(frozen=True)
class UpdateSourceKind:
    """What callers need to know about one kind of update source."""

    name: str            # the registry key
    mode: str            # results.json / the checkpoint manifest "mode"
    needs_server: bool   # a shard server address is required and contacted
    claims_resume: bool  # the run claims its servers' state on a resume (worker/checkpoint)
    build: Callable[..., UpdateSource]


def _build_local(embedding: ShardedEmbedding, spec: OptimizerSpec, sync: SyncConfig,
                 **_: Any) -> UpdateSource:
    return LocalSparseOptimizer(embedding, spec, sync.ps_timeout)


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


UPDATE_SOURCES: dict[str, UpdateSourceKind] = {
    "server": UpdateSourceKind("server", mode="server", needs_server=True, claims_resume=True,
                               build=_build_server),
    "local": UpdateSourceKind("local", mode="local-optimizer", needs_server=False,
                              claims_resume=False, build=_build_local),
}


def kind_named(name: str) -> UpdateSourceKind:
    try:
        return UPDATE_SOURCES[name]
    except KeyError:
        raise ConfigError(f"unknown update source {name!r} (one of "
                          f"{', '.join(sorted(UPDATE_SOURCES))})") from None


def source_kind(sync_cfg: SyncConfig) -> UpdateSourceKind:
    """The kind a run's sync section selects (--local-optimizer: "local")."""
    return kind_named("local" if sync_cfg.local_optimizer else "server")


def build_update_source(kind: UpdateSourceKind, embedding: ShardedEmbedding,
                        spec: OptimizerSpec, sync: SyncConfig, **server_args: Any) -> UpdateSource:
    """The source of `kind`; `server_args` (run_id, rank, ...) are used by the server kind."""
    return kind.build(embedding, spec, sync, **server_args)
