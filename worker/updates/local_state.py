"""--local-optimizer's state in a checkpoint: the same files a shard server writes.

Per table (a group's block is split into its tables, worker/embedding/groups.py): the optimizer's
state tensors by name (its layout, hybridps/optim_kinds.py), the fp32 master rows of bf16
rows, and the step count, for the rows this rank owns; read back for the rows it owns now
(any world size); a dynamic table's paged-out rows
(hybridps/dynamic_files.py). `LocalSparseOptimizer.snapshot_to`/`restore_from`
(worker/updates/source.py) call these, so the checkpointer never reads the optimizer's fields.
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
from worker.embedding.sharded import ShardedEmbedding

# per unit: the optimizer's state by name (name -> [rows, width])
UnitState = Mapping[str, Mapping[str, torch.Tensor]]


def _table_rows(emb: ShardedEmbedding, table: str) -> tuple[str, slice]:
    """(its unit, the rows of the unit's block that are table `table`'s)."""
    unit, member = emb.unit_of[table]
    return unit.name, slice(member.offset, member.offset + member.rows)


def save_local_state(directory: Path, step: int, *, rank: int, emb: ShardedEmbedding,
                     spec: OptimizerSpec, state: UnitState,
                     masters: Mapping[str, torch.Tensor], counts: Mapping[str, int],
                     paged: Mapping[str, Mapping[str, Any]]
                     ) -> dict[str, dict[str, ShardInfo]]:
    """`paged`: a dynamic table's paged-out rows as its store's state_dict()."""
    out = {}
    opt = dataclasses.asdict(spec)
    for name, table in emb.tables.items():
        start, end = emb.ranges[name]
        unit, rows = _table_rows(emb, name)
        master = masters.get(unit)
        out[name] = {"optim": save_optim_state(
            directory, table=name, rank=rank, num_rows=table.num_rows, dim=table.dim,
            row_start=start, row_end=end,
            state=OptimState({n: t[rows] for n, t in state[unit].items()}, counts[unit],
                             step, None if master is None else master[rows]),
            optimizer=opt)}
        if name in paged:  # a dynamic table's paged-out rows (hybridps/dynamic_files.py)
            out[name]["paged"] = save_paged_state(directory, table=name, rank=rank,
                                                  start=start, end=end, state=paged[name],
                                                  step=step)
    return out


@torch.no_grad()
def restore_local_state(directory: Path, step: int, *, emb: ShardedEmbedding,
                        spec: OptimizerSpec, state: UnitState,
                        masters: Mapping[str, torch.Tensor], counts: dict[str, int],
                        paged: Mapping[str, PagedRows]) -> None:
    manifest = Manifest.read(directory) if paged else None
    for name, table in emb.tables.items():
        start, end = emb.ranges[name]
        unit, rows = _table_rows(emb, name)
        saved = load_optim_state(directory, table=name, num_rows=table.num_rows,
                                 dim=table.dim, row_start=start, row_end=end, step=step,
                                 optimizer=dataclasses.asdict(spec), master=unit in masters,
                                 verify=False)
        held = state[unit]
        if unit in masters and saved.master is not None:  # bf16 rows
            masters[unit][rows].copy_(saved.master)
        for state_name, tensor in held.items():
            loaded = saved.state.get(state_name)
            if loaded is not None:
                tensor[rows].copy_(loaded)
        counts[unit] = saved.adam_step
        if name in paged:
            assert manifest is not None
            store = paged[name]
            plan = restore_plan(directory, manifest, name, table.dim, store.layout, emb.rank,
                                emb.world_size, start, end, verify=False)
            gone = torch.from_numpy(~plan.kept).nonzero().squeeze(1)
            for t in held.values():  # slots whose id moved to another owner: no state here
                t[rows].index_fill_(0, gone.to(t.device), 0.0)
            store.load(plan.paged, plan.tombstones, plan.counters)
