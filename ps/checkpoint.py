"""A server partition's optimizer state to and from a checkpoint (format: hybridps.checkpoint).

The files are per table: a group (ps/table_members.py) is written as its member tables,
each file holding the member's slice of the group's m, v and master rows and the
group's step count (every member of a group is pushed with it, every step), and read
back into those slices."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridps.checkpoint import (
    OptimState,
    ShardInfo,
    Writer,
    load_optim_state,
    save_optim_state,
)
from hybridps.errors import Conflict
from ps.partition import Partition, TableSpec
from ps.table_members import pieces


def _rows(t: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if t is None else t[lo:hi]


def save_partition(part: Partition, directory: str | Path, step: int,
                   writer: Writer | None = None) -> list[ShardInfo]:
    """Write every table of a partition whose last applied step is exactly `step`
    (through `writer`: ps/checkpoint_dirs.py; None: by path).

    The caller holds `part.lock` (no push applies while the files are written).
    """
    for name, t in part.tables.items():
        if t.last_step != step:
            raise Conflict(f"checkpoint {part.where} table {name!r} at step {step}: the last "
                           f"applied step is {t.last_step}; a checkpoint needs exactly {step}")
    out = []
    opt = dataclasses.asdict(part.optimizer)
    for t in part.tables.values():
        for p in pieces(t.spec):
            out.append(save_optim_state(
                directory, table=p.name, rank=part.rank, num_rows=p.num_rows,
                dim=t.spec.dim, row_start=p.row_start, row_end=p.row_end,
                state=OptimState(_rows(t.m, p.lo, p.hi), _rows(t.v, p.lo, p.hi), t.adam_step,
                                 t.last_step, _rows(t.master, p.lo, p.hi)),
                optimizer=opt, incarnation=part.incarnation, writer=writer))
    return out


def check_restore(specs: Sequence[TableSpec], has_moments: bool, master: bool,
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
                                     has_moments=has_moments, master=master, dry_run=True)
            counts.add(state.adam_step)
        if len(counts) > 1:  # one step count per group: its members' must agree
            raise Conflict(f"checkpoint {directory}: the tables of group {s.name!r} were "
                           f"saved with different optimizer step counts {sorted(counts)}")


def restore_partition(part: Partition, directory: str | Path, step: int,
                      checked: bool = False) -> None:
    """Load a fresh partition's state for its row ranges from checkpoint `directory`.

    Every table's files are checked first (check_restore; `checked`: the caller did),
    so a damaged checkpoint changes nothing."""
    if not checked:
        check_restore(part.specs(), part.optimizer.has_moments,
                      part.row_dtype != torch.float32, directory, step)
    for t in part.tables.values():
        s = t.spec
        for p in pieces(s):
            state = load_optim_state(directory, table=p.name, num_rows=p.num_rows, dim=s.dim,
                                     row_start=p.row_start, row_end=p.row_end, step=step,
                                     has_moments=part.optimizer.has_moments,
                                     master=t.master is not None, verify=False)
            if t.master is not None and state.master is not None:
                t.master[p.lo:p.hi].copy_(state.master)
            if t.m is not None and state.m is not None:
                t.m[p.lo:p.hi].copy_(state.m)
            if t.v is not None and state.v is not None:
                t.v[p.lo:p.hi].copy_(state.v)
            t.adam_step = state.adam_step
        if t.master is not None:
            t.rows_seeded = s.rows_held
        if t.v is not None:
            t.touched.copy_((t.v != 0).any(dim=1))
            t.distinct_touched = int(t.touched.sum())
        t.last_step = step
        t.answers.clear()
        t.bound.observe(t.m, t.v, t.master)  # what the loaded state holds
