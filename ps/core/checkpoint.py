"""A server partition's optimizer state to and from a checkpoint (format: hybridps.checkpoint).

The files are per table: a group (ps/core/table_members.py) is written as its member tables,
each file holding the member's slice of the group's optimizer state and master rows and the
group's step count (every member of a group is pushed with it, every step), and read
back into those slices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

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
from hybridps.dynamic_files import restore_plan, save_paged
from hybridps.errors import Conflict
from hybridps.optim import OptimizerSpec
from ps.core.partition import MASTER, Partition, TableSpec, TableState
from ps.core.table_members import pieces

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
    Page calls). A dynamic table's paged-out rows are written whole.
    The caller holds `part.lock` (no push applies while the files are written).
    """
    for name, t in part.tables.items():
        if t.last_step != step:
            raise Conflict(f"checkpoint {part.where} table {name!r} at step {step}: the last "
                           f"applied step is {t.last_step}; a checkpoint needs exactly {step}")
        if since is not None and (t.saved_step != since or t.changed is None):
            raise Conflict(f"incremental checkpoint {part.where} table {name!r} at step "
                           f"{step} since step {since}: the last checkpoint saved of it is "
                           f"of step {t.saved_step}; write a full one")
    out = []
    for t in part.tables.values():
        out.extend(write_table(part, t, directory, step, writer, since))
    for t in part.tables.values():  # every file written: the next delta starts here
        if t.changed is None:
            t.changed = torch.zeros(t.spec.rows_held, dtype=torch.bool)
        else:
            t.changed.zero_()
        t.saved_step = step
    return out


def write_table(part: Partition, t: TableState, directory: str | Path, step: int,
                writer: Writer | None, since: int | None) -> list[ShardInfo]:
    """The files of one partition table (its members' optim files, its paged-out rows)."""
    out = []
    opt = dataclasses.asdict(part.optimizer)
    for p in pieces(t.spec):
        changed = t.changed
        ids = (None if since is None or changed is None
               else changed[p.lo:p.hi].nonzero().squeeze(1) + p.row_start)
        state, master = (_piece_state(t, p.lo, p.hi) if ids is None
                         else _rows_state(t, ids - p.row_start + p.lo))
        out.append(save_optim_state(
            directory, table=p.name, rank=part.rank, num_rows=p.num_rows,
            dim=t.spec.dim, row_start=p.row_start, row_end=p.row_end,
            state=OptimState(state, t.adam_step, t.last_step, master),
            optimizer=opt, incarnation=part.incarnation, writer=writer, ids=ids))
    if t.paging is not None:  # a dynamic table's paged-out rows
        out.append(save_paged(directory, table=t.spec.name, rank=part.rank,
                              start=t.spec.row_start, end=t.spec.row_end,
                              store=t.paging.store, step=step, writer=writer))
    return out


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
