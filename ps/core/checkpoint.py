"""A server partition's optimizer state to and from a checkpoint (format: hybridps.checkpoint).

The files are per table: a group (ps/core/table_members.py) is written as its member tables,
each file holding the member's slice of the group's optimizer state and master rows and the
group's step count (every member of a group is pushed with it, every step), and read
back into those slices."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridps.checkpoint import (
    Manifest,
    OptimState,
    ShardInfo,
    Writer,
    load_optim_state,
    save_optim_state,
    verify_shards,
)
from hybridps.dynamic_files import restore_plan, save_paged_state
from hybridps.errors import Conflict, NotFound
from hybridps.optim import OptimizerSpec
from ps.core.faults import write_fault
from ps.core.partition import MASTER, Partition, TableSpec, TableState
from ps.core.table_members import Piece, pieces

# rows a restore reads back at a time to widen the overflow bound and mark touched rows
# (a spilled table's pages are read from its spill file, a bounded buffer at a time)
OBSERVE_ROWS = 1 << 20


def _piece_state(t: TableState, lo: int, hi: int
                 ) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """Rows [lo, hi) of a table's optimizer state and master rows, wherever they are held
    (in memory, or in its spill file: read back, the spill file is never the recovery
    source)."""
    cols = t.columns.read(lo, hi)
    state: dict[str, torch.Tensor | None] = {n: x for n, x in cols.items() if n != MASTER}
    return state, cols.get(MASTER)


def _rows_state(t: TableState, local: torch.Tensor
                ) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """Rows `local` (sorted positions in the table) of its optimizer state and master rows,
    wherever they are held, read OBSERVE_ROWS at a time."""
    states: list[dict[str, torch.Tensor]] = []
    masters: list[torch.Tensor] = []
    for i in range(0, max(int(local.numel()), 1), OBSERVE_ROWS):
        by_name, master, at = t.state_view(local[i:i + OBSERVE_ROWS], write=False)
        states.append({n: x[at] for n, x in by_name.items()})
        if master is not None:
            masters.append(master[at])
    state: dict[str, torch.Tensor | None] = {
        n: torch.cat([s[n] for s in states]) for n in states[0]}
    return state, torch.cat(masters) if masters else None


def save_partition(part: Partition, directory: str | Path, step: int,
                   writer: Writer | None = None, since: int | None = None) -> list[ShardInfo]:
    """Write every table of a partition whose last applied step is exactly `step`
    (through `writer`: ps/core/checkpoint_dirs.py; None: by path).

    `since` S: an incremental checkpoint whose parent is the checkpoint of step S (the
    last one saved of every table: Conflict otherwise): each optim file is a delta
    shard of the rows whose state changed since then (`TableState.changed`: pushes and
    Page calls), and a dynamic table's paged-out rows a delta (PagedRows.checkpoint_state).
    The caller holds `part.lock` (no push applies while the files are written)."""
    return snapshot_partition(part, step, since).write(directory, writer)


@dataclass
class PartitionSnapshot:
    """A partition's optimizer state of one step, copied (`snapshot_partition`): written
    without the partition's lock, while the pushes of the next steps apply."""

    where: str
    rank: int
    incarnation: int
    optimizer: dict[str, Any]
    step: int
    # (member, dim, its state, the global rows of a delta shard: None, the whole member)
    pieces: list[tuple[Piece, int, OptimState, torch.Tensor | None]]
    paged: list[tuple[str, int, int, dict[str, Any]]]  # (table, start, end, store state)
    nbytes: int

    def write(self, directory: str | Path, writer: Writer | None = None) -> list[ShardInfo]:
        out = []
        for p, dim, state, ids in self.pieces:
            out.append(save_optim_state(directory, table=p.name, rank=self.rank,
                                        num_rows=p.num_rows, dim=dim, row_start=p.row_start,
                                        row_end=p.row_end, state=state,
                                        optimizer=self.optimizer,
                                        incarnation=self.incarnation, writer=writer, ids=ids))
            write_fault(self.step)
        out.extend(save_paged_state(directory, table=table, rank=self.rank, start=start,
                                    end=end, state=state, step=self.step, writer=writer)
                   for table, start, end, state in self.paged)
        return out


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def snapshot_partition(part: Partition, step: int,
                       since: int | None = None) -> PartitionSnapshot:
    """A copy of every table's state of a partition whose last applied step is exactly
    `step` (a Conflict otherwise); `since` S: only the rows changed since the checkpoint
    of step S (save_partition). The caller holds `part.lock`; the copy is one
    partition's state (its m, v, masters, read through its row columns wherever they
    are held; a dynamic table's paged-out rows). The changed marks restart here: the
    pushes applied after the copy are the next checkpoint's delta."""
    for name, t in part.tables.items():
        if t.last_step != step:
            raise Conflict(f"checkpoint {part.where} table {name!r} at step {step}: the last "
                           f"applied step is {t.last_step}; a checkpoint needs exactly {step}")
        if since is not None and (t.saved_step != since or t.changed is None):
            raise Conflict(f"incremental checkpoint {part.where} table {name!r} at step "
                           f"{step} since step {since}: the last checkpoint saved of it is "
                           f"of step {t.saved_step}; write a full one")
    held: list[tuple[Piece, int, OptimState, torch.Tensor | None]] = []
    paged = []
    nbytes = 0
    for t in part.tables.values():
        for p in pieces(t.spec):
            ids, state, master = _piece_copy(t, p, since)
            nbytes += sum(x.numel() * x.element_size() for x in (*state.values(), master)
                          if x is not None)
            held.append((p, t.spec.dim, OptimState(state, t.adam_step, t.last_step, master),
                         ids))
        if t.paging is not None:  # a dynamic table's paged-out rows (their own arrays)
            paged.append((t.spec.name, t.spec.row_start, t.spec.row_end,
                          t.paging.store.checkpoint_state(step, since)))
    for t in part.tables.values():  # every row copied: the next delta starts here
        if t.changed is None:
            t.changed = torch.zeros(t.spec.rows_held, dtype=torch.bool)
        else:
            t.changed.zero_()
        t.saved_step = step
    return PartitionSnapshot(part.where, part.rank, part.incarnation,
                             dataclasses.asdict(part.optimizer), step, held, paged, nbytes)


