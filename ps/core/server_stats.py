"""The server's stats snapshot (GetShardStats, the Prometheus metrics, the worker's summary):
one row per (run, rank, table) and the server's totals. Transport-free, no grpc.

A group of tables registered as one partition table (ps/core/table_members.py) shows as its
member tables, one row each, like separate tables (`_per_member`)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ps.core.partition import ROW_DTYPES, Partition, TableState, optimizer_description
from ps.core.session import TableKey
from ps.core.table_members import pieces


@dataclass(frozen=True)
class PartitionStatsRow:
    """One (run, rank, table); the fields of admin.proto's PartitionStats."""

    run_id: str
    rank: int
    incarnation: int
    table: str
    row_start: int
    row_end: int
    rows_held: int
    state_bytes: int
    pushes_applied: int
    rows_updated: int
    rows_per_second: float
    distinct_rows_touched: int
    last_step: int
    lag_steps: int
    queue_depth: int
    refusals: dict[str, int]
    optimizer: str
    master_bytes: int = 0  # fp32 master rows (row dtype bf16), not counted in state_bytes
    row_dtype: str = "fp32"
    run_state: str = ""  # active | finished | aborted | abandoned (Store.run_state); '' unknown
    # a dynamic table (docs/dynamic_ids.md; ps/core/paging.py): the rank's counters as of its last
    # Page call, and this partition's paged-out rows
    dynamic: bool = False
    dynamic_capacity: int = 0
    dynamic_occupied: int = 0
    dynamic_admissions: int = 0
    dynamic_refusals: int = 0
    dynamic_evictions: int = 0
    dynamic_page_ins: int = 0
    dynamic_hit_rate: float = 0.0
    dynamic_paged_rows: int = 0
    dynamic_paged_bytes: int = 0
    dynamic_expired: int = 0
    dynamic_dropped: int = 0
    dynamic_paged_quota: int = 0
    dynamic_held_bytes: int = 0
    # the disk tier (ps/core/spill.py): a table whose state spills to its spill file
    spilled: bool = False
    spill_disk_bytes: int = 0
    spill_pages: int = 0
    spill_frames: int = 0
    spill_hits: int = 0
    spill_misses: int = 0
    spill_fills: int = 0
    spill_spills: int = 0
    spill_hit_rate: float = 0.0
    spill_fills_per_second: float = 0.0  # over about the last --rate-window-s seconds
    spill_spills_per_second: float = 0.0


@dataclass(frozen=True)
class ServerStats:
    server_id: str
    uptime_s: float
    partitions: list[PartitionStatsRow]
    refusals: dict[str, int]
    state_bytes_total: int
    pushes_applied_total: int
    rows_updated_total: int
    master_bytes_total: int = 0
    runs_freed: int = 0
    partitions_freed: int = 0
    max_state_bytes: int = 0
    spill_disk_bytes_total: int = 0
    spill_max_bytes: int = 0
    spill_enabled: bool = False
    dynamic_held_bytes_total: int = 0


