"""The shard server's state: partitions keyed by (run_id, rank). Transport-free, no grpc.

`Store` is synchronous and thread-safe: one partition's pushes apply under its
`Partition.lock`, so different partitions update in parallel threads (torch
releases the GIL) while one partition's pushes apply one at a time, in order.

`SyncSession` (ps/core/session.py) is one Sync stream's view: it checks each incoming
chunk as it arrives, buffers the chunks of a push, and applies the whole push
atomically when its last chunk arrives. Every method raises a hybridps.errors.ShardError whose
message names the offending value; a refused push leaves the state untouched
(only the refusal counters move).

`ShardCore` (ps/core/shard_core.py) wraps this for asyncio.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridps import logs
from hybridps.errors import (
    Conflict,
    InvalidArgument,
    NotFound,
    NotRegistered,
    ShardError,
    StaleIncarnation,
)
from hybridps.names import describe_problem
from hybridps.optim import OptimizerSpec
from hybridps.optim_kinds import SERVER_FLAG_BYTES_PER_ROW
from hybridps.run_secret import secret_digest
from ps.core.checkpoint_dirs import CheckpointRoot, write_refusal
from ps.core.limits import DEFAULT_RUN_SHARES, StateBudget
from ps.core.paging import PageCall, PageResult
from ps.core.partition import (
    DEFAULT_ANSWER_CACHE_STEPS,
    DEFAULT_RATE_WINDOW_S,
    MASTER,
    ROW_DTYPES,
    Partition,
    TableSpec,
    TableState,
    check_row_dtype,
    optimizer_description,
)
from ps.core.partition_auth import PartitionAuth, check_run_id
from ps.core.server_stats import ServerStats, partition_rows
from ps.core.session import SyncSession, TableKey
from ps.core.spill import SpillTier
from ps.core.table_members import file_names

log = logging.getLogger("ps.store")



kv = logs.kv  # one structured log line: `event=NAME key=value ...` (hybridps/logs.py)


@dataclass(frozen=True)
class RegisteredTable:
    name: str
    rows_held: int
    last_step: int
    created: bool


@dataclass(frozen=True)
class RankStep:
    rank: int
    table: str
    last_step: int


def default_server_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Store(PartitionAuth):
    """All partitions of this server, their registration, and the stats snapshot."""

    def __init__(self, *, server_id: str | None = None,
                 answer_cache_steps: int = DEFAULT_ANSWER_CACHE_STEPS,
                 rate_window_s: float = DEFAULT_RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic,
                 checkpoint_root: str | Path | None = None,
                 max_state_bytes: int = 0, max_run_state_bytes: int = 0,
                 run_shares: int = DEFAULT_RUN_SHARES,
                 spill: SpillTier | None = None) -> None:
        """`checkpoint_root`: checkpoints only inside it (None: anywhere;
        ps/core/checkpoint_dirs.py); `max_state_bytes`: the bytes all partitions may hold,
        `max_run_state_bytes` those of one run (0: no limit); `run_shares`: the runs
        with dynamic tables the limit is shared among when `max_run_state_bytes` is 0
        (ps/core/limits.py); `spill`: the disk tier for state beyond a partition's share
        (ps/core/spill.py; None: off)."""
        if answer_cache_steps < 1:
            raise ValueError(f"answer_cache_steps={answer_cache_steps} must be >= 1")
        self.server_id = server_id or default_server_id()
        self.answer_cache_steps = answer_cache_steps
        self.rate_window_s = rate_window_s
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()  # guards the dicts/counters below (not the tensors)
        self._partitions: dict[tuple[str, int], Partition] = {}
        self._refusals: collections.Counter[str] = collections.Counter()
        self._queued: collections.Counter[TableKey] = collections.Counter()
        # (run_id, rank) -> Sync connections bound to it (a partition in use: see `bind`)
        self._bound: collections.Counter[tuple[str, int]] = collections.Counter()
        self.checkpoint_root = CheckpointRoot(checkpoint_root)
        self.budget = StateBudget(max_state_bytes, max_run_state_bytes, run_shares)
        self.spill = spill or SpillTier()
        self.runs_freed = 0
        self.partitions_freed = 0
        # run_id -> its state for the stats; the server sets it to its RunTracker's view
        # (ps/core/lifecycle.py), which follows Sync streams and Finish calls.
        self.run_state: Callable[[str], str] = lambda run_id: ""
        # (run_id, rank, table, seconds) of every answered push, from its first chunk's
        # arrival to its answer (ps/edge/metrics.py's latency histogram); None: not measured.
        self.push_observer: Callable[[str, int, str, float], None] | None = None

    # -- lookups ---------------------------------------------------------------------

    def partition(self, run_id: str, rank: int) -> Partition | None:
        return self._partitions.get((run_id, rank))

    def partitions(self) -> list[Partition]:
        with self._lock:
            return list(self._partitions.values())

    def resolve(self, run_id: str, rank: int, incarnation: int, table: str,
                what: str) -> tuple[Partition, TableState]:
        """The partition and table a push names, or the error saying why not."""
        part = self._partitions.get((run_id, rank))
        if part is None:
            check_run_id(run_id, what)
            raise NotRegistered(
                f"{what}: run {run_id!r} rank {rank} is not registered on this server "
                f"(server {self.server_id}); call Register before Sync"
            )
        if incarnation < part.incarnation:
            raise StaleIncarnation(
                f"{what}: incarnation {incarnation} is older than the registered incarnation "
                f"{part.incarnation}; a newer process of this rank has registered"
            )
        if incarnation > part.incarnation:
            raise NotRegistered(
                f"{what}: incarnation {incarnation} is newer than the registered incarnation "
                f"{part.incarnation}; register first"
            )
        state = part.tables.get(table)
        if state is None:
            problem = describe_problem("table name", table)
            if problem is not None:
                raise InvalidArgument(f"{what}: {problem}")
            raise NotFound(
                f"{what}: table {table!r} is not registered for run {run_id!r} rank {rank} "
                f"(registered: {sorted(part.tables)})"
            )
        return part, state

    # -- refusals and queue depth ----------------------------------------------------

    def record_refusal(self, reason: str, run_id: str = "", rank: int | None = None,
                       table: str = "") -> None:
        """Count a refused request globally and on what owns it: its (run, rank, table);
        a request that names no table, on its (run, rank), or (naming several ranks) on
        the run's first rank. A table that does not exist owns nothing."""
        with self._lock:
            self._refusals[reason] += 1
            if rank is None and not table:
                ranks = sorted(r for (run, r) in self._partitions if run == run_id)
                rank = ranks[0] if ranks else None
            part = self._partitions.get((run_id, rank)) if rank is not None else None
            if part is None:
                return
            if not table:
                part.refusals[reason] += 1
            elif table in part.tables:
                part.tables[table].refusals[reason] += 1

    def _queue_add(self, key: TableKey, n: int) -> None:
        with self._lock:
            self._queued[key] += n
            if self._queued[key] <= 0:
                del self._queued[key]

    # -- Register --------------------------------------------------------------------

    def register(self, run_id: str, rank: int, world_size: int, incarnation: int,
                 tables: Sequence[TableSpec],
                 optimizer: OptimizerSpec | Mapping[str, Any],
                 restore: tuple[str, int] | None = None,
                 row_dtype: torch.dtype = torch.float32,
                 secret: str = "", *, run_secret: str = "", restore_secret: str = "",
                 checkpoint_dir: str = "") -> list[RegisteredTable]:
        """`register_partition` without the secret it answers."""
        return self.register_partition(run_id, rank, world_size, incarnation, tables,
                                       optimizer, restore, row_dtype, secret,
                                       run_secret=run_secret, restore_secret=restore_secret,
                                       checkpoint_dir=checkpoint_dir)[0]

    def register_partition(self, run_id: str, rank: int, world_size: int, incarnation: int,
                           tables: Sequence[TableSpec],
                           optimizer: OptimizerSpec | Mapping[str, Any],
                           restore: tuple[str, int] | None = None,
                           row_dtype: torch.dtype = torch.float32,
                           secret: str = "", *, run_secret: str = "",
                           restore_secret: str = "", checkpoint_dir: str = ""
                           ) -> tuple[list[RegisteredTable], str]:
        """Register a partition; `restore` = (checkpoint directory, step) loads its state.
        Returns its tables and its secret, which every later call for it must carry.

        `row_dtype` other than float32: the partition keeps fp32 master rows (seeded by
        `seed_rows`, or loaded with `restore`) and answers new rows (ps/core/partition.py).
        `secret`: the partition secret the caller holds ('' if none). `run_secret`: the
        run's (hybridps/run_secret.py), kept as its sha256 with the partition: it proves
        a takeover of a partition with state (`_check_takeover`) and must own the
        directories the run checkpoints into; `restore_secret` may own the restored one
        instead. `checkpoint_dir`: the run's checkpoint directory, checked now (inside
        --checkpoint-root, claimed by the run secret) so a bad one fails before training.
        A partition created or taken over gets a new secret, and so does a newer
        incarnation.
        """
        digest = secret_digest(run_secret)
        try:
            if restore is not None:
                return self._register_restore(run_id, rank, world_size, incarnation,
                                              list(tables), optimizer, restore, row_dtype,
                                              secret, digest, secret_digest(restore_secret),
                                              checkpoint_dir)
            return self._register(run_id, rank, world_size, incarnation, list(tables),
                                  optimizer, row_dtype, secret, digest, checkpoint_dir)
        except ShardError as exc:
            self.record_refusal(exc.reason, run_id, rank)
            raise

    def _validate(self, run_id: str, rank: int, world_size: int, incarnation: int,
                  tables: list[TableSpec], optimizer: OptimizerSpec | Mapping[str, Any],
                  row_dtype: torch.dtype, digest: str = "", checkpoint_dir: str = ""
                  ) -> tuple[str, OptimizerSpec]:
        """Check a Register's arguments (nothing is allocated); (what, optimizer spec)."""
        check_run_id(run_id, "register")
        what = f"register run={run_id!r} rank={rank}"
        if world_size < 1:
            raise InvalidArgument(f"{what}: world_size={world_size} must be >= 1")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"{what}: rank={rank} must be in [0, world_size={world_size})")
        if incarnation < 0:
            raise InvalidArgument(f"{what}: incarnation={incarnation} must be >= 0")
        if not tables:
            raise InvalidArgument(f"{what}: at least one table is required")
        check_row_dtype(row_dtype, what)
        seen: set[str] = set()
        for spec in tables:
            spec.validate()
        for name in file_names(tables):  # tables and group members: checkpoint file names
            if name in seen:
                raise InvalidArgument(f"{what}: table name {name!r} appears twice")
            seen.add(name)
        spec_opt = optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(
            **dict(optimizer))
        if checkpoint_dir:  # --checkpoint-dir: refused now, not at the first checkpoint
            self.checkpoint_root.check_run_directory(checkpoint_dir, digest, what)
        return what, spec_opt

    def _state_bytes_in_use(self, run_id: str | None = None) -> int:
        """Bytes the partitions hold or reserved (a dynamic one's share, until its run
        is finished: it pages no more): all of them, or run `run_id`'s."""
        parts = [p for p in self.partitions() if run_id is None or p.run_id == run_id]
        finished = {run for run in {p.run_id for p in parts}
                    if self.run_state(run) == "finished"}
        return sum(p.state_bytes if p.run_id in finished else p.budget_bytes for p in parts)

    def _new_partition(self, run_id: str, rank: int, world_size: int, incarnation: int,
                       tables: list[TableSpec], optimizer: OptimizerSpec,
                       row_dtype: torch.dtype, what: str, freed: int = 0,
                       run_digest: str = "") -> Partition:
        """Allocate a partition within --max-state-bytes and --max-run-state-bytes
        (`freed`: bytes of the run's partitions this request replaces); ResourceExhausted
        with nothing allocated when it does not fit."""
        master = row_dtype != torch.float32
        fixed = [t.state_bytes(optimizer.kind, master) for t in tables]
        frames, fixed, disk = self._spill_plan(tables, optimizer, master, fixed, world_size,
                                               what)
        dynamic_fixed = [b for b, t in zip(fixed, tables, strict=True) if t.dynamic]
        needed, quotas = self.budget.paged_share(sum(fixed), dynamic_fixed, world_size, what)
        self.budget.reserve(needed, self._state_bytes_in_use(), what, freed, run_id=run_id,
                            run_in_use=self._state_bytes_in_use(run_id))
        try:
            self.spill.reserve(disk, what)
        except ShardError:
            self.budget.release(needed, run_id)
            raise
        try:
            part = Partition(run_id, rank, world_size, incarnation, tables, optimizer,
                             answer_cache_steps=self.answer_cache_steps,
                             rate_window_s=self.rate_window_s, clock=self._clock,
                             row_dtype=row_dtype, run_digest=run_digest,
                             columns_factory=self.spill.factory(frames) if disk else None)
        except BaseException:
            self.spill.release(disk)
            self.budget.release(needed, run_id)
            raise
        part.disk_reserved_bytes = disk
        try:
            part.reserved_bytes = needed
            dynamic = [(state, state.paging) for state in part.tables.values()
                       if state.paging is not None]
            disk_parts = self._paged_disk(quotas, world_size, disk)
            for (state, paging), quota, disk_part in zip(dynamic, quotas, disk_parts,
                                                         strict=True):
                # beyond its memory quota, its paged rows' payload spills to disk: they
                # are dropped only beyond both (ps/core/spill.py)
                layout = list(paging.store.layout)
                state.paged_quota, payload_frames = (quota, 0) if not disk_part else \
                    self.spill.paged_quota(state.spec.dim, layout, quota, disk_part,
                                           state.spec.rows_held, paging.store.row_bytes)
                # the id map sized once, the pools capped: a call puts at most one id
                # per slot before its drops
                paging.store.set_quota(state.paged_quota, state.spec.rows_held)
                if payload_frames:
                    payload = self.spill.paged_payload(state.spec.dim, layout,
                                                       paging.store.max_entries,
                                                       payload_frames)
                    paging.store.spill_payload(payload)
                    self.spill.reserve(payload.max_disk_bytes, what)
                    part.disk_reserved_bytes += payload.max_disk_bytes
            return part
        except BaseException:
            self._discard(part)
            raise
        finally:
            self.budget.release(needed, run_id)  # from here on the partition itself counts

    def _spill_plan(self, tables: list[TableSpec], optimizer: OptimizerSpec, master: bool,
                    fixed: list[int], world_size: int, what: str
                    ) -> tuple[dict[str, int], list[int], int]:
        """(frames of each table that spills, each table's fixed bytes in memory, disk
        bytes its spill files may take): a partition whose row columns exceed its share
        of the budget (half of it with dynamic tables: the other half is their paged
        rows') keeps that much in memory and spills the rest (ps/core/spill.py)."""
        share = self.budget.run_share // max(world_size, 1)
        if not self.spill.enabled or not share:
            return {}, fixed, 0
        layouts = [list(optimizer.state_widths(t.dim)) + ([(MASTER, t.dim)] if master
                                                          else []) for t in tables]
        memory = share // 2 if any(t.dynamic for t in tables) else share
        # the touched and changed flags stay in memory
        memory -= sum(SERVER_FLAG_BYTES_PER_ROW * t.rows_held for t in tables)
        memory -= sum(self.spill.bookkeeping_bytes(t.rows_held, layout)
                      for t, layout in zip(tables, layouts, strict=True))
        plan = self.spill.plan([(t.rows_held, layout) for t, layout in
                                zip(tables, layouts, strict=True)], memory, what)
        frames: dict[str, int] = {}
        held, disk = [], 0
        for t, layout, count, nbytes in zip(tables, layouts, plan, fixed, strict=True):
            page_rows = self.spill.page_rows(layout)
            if count and -(-t.rows_held // page_rows) > count:
                frames[t.name] = count
                disk += self.spill.disk_bytes(t.rows_held, layout)
                held.append(SERVER_FLAG_BYTES_PER_ROW * t.rows_held  # flags, slots, bookkeeping
                            + self.spill.held_bytes(t.rows_held, layout, count))
            else:
                held.append(nbytes)
        return frames, held, disk

    def _paged_disk(self, quotas: list[int], world_size: int, static_disk: int) -> list[int]:
        """The disk each dynamic table's paged rows may spill to beyond its memory
        quota: with --spill-max-gb, the partition's equal part of it (over --run-shares
        and the run's world size) less what its static state spills, split like the
        quotas; 0 each without (their rows are dropped beyond the memory quota)."""
        if not self.spill.enabled or not self.spill.max_bytes or not all(quotas) or \
                not quotas:
            return [0] * len(quotas)
        left = (self.spill.max_bytes // self.budget.run_shares // max(world_size, 1)
                - static_disk)
        if left <= 0:
            return [0] * len(quotas)
        total = sum(quotas)
        return [left * q // total for q in quotas]

    def _discard(self, part: Partition) -> None:
        """Release what a partition that is no longer held keeps outside memory: its spill
        files and their disk reservation, after the call in flight on it, if any."""
        with part.lock:
            part.close()
        self.spill.release(part.disk_reserved_bytes)

    def _register(self, run_id: str, rank: int, world_size: int, incarnation: int,
                  tables: list[TableSpec], optimizer: OptimizerSpec | Mapping[str, Any],
                  row_dtype: torch.dtype, secret: str, digest: str, checkpoint_dir: str
                  ) -> tuple[list[RegisteredTable], str]:
        what, spec_opt = self._validate(run_id, rank, world_size, incarnation, tables,
                                        optimizer, row_dtype, digest, checkpoint_dir)
        existing = self.partition(run_id, rank)
        if existing is None:
            self._check_run_consistency(run_id, rank, world_size, tables, what)
            fresh = self._new_partition(run_id, rank, world_size, incarnation, tables,
                                        spec_opt, row_dtype, what, run_digest=digest)
            with self._lock:
                existing = self._partitions.get((run_id, rank))
                if existing is None:  # nobody registered it while we allocated
                    self._partitions[(run_id, rank)] = fresh
            if existing is not None:
                self._discard(fresh)
            if existing is None:
                log.info(kv("register", run=run_id, rank=rank, world_size=world_size,
                            incarnation=incarnation, created=True,
                            tables=",".join(t.describe() for t in tables),
                            optimizer=optimizer_description(spec_opt),
                            row_dtype=ROW_DTYPES[row_dtype]))
                return ([RegisteredTable(t.name, t.rows_held, -1, True) for t in tables],
                        fresh.secret)

        with existing.lock:
            diff = existing.difference(world_size, tables, spec_opt, row_dtype)
            if diff is not None:
                raise Conflict(f"{what}: does not match the registered partition: {diff}")
            if incarnation < existing.incarnation:
                raise StaleIncarnation(
                    f"{what}: incarnation {incarnation} is older than the registered "
                    f"incarnation {existing.incarnation}"
                )
            takeover = self._check_takeover(existing, secret, digest, None, what)
            previous = existing.incarnation
            existing.incarnation = incarnation
            if takeover:  # nothing pushed yet: the partition is the new process's run's
                existing.run_digest = digest
            if takeover or incarnation > previous:
                existing.new_secret()
            handed_out = existing.secret
            result = [RegisteredTable(t.spec.name, t.spec.rows_held, t.last_step, False)
                      for t in existing.tables.values()]
        log.info(kv("register", run=run_id, rank=rank, incarnation=incarnation,
                    previous_incarnation=previous, created=False, takeover=takeover,
                    last_steps=",".join(f"{t.name}:{t.last_step}" for t in result)))
        return result, handed_out

    def _register_restore(self, run_id: str, rank: int, world_size: int, incarnation: int,
                          tables: list[TableSpec], optimizer: OptimizerSpec | Mapping[str, Any],
                          restore: tuple[str, int], row_dtype: torch.dtype,
                          secret: str, digest: str, restore_digest: str,
                          checkpoint_dir: str) -> tuple[list[RegisteredTable], str]:
        """Register from a checkpoint: a fresh partition loaded for this rank's ranges.

        It replaces the rank's partition if one is held (the run restarts from the
        checkpoint), and drops partitions of the run registered with another
        world size (the previous shape of a re-sharded run). Every file it will read is
        checked against the manifest first: a damaged checkpoint (CorruptCheckpoint,
        naming the file) or any other refusal leaves every partition as it was. The
        rank's own partition is replaced only under the takeover rule; another rank's
        (of the previous world size) only when no Sync connection uses it and it is of
        the same run secret. The checkpoint must be in a directory claimed by the
        caller's run secret (`digest`) or restore secret (ps/core/checkpoint_dirs.py).
        """
        from ps.core.checkpoint import check_restore, restore_partition

        directory, step = restore
        started = time.perf_counter()
        what, spec_opt = self._validate(run_id, rank, world_size, incarnation, tables,
                                        optimizer, row_dtype, digest, checkpoint_dir)
        if not directory or step < 0:
            raise InvalidArgument(f"{what}: restore needs a checkpoint directory and a step "
                                  f">= 0 (got {directory!r}, {step})")
        path = self.checkpoint_root.check_restore(directory, [digest, restore_digest],
                                                  f"{what} restore")
        held = self.partition(run_id, rank)
        if held is not None and incarnation < held.incarnation:
            raise StaleIncarnation(
                f"{what}: incarnation {incarnation} is older than the registered "
                f"incarnation {held.incarnation}")
        if held is not None:
            self._check_takeover(held, secret, digest, step, what)
        self._check_unused(run_id, rank, world_size, digest, what)
        checked = held  # the partition the takeover rule allowed to replace
        check_restore(tables, spec_opt, row_dtype != torch.float32, path, step)

        def replaced() -> list[tuple[str, int]]:
            return [key for key, p in self._partitions.items()
                    if key[0] == run_id and (key[1] == rank or p.world_size != world_size)]

        with self._lock:
            freed = sum(self._partitions[key].budget_bytes for key in replaced())
        others = [p for p in self.partitions() if p.run_id == run_id and p.rank != rank
                  and p.world_size == world_size]
        self._check_consistency(others, rank, world_size, tables, what)
        part = self._new_partition(run_id, rank, world_size, incarnation, tables, spec_opt,
                                   row_dtype, what, freed, run_digest=digest)
        try:
            with part.lock:
                restore_partition(part, path, step, checked=True)
            with self._lock:
                held = self._partitions.get((run_id, rank))
                if held is not None and incarnation < held.incarnation:
                    raise StaleIncarnation(
                        f"{what}: incarnation {incarnation} is older than the registered "
                        f"incarnation {held.incarnation} (registered meanwhile)")
                if held is not checked:
                    raise Conflict(f"{what}: the partition was registered again meanwhile; "
                                   "retry the Register")
                stale = replaced()
                gone = [self._partitions.pop(key) for key in stale]
                self._partitions[(run_id, rank)] = part
        except BaseException:
            self._discard(part)
            raise
        for old in gone:
            self._discard(old)
        log.info(kv("restore", run=run_id, rank=rank, world_size=world_size,
                    incarnation=incarnation, step=step, directory=path,
                    dropped=len(stale), seconds=f"{time.perf_counter() - started:.3f}"))
        return ([RegisteredTable(t.spec.name, t.spec.rows_held, t.last_step, True)
                 for t in part.tables.values()], part.secret)

    def drop_run(self, run_id: str, why: str) -> tuple[int, int]:
        """Forget every partition of `run_id` (its memory goes with the last push in
        flight): (partitions, state bytes) freed. Counted in stats when any was held."""
        check_run_id(run_id, "drop run")
        with self._lock:
            keys = [key for key in self._partitions if key[0] == run_id]
            parts = [self._partitions.pop(key) for key in keys]
            if parts:
                self.runs_freed += 1
                self.partitions_freed += len(parts)
        freed = sum(p.state_bytes for p in parts)
        for part in parts:
            self._discard(part)
        if parts:
            log.info(kv("run_freed", run=run_id, partitions=len(parts), state_bytes=freed,
                        why=why))
        return len(parts), freed

    def seed_rows(self, run_id: str, rank: int, incarnation: int, table: str, row_start: int,
                  rows_ND: torch.Tensor) -> tuple[int, int]:
        """Seed master rows of a registered partition: (rows seeded so far, rows held)."""
        what = (f"seed run={run_id!r} rank={rank} table={table!r} rows from {row_start}")
        try:
            part, state = self.resolve(run_id, rank, incarnation, table, what)
            with part.lock:
                seeded = state.seed(row_start, rows_ND, what)
            if seeded == state.spec.rows_held and row_start + rows_ND.shape[0] == \
                    state.spec.row_end:
                log.info(kv("seeded", run=run_id, rank=rank, table=table, rows=seeded,
                            master_bytes=state.master_bytes))
            return seeded, state.spec.rows_held
        except ShardError as exc:
            self.record_refusal(exc.reason, run_id, rank, table)
            raise

    def checkpoint(self, run_id: str, ranks: Sequence[int], step: int,
                   directory: str, since: int | None = None) -> list[tuple[int, Any]]:
        """Save the partitions of `ranks` (all of the run when empty) at exactly `step`,
        into a step directory of a run directory their run secret claimed
        (ps/core/checkpoint_dirs.py); `since` S: incremental, only what changed since
        their checkpoint of step S (ps/core/checkpoint.py save_partition). Each
        partition's state is copied under its lock and written without it: a push of a
        later step applies meanwhile, never into the files (the copy is one partition's
        state at a time), and marks the rows of the next delta."""
        write, _ = self.checkpoint_write(run_id, ranks, step, directory, since, deferred=False)
        return write()

    def checkpoint_write(self, run_id: str, ranks: Sequence[int], step: int, directory: str,
                         since: int | None = None, *, deferred: bool
                         ) -> tuple[Callable[[], list[tuple[int, Any]]], int]:
        """(the write of `checkpoint`, which any thread may run once; the bytes of the
        largest partition copy taken now), after the request's checks. `deferred`: every
        partition's copy is taken now (the checkpoint of `step` while later pushes apply:
        the two-step Checkpoint) and the write only writes them; else each partition is
        copied and written in turn inside the write."""
        from ps.core.checkpoint import PartitionSnapshot, snapshot_partition, unsave

        what = f"checkpoint run={run_id!r}"
        files = contextlib.ExitStack()  # the step directory's writer, closed by the write
        copies: list[PartitionSnapshot] = []
        copied: list[Partition] = []  # whose saved step is this checkpoint's now
        try:
            check_run_id(run_id, "checkpoint")
            parts = sorted((p for p in self.partitions()
                            if p.run_id == run_id and (not ranks or p.rank in ranks)),
                           key=lambda p: p.rank)
            missing = set(ranks) - {p.rank for p in parts}
            if not parts or missing:
                self.checkpoint_root.resolve(directory, what)  # a bad directory first
                raise NotRegistered(f"checkpoint: run {run_id!r}: rank(s) "
                                    f"{sorted(missing) or 'any'} not registered on this server")
            path, writer = files.enter_context(self.checkpoint_root.step_writer(
                directory, [p.run_digest for p in parts], what))
            for part in parts if deferred else ():
                with part.lock:
                    copies.append(snapshot_partition(part, step, since))
                copied.append(part)
        except BaseException as exc:
            files.close()
            if isinstance(exc, ShardError):
                self.record_refusal(exc.reason, run_id)
            raise

        def write() -> list[tuple[int, Any]]:
            started = time.perf_counter()
            out: list[tuple[int, Any]] = []
            snapshot_bytes = 0
            try:
                with files:
                    for part in parts:
                        if deferred:
                            snapshot = copies.pop(0)  # freed once written
                        else:
                            with part.lock:
                                snapshot = snapshot_partition(part, step, since)
                            copied.append(part)
                        snapshot_bytes = max(snapshot_bytes, snapshot.nbytes)
                        try:
                            out.extend((part.rank, info)
                                       for info in snapshot.write(path, writer))
                        except OSError as exc:  # e.g. a name too long: the request's fault
                            raise write_refusal(exc, path, what) from exc
                        del snapshot
            except BaseException as exc:
                for part in copied:  # never the parent of a delta
                    with part.lock:
                        unsave(part, step)
                if isinstance(exc, ShardError):
                    self.record_refusal(exc.reason, run_id)
                raise
            log.info(kv("checkpoint", run=run_id, ranks=",".join(str(p.rank) for p in parts),
                        step=step, directory=path, files=len(out), deferred=deferred,
                        snapshot_bytes=snapshot_bytes,
                        seconds=f"{time.perf_counter() - started:.3f}"))
            return out

        return write, max((c.nbytes for c in copies), default=0)

    def page(self, run_id: str, rank: int, incarnation: int, table: str,
             call: PageCall) -> PageResult:
        """A dynamic table's Page call (ps/core/paging.py), under the partition's lock."""
        what = (f"page run={run_id!r} rank={rank} table={table!r} step={call.step} "
                f"seq={call.seq}")
        try:
            part, state = self.resolve(run_id, rank, incarnation, table, what)
            if state.paging is None:
                raise InvalidArgument(f"{what}: table {table!r} is not dynamic")

            def over_budget() -> int:
                # the table's own bytes against its own quota (ps/core/limits.py): a drop
                # depends only on this table's history, not on other ranks' timing
                quota = state.paged_quota
                return state.paged_bytes - quota if quota else 0

            with part.lock:
                result, repeat = state.paging.page(state, call, what, over_budget)
                if call.counters:
                    state.paging.counters = dict(call.counters)
            if result.dropped.size and not repeat:
                log.info(kv("paged_dropped", run=run_id, rank=rank, table=table,
                            step=call.step, ids=result.dropped.size))
            return result
        except ShardError as exc:
            self.record_refusal(exc.reason, run_id, rank, table)
            raise

    def _check_run_consistency(self, run_id: str, rank: int, world_size: int,
                               tables: list[TableSpec], what: str) -> None:
        """Other ranks of the run on this server must agree on world_size and table shapes."""
        others = [p for p in self.partitions() if p.run_id == run_id and p.rank != rank]
        self._check_consistency(others, rank, world_size, tables, what)

    @staticmethod
    def _check_consistency(others: list[Partition], rank: int, world_size: int,
                           tables: list[TableSpec], what: str) -> None:
        for other in others:
            if other.world_size != world_size:
                raise Conflict(f"{what}: world_size {world_size} != {other.world_size} "
                               f"registered by rank {other.rank} of the run")
            for spec in tables:
                theirs = other.tables.get(spec.name)
                if theirs is None:
                    continue
                o = theirs.spec
                if (o.num_rows, o.dim) != (spec.num_rows, spec.dim):
                    raise Conflict(
                        f"{what}: table {spec.describe()} has a different shape than "
                        f"{o.describe()} registered by rank {other.rank}"
                    )
                if spec.row_start < o.row_end and o.row_start < spec.row_end:
                    raise Conflict(
                        f"{what}: rows [{spec.row_start}, {spec.row_end}) of table "
                        f"{spec.name!r} overlap rows [{o.row_start}, {o.row_end}) held by "
                        f"rank {other.rank}"
                    )

    # -- Sync ------------------------------------------------------------------------

    def open_session(self) -> SyncSession:
        return SyncSession(self)

    # -- Flush -----------------------------------------------------------------------

    def flush_status(self, run_id: str, rank: int,
                     step: int) -> tuple[list[RankStep], list[RankStep]]:
        """(every named (rank, table) with its last step, those still before `step`)."""
        check_run_id(run_id, "flush")
        if rank < -1:
            raise InvalidArgument(f"flush run={run_id!r}: rank={rank} must be >= 0 or -1 (all)")
        parts = [p for p in self.partitions()
                 if p.run_id == run_id and (rank == -1 or p.rank == rank)]
        if not parts:
            who = "no rank of it" if rank == -1 else f"rank {rank} is not"
            raise NotRegistered(f"flush: run {run_id!r}: {who} registered on this server")
        applied = [RankStep(p.rank, name, t.last_step)
                   for p in sorted(parts, key=lambda p: p.rank)
                   for name, t in p.tables.items()]
        return applied, [r for r in applied if r.last_step < step]

    # -- GetShardStats ---------------------------------------------------------------

    def stats(self, run_id: str = "") -> ServerStats:
        """A snapshot; counters are read without the partition locks (ints, GIL-atomic)."""
        parts = sorted((p for p in self.partitions() if not run_id or p.run_id == run_id),
                       key=lambda p: (p.run_id, p.rank))
        with self._lock:
            queued = dict(self._queued)
            refusals = dict(self._refusals)
        states = {run: self.run_state(run) for run in {p.run_id for p in parts}}
        rows = partition_rows(parts, queued, states)
        return ServerStats(
            server_id=self.server_id,
            uptime_s=self._clock() - self._started,
            partitions=rows,
            refusals=refusals,
            state_bytes_total=sum(r.state_bytes for r in rows),
            pushes_applied_total=sum(r.pushes_applied for r in rows),
            rows_updated_total=sum(r.rows_updated for r in rows),
            master_bytes_total=sum(r.master_bytes for r in rows),
            dynamic_held_bytes_total=sum(r.dynamic_held_bytes for r in rows),
            runs_freed=self.runs_freed,
            partitions_freed=self.partitions_freed,
            max_state_bytes=self.budget.limit_bytes,
            spill_disk_bytes_total=sum(r.spill_disk_bytes for r in rows),
            spill_max_bytes=self.spill.max_bytes, spill_enabled=self.spill.enabled,
        )
