"""A server partition's optimizer state to and from a checkpoint (format: hybridps.checkpoint)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hybridps.checkpoint import OptimState, ShardInfo, load_optim_state, save_optim_state
from hybridps.errors import Conflict
from ps.partition import Partition


def save_partition(part: Partition, directory: str | Path, step: int) -> list[ShardInfo]:
    """Write every table of a partition whose last applied step is exactly `step`.

    The caller holds `part.lock` (no push applies while the files are written).
    """
    for name, t in part.tables.items():
        if t.last_step != step:
            raise Conflict(f"checkpoint {part.where} table {name!r} at step {step}: the last "
                           f"applied step is {t.last_step}; a checkpoint needs exactly {step}")
    out = []
    opt = dataclasses.asdict(part.optimizer)
    for name, t in part.tables.items():
        s = t.spec
        out.append(save_optim_state(
            directory, table=name, rank=part.rank, num_rows=s.num_rows, dim=s.dim,
            row_start=s.row_start, row_end=s.row_end,
            state=OptimState(t.m, t.v, t.adam_step, t.last_step, t.master), optimizer=opt,
            incarnation=part.incarnation))
    return out


def restore_partition(part: Partition, directory: str | Path, step: int) -> None:
    """Load a fresh partition's state for its row ranges from checkpoint `directory`."""
    for name, t in part.tables.items():
        s = t.spec
        state = load_optim_state(directory, table=name, num_rows=s.num_rows, dim=s.dim,
                                 row_start=s.row_start, row_end=s.row_end, step=step,
                                 has_moments=part.optimizer.has_moments,
                                 master=t.master is not None)
        if t.master is not None and state.master is not None:
            t.master.copy_(state.master)
            t.rows_seeded = s.rows_held
        if t.m is not None and state.m is not None:
            t.m.copy_(state.m)
        if t.v is not None and state.v is not None:
            t.v.copy_(state.v)
            t.touched.copy_((t.v != 0).any(dim=1))
            t.distinct_touched = int(t.touched.sum())
        t.adam_step = state.adam_step
        t.last_step = step
        t.answers.clear()
