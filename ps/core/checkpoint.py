"""A server partition's optimizer state to and from a checkpoint (format: hybridps.checkpoint).

The files are per table: a group (ps/core/table_members.py) is written as its member tables,
each file holding the member's slice of the group's optimizer state and master rows and the
group's step count (every member of a group is pushed with it, every step), and read
back into those slices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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
from hybridps.errors import Conflict
from hybridps.optim import OptimizerSpec
from ps.core.partition import Partition, TableSpec, TableState
from ps.core.table_members import Piece, pieces


def _rows(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


def save_partition(part: Partition, directory: str | Path, step: int,
                   writer: Writer | None = None) -> list[ShardInfo]:
    """Write every table of a partition whose last applied step is exactly `step`
    (through `writer`: ps/core/checkpoint_dirs.py; None: by path).

    The caller holds `part.lock` (no push applies while the files are written)."""
    return snapshot_partition(part, step).write(directory, writer)


@dataclass
class PartitionSnapshot:
    """A partition's optimizer state of one step, copied (`snapshot_partition`): written
    without the partition's lock, while the pushes of the next steps apply."""

    where: str
    rank: int
    incarnation: int
    optimizer: dict[str, Any]
    step: int
    pieces: list[tuple[Piece, int, OptimState]]  # (member, dim, its state)
    paged: list[tuple[str, int, int, dict[str, Any]]]  # (table, start, end, store state)
    nbytes: int

    def write(self, directory: str | Path, writer: Writer | None = None) -> list[ShardInfo]:
        out = [save_optim_state(directory, table=p.name, rank=self.rank, num_rows=p.num_rows,
                                dim=dim, row_start=p.row_start, row_end=p.row_end,
                                state=state, optimizer=self.optimizer,
                                incarnation=self.incarnation, writer=writer)
               for p, dim, state in self.pieces]
        out.extend(save_paged_state(directory, table=table, rank=self.rank, start=start,
                                    end=end, state=state, step=self.step, writer=writer)
                   for table, start, end, state in self.paged)
        return out


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone(memory_format=torch.contiguous_format)


def snapshot_partition(part: Partition, step: int) -> PartitionSnapshot:
    """A copy of every table's state of a partition whose last applied step is exactly
    `step` (a Conflict otherwise). The caller holds `part.lock`; the copy is one
    partition's state (its m, v, masters; a dynamic table's paged-out rows)."""
    for name, t in part.tables.items():
        if t.last_step != step:
            raise Conflict(f"checkpoint {part.where} table {name!r} at step {step}: the last "
                           f"applied step is {t.last_step}; a checkpoint needs exactly {step}")
    held: list[tuple[Piece, int, OptimState]] = []
    paged = []
    nbytes = 0
    for t in part.tables.values():
        for p in pieces(t.spec):
            state = {n: _copy(x[p.lo:p.hi]) for n, x in t.state.items()}
            master = _copy(_rows(t.master, p.lo, p.hi))
            nbytes += sum(x.numel() * x.element_size() for x in (*state.values(), master)
                          if x is not None)
            held.append((p, t.spec.dim, OptimState(state, t.adam_step, t.last_step, master)))
        if t.paging is not None:  # a dynamic table's paged-out rows (their own arrays)
            paged.append((t.spec.name, t.spec.row_start, t.spec.row_end,
                          t.paging.store.state_dict()))
    return PartitionSnapshot(part.where, part.rank, part.incarnation,
                             dataclasses.asdict(part.optimizer), step, held, paged, nbytes)


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
                                     optimizer=opt, master=t.master is not None,
                                     verify=False)
            if t.master is not None and state.master is not None:
                t.master[p.lo:p.hi].copy_(state.master)
            for name, held in t.state.items():
                saved = state.state.get(name)
                if saved is not None:
                    held[p.lo:p.hi].copy_(saved)
            t.adam_step = state.adam_step
        if t.master is not None:
            t.rows_seeded = s.rows_held
        if t.paging is not None:
            _restore_paged(part, t, directory)
        marks = part.optimizer.record.touched_from  # the accumulated g^2: 0 untouched
        squares = t.state.get(marks) if marks is not None else None
        if squares is not None:
            t.touched.copy_((squares != 0).any(dim=1))
            t.distinct_touched = int(t.touched.sum())
        t.last_step = step
        t.answers.clear()
        t.bound.observe(t.state, t.master)  # what the loaded state holds


def _restore_paged(part: Partition, t: TableState, directory: str | Path) -> None:
    """A dynamic table: the paged-out rows this rank owns now, and no optimizer state on
    the slots whose id went to another owner (hybridps/dynamic_files.py)."""
    assert t.paging is not None
    s = t.spec
    plan = restore_plan(directory, Manifest.read(directory), s.name, s.dim,
                        t.paging.store.layout, part.rank, part.world_size, s.row_start,
                        s.row_end, verify=False)
    gone = torch.from_numpy(~plan.kept).nonzero().squeeze(1)
    for state in t.state.values():
        state.index_fill_(0, gone, 0.0)
    t.paging.store.load(plan.paged, plan.tombstones, plan.counters)