def unsave(part: Partition, step: int) -> None:
    """The checkpoint of `step` failed to write: no delta may name it as its parent (an
    incremental request since it is refused; the next one is full). The caller holds
    `part.lock`."""
    for t in part.tables.values():
        if t.saved_step == step:
            t.saved_step = -1


def _piece_copy(t: TableState, p: Piece, since: int | None
                ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None],
                           torch.Tensor | None]:
    """(the global rows of a delta shard, None: every row; a copy of their optimizer
    state; of their master rows) of one member of a table."""
    changed = t.changed
    if since is None or changed is None:
        state, master = _piece_state(t, p.lo, p.hi)  # views of held rows: copied
        return None, {n: _copy(x) for n, x in state.items()}, _copy(master)
    ids = changed[p.lo:p.hi].nonzero().squeeze(1) + p.row_start
    state, master = _rows_state(t, ids - p.row_start + p.lo)  # gathered: copies already
    return ids, state, master


def check_restore(specs: Sequence[TableSpec], optimizer: OptimizerSpec, master: bool,
                  directory: str | Path, step: int) -> None:
    """Everything `restore_partition` will read for tables `specs`, checked without
    copying a tensor: the manifest, every file against its size and crc32, the files'
    headers and metadata. Raises (CorruptCheckpoint naming the file, Conflict, NotFound)
    before any state changes."""
    for s in specs:
        counts = set()
        for p in pieces(s):
            state = load_optim_state(directory, table=p.name, num_rows=p.num_rows, dim=s.dim,
                                     row_start=p.row_start, row_end=p.row_end, step=step,
                                     optimizer=dataclasses.asdict(optimizer), master=master,
                                     dry_run=True)
            counts.add(state.adam_step)
        if len(counts) > 1:  # one step count per group: its members' must agree
            raise Conflict(f"checkpoint {directory}: the tables of group {s.name!r} were "
                           f"saved with different optimizer step counts {sorted(counts)}")
        if s.dynamic:  # its slot maps and paged-out rows
            manifest = Manifest.read(directory)
            verify_shards(directory, [*manifest.shards(s.name, "ids"),
                                      *manifest.shards(s.name, "paged")])


