"""Checkpoint files are per table; a rank's rows, updates and optimizer state are per unit
(worker/embedding/groups.py: a group of tables of one width, or a table alone). These convert at
that boundary: units are split into their tables (global row ids) when a checkpoint is
written and joined when one is read, so the files are the same whether the run grouped
its tables or not, and re-shard across world sizes like separate tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from worker.embedding.groups import join_ids
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.source import RowUpdate


def split_updates(emb: ShardedEmbedding, updates: Sequence[RowUpdate]) -> list[dict[str, Any]]:
    """Pending updates per unit -> per table (global row ids; every table of an update's
    unit gets an entry, an empty one too), CPU copies, as the pending file holds them."""
    out = []
    for u in updates:
        unit = emb.units[u.table]
        ids_U = u.ids_U.to(torch.int64)
        for member, cut in unit.split(ids_U):
            out.append({"step": u.step, "table": member.name,
                        "ids": unit.to_table_ids(member, ids_U[cut]).cpu().clone(),
                        "delta": u.delta_UD[cut].cpu().clone(), "decay": float(u.decay),
                        "rows": bool(u.rows)})
    return out


def split_rows(emb: ShardedEmbedding, unit_rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
               ) -> dict[str, dict[str, torch.Tensor]]:
    """{unit: (sorted unit row ids, rows)} -> {table: {"ids": global ids, "rows": rows}}."""
    out = {}
    for name, (ids_P, rows_PD) in unit_rows.items():
        unit = emb.units[name]
        for member, cut in unit.split(ids_P):
            out[member.name] = {"ids": unit.to_table_ids(member, ids_P[cut]),
                                "rows": rows_PD[cut].cpu()}
    return out


def join_updates(emb: ShardedEmbedding,
                 per_table: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor,
                                                           float, bool]]
                 ) -> list[RowUpdate]:
    """{(step, table): (sorted global ids this rank owns, delta, decay, rows?)} -> the
    updates per (step, unit), in step order then unit order. A unit gets an update for a
    step when any of its tables has one (the staleness window refuses a step that lacks
    a unit's update)."""
    updates = []
    for step in sorted({s for s, _ in per_table}):
        for name, unit in emb.units.items():
            parts = {m.name: per_table[(step, m.name)] for m in unit.members
                     if (step, m.name) in per_table}
            if not parts:
                continue
            ids_U, _ = join_ids(unit, {t: p[0] for t, p in parts.items()})
            deltas = [parts[m.name][1] for m in unit.members if m.name in parts]
            first = next(iter(parts.values()))
            updates.append(RowUpdate(step, name, ids_U.to(emb.device),
                                     torch.cat(deltas).to(emb.device), first[2],
                                     rows=first[3]))
    return updates
