"""A dynamic table's Page calls on the server (ps/core/paging.py through ps/core/store.py): rows and
their Adam state out of and into slots, exactly once, refusals that change nothing, the
memory budget, and the stats (GetShardStats' rows, Prometheus)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from hybridps.errors import OutOfOrder, RowOutOfRange
from hybridps.optim import OptimizerSpec
from hybridps.paged_rows import PagedOut
from ps.core.paging import PageCall
from ps.core.partition import TableSpec
from ps.core.store import Store
from ps.edge.metrics import LatencyRecorder, StoreCollector

DIM = 3
SPEC = OptimizerSpec(kind="adam", lr=0.1)


def _store(max_state_bytes: int = 0, max_run_state_bytes: int = 0) -> Store:
    store = Store(max_state_bytes=max_state_bytes, max_run_state_bytes=max_run_state_bytes)
    store.register("r", 0, 2, 1, [TableSpec("u", 8, DIM, 0, 4, dynamic=True),
                                  TableSpec("s", 8, DIM, 0, 4)], SPEC)
    return store


def _call(seq: int, step: int, out_ids: list[int], out_slots: list[int], in_ids: list[int],
          in_slots: list[int], rows: torch.Tensor | None = None) -> PageCall:
    n = len(out_ids)
    i64 = torch.int64
    return PageCall(step, seq, 0, PagedOut(
        torch.tensor(out_ids, dtype=i64), torch.arange(n * DIM, dtype=torch.float32).view(
            n, DIM) if rows is None else rows, {}, torch.full((n,), step, dtype=i64),
        torch.full((n,), 2, dtype=i64)), torch.tensor(out_slots, dtype=i64),
        torch.tensor(in_ids, dtype=i64), torch.tensor(in_slots, dtype=i64),
        counters={"capacity": 4, "occupied": 4, "lookups": 10, "hits": 4, "admissions": 6,
                  "refused_filter": 1, "refused_capacity": 0})


def test_rows_and_adam_state_go_out_and_come_back_bitwise() -> None:
    store = _store()
    table = store.partition("r", 0).tables["u"]  # type: ignore[union-attr]
    assert table.m is not None and table.v is not None
    table.m[:] = torch.randn(4, DIM)
    table.v[:] = torch.rand(4, DIM)
    m1, v1 = table.m[1].clone(), table.v[1].clone()
    out = store.page("r", 0, 1, "u", _call(1, 5, [-77], [1], [], []))
    assert out.found.numel() == 0 and bool((table.m[1] == 0).all())  # state left the slot
    back = store.page("r", 0, 1, "u", _call(2, 9, [], [], [-77, 5], [3, 2]))
    assert back.found.tolist() == [1, 0]
    assert torch.equal(table.m[3], m1) and torch.equal(table.v[3], v1)
    assert torch.equal(back.got.rows[0], torch.arange(DIM, dtype=torch.float32))
    assert back.got.seen.tolist() == [5] and back.got.freq.tolist() == [2]
    again = store.page("r", 0, 1, "u", _call(2, 9, [], [], [-77, 5], [3, 2]))
    assert again is back  # a retry of the last call: the same answer, applied once
    with pytest.raises(OutOfOrder, match="page call 4 is not the next one"):
        store.page("r", 0, 1, "u", _call(4, 10, [], [], [], []))
    row = store.stats("r").partitions[0]
    assert row.dynamic and (row.dynamic_evictions, row.dynamic_page_ins) == (1, 1)
    assert row.dynamic_hit_rate == 0.4 and row.dynamic_refusals == 1


def test_a_bad_call_changes_nothing() -> None:
    store = _store()
    table = store.partition("r", 0).tables["u"]  # type: ignore[union-attr]
    assert table.m is not None
    table.m[:] = 1.0
    with pytest.raises(RowOutOfRange, match="slot 6, outside the slots"):
        store.page("r", 0, 1, "u", _call(1, 0, [3, 4], [0, 6], [], []))
    nan = torch.full((1, DIM), float("nan"))
    with pytest.raises(Exception, match="non-finite"):
        store.page("r", 0, 1, "u", _call(1, 0, [3], [0], [], [], rows=nan))
    assert bool((table.m == 1.0).all())
    assert table.paging is not None and len(table.paging.store) == 0
    assert table.paging.seq == 0
    with pytest.raises(Exception, match="not dynamic"):
        store.page("r", 0, 1, "s", _call(1, 0, [], [], [], []))


def test_over_the_memory_budget_the_oldest_rows_are_dropped() -> None:
    held = _store().partition("r", 0)
    assert held is not None
    store = _store(max_state_bytes=held.state_bytes + 2 * 100)  # room for ~2 paged rows
    for seq, (ident, slot) in enumerate([(10, 0), (11, 1), (12, 2), (13, 3)], start=1):
        result = store.page("r", 0, 1, "u", _call(seq, seq, [ident], [slot], [], []))
    table = store.partition("r", 0).tables["u"]  # type: ignore[union-attr]
    assert table.paging is not None
    kept = set(table.paging.store.entries().ids.tolist())
    dropped, _ = table.paging.store.tombstones()
    assert kept | set(dropped.tolist()) == {10, 11, 12, 13}
    assert dropped.size and 13 in kept and 10 in set(dropped.tolist())  # oldest first
    assert set(result.dropped.tolist()) <= set(dropped.tolist())
    assert store._state_bytes_in_use() <= store.budget.limit_bytes


def test_paging_keeps_a_run_within_its_own_state_cap() -> None:
    """--max-run-state-bytes holds for paged rows too: the server's budget is ample, the
    run's cap has room for about two paged rows, so the oldest are dropped."""
    held = _store().partition("r", 0)
    assert held is not None
    store = _store(max_run_state_bytes=held.state_bytes + 2 * 100)
    for seq, (ident, slot) in enumerate([(10, 0), (11, 1), (12, 2), (13, 3)], start=1):
        store.page("r", 0, 1, "u", _call(seq, seq, [ident], [slot], [], []))
    table = store.partition("r", 0).tables["u"]  # type: ignore[union-attr]
    assert table.paging is not None
    dropped, _ = table.paging.store.tombstones()
    assert 10 in set(dropped.tolist()) and 13 in set(table.paging.store.entries().ids.tolist())
    run_bytes = sum(p.state_bytes for p in store.partitions() if p.run_id == "r")
    assert run_bytes <= store.budget.run_limit_bytes


def test_prometheus_shows_dynamic_tables() -> None:
    store = _store()
    store.page("r", 0, 1, "u", _call(1, 1, [5], [0], [], []))
    families = {f.name: f for f in StoreCollector(store, LatencyRecorder(
        CollectorRegistry())).collect()}
    samples = families["hybridps_partition_dynamic_evictions"].samples
    assert [(s.labels["table"], s.value) for s in samples] == [("u", 1.0)]
    paged = families["hybridps_partition_dynamic_paged_rows"].samples
    assert paged[0].value == 1.0
    assert np.isclose(families["hybridps_partition_dynamic_hit_rate"].samples[0].value, 0.4)