def restore_partition(part: Partition, directory: str | Path, step: int,
                      checked: bool = False) -> None:
    """Load a fresh partition's state for its row ranges from checkpoint `directory`.

    Every table's files are checked first (check_restore; `checked`: the caller did),
    so a damaged checkpoint changes nothing."""
    if not checked:
        check_restore(part.specs(), part.optimizer, part.row_dtype != torch.float32,
                      directory, step)
    opt = dataclasses.asdict(part.optimizer)
    for t in part.tables.values():
        s = t.spec
        for p in pieces(s):
            state = load_optim_state(directory, table=p.name, num_rows=p.num_rows, dim=s.dim,
                                     row_start=p.row_start, row_end=p.row_end, step=step,
                                     optimizer=opt, master=t.has_master,
                                     verify=False)
            values = {n: x for n, x in state.state.items()
                      if x is not None and n in dict(t.columns.layout)}
            if t.has_master and state.master is not None:
                values[MASTER] = state.master
            t.columns.write(p.lo, values)
            t.adam_step = state.adam_step
        if t.has_master:
            t.rows_seeded = s.rows_held
        if t.paging is not None:
            _restore_paged(part, t, directory)
        marks = part.optimizer.record.touched_from  # the accumulated g^2: 0 untouched
        for lo in range(0, s.rows_held, OBSERVE_ROWS):
            hi = min(lo + OBSERVE_ROWS, s.rows_held)
            held, master = _piece_state(t, lo, hi)
            squares = held.get(marks) if marks is not None else None
            if squares is not None:
                t.touched[lo:hi].copy_((squares != 0).any(dim=1))
            t.bound.observe(held, master)  # what the loaded state holds
        t.distinct_touched = int(t.touched.sum())
        t.last_step = step
        t.answers.clear()


def _restore_paged(part: Partition, t: TableState, directory: str | Path) -> None:
    """A dynamic table: the paged-out rows this rank owns now, and no optimizer state on
    the slots whose id went to another owner (hybridps/dynamic_files.py)."""
    assert t.paging is not None
    s = t.spec
    plan = restore_plan(directory, Manifest.read(directory), s.name, s.dim,
                        t.paging.store.layout, part.rank, part.world_size, s.row_start,
                        s.row_end, verify=False)
    gone = torch.from_numpy(~plan.kept).nonzero().squeeze(1)
    t.columns.fill(gone, [n for n, _ in t.paging.store.layout])
    t.paging.store.load(plan.paged, plan.tombstones, plan.counters)


# -- deferred writes: the two-step Checkpoint (snapshot now, durable later) -----------------

WriteKey = tuple[str, tuple[int, ...]]  # (run id, ranks)


@dataclass
class _InFlight:
    step: int
    directory: str
    done: Future[list[tuple[int, Any]]]


class DeferredWrites:
    """The background writes of deferred checkpoints (shard.proto Checkpoint `deferred`),
    in `threads` threads of their own (the ranks of a server write their files side by
    side, and the update pool stays free for pushes): a checkpoint's copy is taken at its
    request, its files written here while the pushes of the next steps apply, and `done`
    hands over the files once durable, or the write's error. The last write of each
    (run, ranks) is kept until the next one of the same ranks replaces it, so a repeated
    CheckpointDone is answered again."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ps-checkpoint")
        self._lock = threading.Lock()
        self._writes: dict[WriteKey, _InFlight] = {}

    @staticmethod
    def key(run_id: str, ranks: Sequence[int]) -> WriteKey:
        return run_id, tuple(sorted(set(ranks)))

    def previous(self, run_id: str, ranks: Sequence[int]) -> Future[Any] | None:
        """The write of the last checkpoint of these ranks (a new one waits for it)."""
        with self._lock:
            held = self._writes.get(self.key(run_id, ranks))
        return None if held is None else held.done

    def start(self, run_id: str, ranks: Sequence[int], step: int, directory: str,
              write: Callable[[], list[tuple[int, Any]]]) -> Future[list[tuple[int, Any]]]:
        done = self._pool.submit(write)
        with self._lock:
            self._writes[self.key(run_id, ranks)] = _InFlight(step, directory, done)
        return done

    def done(self, run_id: str, ranks: Sequence[int], step: int,
             directory: str) -> Future[list[tuple[int, Any]]]:
        """The write of that checkpoint (NotFound unless it is the last one of `ranks`)."""
        with self._lock:
            held = self._writes.get(self.key(run_id, ranks))
        if held is None or (held.step, held.directory) != (step, directory):
            last = "none" if held is None else f"step {held.step} into {held.directory!r}"
            raise NotFound(f"checkpoint done run={run_id!r} ranks={sorted(set(ranks))} step "
                           f"{step} into {directory!r}: no such deferred checkpoint on this "
                           f"server (its last one of these ranks: {last})")
        return held.done

    def shutdown(self) -> None:
        """Every write already started completes (the server stops after it)."""
        self._pool.shutdown(wait=True)