def partition_rows(parts: Sequence[Partition], queued: Mapping[TableKey, int],
                   states: Mapping[str, str]) -> list[PartitionStatsRow]:
    """One row per (run, rank, table) of `parts`; counters read without the partition
    locks (ints, GIL-atomic). `queued`: pushes waiting per table; `states`: each run's
    state (Store.run_state)."""
    newest: dict[str, int] = {}
    for p in parts:
        for t in p.tables.values():
            newest[p.run_id] = max(newest.get(p.run_id, -1), t.last_step)
    rows: list[PartitionStatsRow] = []
    for p in parts:
        opt = optimizer_description(p.optimizer)
        first = len(rows)
        for name, t in p.tables.items():
            s = t.spec
            row = PartitionStatsRow(
                run_id=p.run_id, rank=p.rank, incarnation=p.incarnation, table=name,
                row_start=s.row_start, row_end=s.row_end, rows_held=s.rows_held,
                state_bytes=t.state_bytes, pushes_applied=t.pushes_applied,
                rows_updated=t.rows_updated, rows_per_second=t.rate.rate(),
                distinct_rows_touched=t.distinct_touched, last_step=t.last_step,
                lag_steps=newest[p.run_id] - t.last_step,
                queue_depth=queued.get((p.run_id, p.rank, name), 0),
                refusals=dict(t.refusals), optimizer=opt,
                master_bytes=t.master_bytes, row_dtype=ROW_DTYPES[t.row_dtype],
                run_state=states.get(p.run_id, ""), **_dynamic_fields(t),
                **_spill_fields(t),
            )
            rows.extend(_per_member(row, t) if s.members else [row])
        if p.refusals and len(rows) > first:  # those of no table: on its first row
            merged = collections.Counter(rows[first].refusals) + p.refusals
            rows[first] = dataclasses.replace(rows[first], refusals=dict(merged))
    return rows


def _dynamic_fields(t: TableState) -> dict[str, Any]:
    paging = t.paging
    if paging is None:
        return {}
    c, store = paging.counters, paging.store
    return {"dynamic": True, "dynamic_capacity": c.get("capacity", t.spec.rows_held),
            "dynamic_occupied": c.get("occupied", 0),
            "dynamic_admissions": c.get("admissions", 0),
            "dynamic_refusals": c.get("refused_filter", 0) + c.get("refused_capacity", 0),
            "dynamic_evictions": paging.page_outs, "dynamic_page_ins": paging.page_ins,
            "dynamic_hit_rate": c.get("hits", 0) / max(c.get("lookups", 0), 1),
            "dynamic_paged_rows": len(store), "dynamic_paged_bytes": store.nbytes,
            "dynamic_expired": store.expired, "dynamic_dropped": store.dropped,
            "dynamic_paged_quota": t.paged_quota, "dynamic_held_bytes": store.held_bytes}


def _spill_fields(t: TableState) -> dict[str, Any]:
    """Its spilled state and (a dynamic table) spilled paged-out rows, summed."""
    holders = [h for h in t.spilled_holders() if h.counters()]
    if not holders:
        return {}
    c = collections.Counter[str]()
    for h in holders:
        c.update(h.counters())
    accesses = c["hits"] + c["misses"]
    return {"spilled": True, "spill_disk_bytes": sum(h.disk_bytes for h in holders),
            "spill_pages": c["pages"], "spill_frames": c["frames"], "spill_hits": c["hits"],
            "spill_misses": c["misses"], "spill_fills": c["fills"],
            "spill_spills": c["spills"],
            "spill_hit_rate": c["hits"] / accesses if accesses else 0.0,
            "spill_fills_per_second": t.fill_rate.rate(c["fills"]),
            "spill_spills_per_second": t.spill_rate.rate(c["spills"])}


def _per_member(row: PartitionStatsRow, t: TableState) -> list[PartitionStatsRow]:
    """A group's row as one row per member table (ps/core/table_members.py), so the stats read
    like those of separate tables: each member's global rows, its share of the state
    bytes (the same per row), the rows updated in it; the group's pushes, steps, queue and
    refusals (every member is pushed with the group); its rate split by rows updated."""
    held = max(row.rows_held, 1)
    out = []
    for piece, updated in zip(pieces(t.spec), t.member_rows_updated, strict=True):
        n = piece.hi - piece.lo
        out.append(dataclasses.replace(
            row, table=piece.name, row_start=piece.row_start, row_end=piece.row_end,
            rows_held=n, state_bytes=row.state_bytes * n // held,
            master_bytes=row.master_bytes * n // held, rows_updated=updated,
            rows_per_second=row.rows_per_second * updated / max(row.rows_updated, 1),
            distinct_rows_touched=int(t.touched[piece.lo:piece.hi].sum())))
    return out
