"""--local-optimizer's state in a checkpoint: the same files a shard server writes.

Per table (a group's block is split into its tables, worker/embedding/groups.py): the optimizer's
state tensors by name (its layout, hybridps/optim_kinds.py), the fp32 master rows of bf16
rows, and the step count, for the rows this rank owns; read back for the rows it owns now
(any world size); a dynamic table's paged-out rows
(hybridps/dynamic_files.py). `LocalSparseOptimizer.snapshot_to`/`restore_from`
(worker/updates/source.py) call these, so the checkpointer never reads the optimizer's fields.
They read and write a unit's row columns (hybridps/spilled_rows.py's interface), so state
spilled under --local-memory-budget-mb (worker/updates/local_spill.py) is read back from its
pages into the checkpoint and restored into them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridps.checkpoint import (
    Manifest,
    OptimState,
    ShardInfo,
    load_optim_state,
    save_optim_state,
)
from hybridps.dynamic_files import restore_plan, save_paged_state
from hybridps.optim import OptimizerSpec
from hybridps.paged_rows import PagedRows
from hybridps.spilled_rows import HeldRows, RowColumns
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.local_spill import MASTER

# per unit: its row columns (the optimizer's state by name, and MASTER for bf16 rows)
UnitColumns = Mapping[str, RowColumns]


def _table_rows(emb: ShardedEmbedding, table: str) -> tuple[str, slice]:
    """(its unit, the rows of the unit's block that are table `table`'s)."""
    unit, member = emb.unit_of[table]
    return unit.name, slice(member.offset, member.offset + member.rows)


# per table: (the global rows of a delta shard, None: every row of this rank; the
# optimizer's state of those rows by name; their fp32 master rows, None: fp32 rows)
TableRows = tuple[torch.Tensor | None, dict[str, torch.Tensor], torch.Tensor | None]


def local_state_rows(*, emb: ShardedEmbedding, columns: UnitColumns,
                     dynamic: Mapping[str, torch.Tensor],
                     changed: Mapping[str, torch.Tensor] | None = None
                     ) -> dict[str, TableRows]:
    """Per table, the state rows a checkpoint writes (views of a whole table's rows held
    in memory, a copy of spilled ones; a delta's gathered). `changed` (per unit, bool
    [rows]: the rows pushes changed since the previous checkpoint): an incremental
    checkpoint, each table's rows only those (a delta shard); a dynamic table's also its
    slots looked up since (`dynamic`, bool per slot: a slot's state also moves, in the
    fused step hybridps/native/dynamic_step.c, when its id changes, and an id changes only
    on a slot looked up)."""
    out: dict[str, TableRows] = {}
    for name in emb.tables:
        start, _ = emb.ranges[name]
        unit, rows = _table_rows(emb, name)
        held = columns[unit]
        ids = None
        if changed is not None:
            flags = changed[unit][rows]
            if name in dynamic:
                flags = flags | dynamic[name].to(flags.device)
            local = flags.nonzero().squeeze(1)
            ids = local.cpu() + start
            cols, at = held.view((local + rows.start).to(_index_device(held)),
                                 write=False)
            by_name = {n: t[at] for n, t in cols.items()}
        else:
            by_name = held.read(rows.start, rows.stop)
        master = by_name.pop(MASTER, None)
        out[name] = (ids, by_name, master)
    return out


def _index_device(columns: RowColumns) -> torch.device:
    """Where `columns.view`'s row indices go: the tensors' device when held in memory
    (a spilled holder's frames are on the host)."""
    if isinstance(columns, HeldRows) and columns.columns:
        return next(iter(columns.columns.values())).device
    return torch.device("cpu")


def save_local_state(directory: Path, step: int, *, rank: int, emb: ShardedEmbedding,
                     spec: OptimizerSpec, rows: Mapping[str, TableRows],
                     counts: Mapping[str, int], paged: Mapping[str, Mapping[str, Any]]
                     ) -> dict[str, dict[str, ShardInfo]]:
    """`rows`: `local_state_rows`'s; `paged`: a dynamic table's paged-out rows as its
    store's state_dict()."""
    out = {}
    opt = dataclasses.asdict(spec)
    for name, table in emb.tables.items():
        start, end = emb.ranges[name]
        unit, _ = _table_rows(emb, name)
        ids, by_name, master = rows[name]
        out[name] = {"optim": save_optim_state(
            directory, table=name, rank=rank, num_rows=table.num_rows, dim=table.dim,
            row_start=start, row_end=end,
            state=OptimState(dict(by_name), counts[unit], step, master),
            optimizer=opt, ids=ids)}
        if name in paged:  # a dynamic table's paged-out rows (hybridps/dynamic_files.py)
            out[name]["paged"] = save_paged_state(directory, table=name, rank=rank,
                                                  start=start, end=end, state=paged[name],
                                                  step=step)
    return out


@torch.no_grad()
def restore_local_state(directory: Path, step: int, *, emb: ShardedEmbedding,
                        spec: OptimizerSpec, columns: UnitColumns, counts: dict[str, int],
                        paged: Mapping[str, PagedRows]) -> None:
    manifest = Manifest.read(directory) if paged else None
    for name, table in emb.tables.items():
        start, end = emb.ranges[name]
        unit, rows = _table_rows(emb, name)
        held = columns[unit]
        names = dict(held.layout)
        saved = load_optim_state(directory, table=name, num_rows=table.num_rows,
                                 dim=table.dim, row_start=start, row_end=end, step=step,
                                 optimizer=dataclasses.asdict(spec), master=MASTER in names,
                                 verify=False)
        values = {n: t for n, t in saved.state.items()
                  if t is not None and n in names and n != MASTER}
        if MASTER in names and saved.master is not None:  # bf16 rows
            values[MASTER] = saved.master
        if values:
            held.write(rows.start, values)
        counts[unit] = saved.adam_step
        if name in paged:
            assert manifest is not None
            store = paged[name]
            plan = restore_plan(directory, manifest, name, table.dim, store.layout, emb.rank,
                                emb.world_size, start, end, verify=False)
            gone = torch.from_numpy(~plan.kept).nonzero().squeeze(1) + rows.start
            state_names = [n for n in names if n != MASTER]
            if state_names and gone.numel():  # slots whose id moved to another owner
                held.fill(gone.to(_index_device(held)), state_names)
            store.load(plan.paged, plan.tombstones, plan.counters)
