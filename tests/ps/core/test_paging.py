"""A dynamic table's Page calls on the server (ps/core/paging.py through ps/core/store.py): rows and
their Adam state out of and into slots, exactly once, refusals that change nothing, the
memory budget, and the stats (GetShardStats' rows, Prometheus)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from hybridps.errors import OutOfOrder, ResourceExhausted, RowOutOfRange
from hybridps.optim import OptimizerSpec
from hybridps.paged_rows import PagedOut
from hybridps.paged_rows import quota_rows as quota_rows_for
from ps.core.paging import PageCall
from ps.core.partition import TableSpec
from ps.core.store import Store
from ps.edge.metrics import LatencyRecorder, StoreCollector

DIM = 3
SPEC = OptimizerSpec(kind="adam", lr=0.1)


def _store(max_state_bytes: int = 0, max_run_state_bytes: int = 0) -> Store:
    """Rank 0 of a run of world size 2 (it holds half the run's share: ps/core/limits.py)."""
    store = Store(max_state_bytes=max_state_bytes, max_run_state_bytes=max_run_state_bytes,
                  run_shares=1)
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
    # a share of held + 200 bytes: room for ~2 paged rows
    store = _store(max_state_bytes=2 * (held.state_bytes + 2 * 100))
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
    store = _store(max_run_state_bytes=2 * (held.state_bytes + 2 * 100))
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


def _paged_state(store: Store, rank: int) -> dict[str, torch.Tensor]:
    table = store.partition("r", rank).tables["u"]  # type: ignore[union-attr]
    assert table.paging is not None
    payload = table.paging.store.state_dict()
    return {"ids": payload["ids"], "rows": payload["rows"], "seen": payload["seen"],
            "m": payload["state"]["m"], "tomb_ids": payload["tomb_ids"],
            "tomb_steps": payload["tomb_steps"]}


def test_drops_depend_only_on_the_partitions_own_calls() -> None:
    """Two ranks page under one budget, their calls interleaved two ways: each rank's
    drops, paged rows and tombstones are bitwise the same (a drop is decided against the
    table's own quota, not the server's bytes in use, which depend on the other rank)."""
    calls: dict[int, list[PageCall]] = {}
    for rank in (0, 1):
        base = 4 * rank
        calls[rank] = []
        for seq in range(1, 13):
            ids = [1000 * (rank + 1) + 4 * seq + k for k in range(4)]
            rows = torch.randn(4, DIM, generator=torch.Generator().manual_seed(seq + 50 * rank))
            call = _call(seq, seq, ids, [base, base + 1, base + 2, base + 3], [], [], rows)
            call.out.seen[:] = torch.tensor([seq, seq - 3, seq, seq - 1])
            calls[rank].append(call)
    orders = [[(0, i) for i in range(12)] + [(1, i) for i in range(12)],
              [(r, i) for i in range(12) for r in (1, 0)]]
    results = []
    for order in orders:
        store = Store(max_state_bytes=10**6, max_run_state_bytes=2 * 4_000, run_shares=1)
        for rank in (0, 1):
            store.register("r", rank, 2, 1, [TableSpec("u", 8, DIM, 4 * rank, 4 * rank + 4,
                                                       dynamic=True)], SPEC)
            table = store.partition("r", rank).tables["u"]  # type: ignore[union-attr]
            assert table.m is not None
            table.m[:] = torch.randn(4, DIM, generator=torch.Generator().manual_seed(rank))
        dropped: dict[int, list[list[int]]] = {0: [], 1: []}
        for rank, i in order:
            dropped[rank].append(store.page("r", rank, 1, "u", calls[rank][i]).dropped.tolist())
        results.append((dropped, {rank: _paged_state(store, rank) for rank in (0, 1)}))
        assert sum(len(d) for calls_ in dropped.values() for d in calls_) > 0  # drops happen
    (d0, s0), (d1, s1) = results
    assert d0 == d1
    for rank in (0, 1):
        for name, t in s0[rank].items():
            assert torch.equal(t, s1[rank][name]), (rank, name)


def test_a_dynamic_partition_reserves_its_share_and_one_too_small_is_refused() -> None:
    store = Store(max_state_bytes=40_000, run_shares=4)  # a run's share: 10,000 bytes
    store.register("a", 0, 2, 0, [TableSpec("u", 8, DIM, 0, 4, dynamic=True)], SPEC)
    part = store.partition("a", 0)
    assert part is not None and part.reserved_bytes == 5_000  # share / world size
    table = part.tables["u"]
    assert table.paging is not None  # the fixed state leaves the quota; the id map is in it
    assert table.paged_bytes == table.paging.store.index.held_bytes > 0
    assert table.paged_quota == 5_000 - (part.state_bytes - table.paged_bytes)
    assert store._state_bytes_in_use() == 5_000
    with pytest.raises(ResourceExhausted) as info:
        store.register("b", 0, 1, 0, [TableSpec("u", 2000, DIM, 0, 2000, dynamic=True)],
                       SPEC)
    text = str(info.value)
    assert "share of the budget is 10000 bytes" in text and "--run-shares 4" in text
    assert "fixed optimizer state needs" in text and store.partition("b", 0) is None


def test_a_finished_runs_share_goes_back_to_the_budget() -> None:
    """A run whose ranks all finished pages no more: it counts what it holds, not its
    share, so the next run fits (one server hosting runs one after another)."""
    store = Store(max_state_bytes=20_000, run_shares=1)  # one run's share: all of it
    store.register("a", 0, 1, 0, [TableSpec("u", 8, DIM, 0, 4, dynamic=True)], SPEC)
    with pytest.raises(ResourceExhausted, match="--max-state-bytes"):
        store.register("b", 0, 1, 0, [TableSpec("u", 8, DIM, 0, 4, dynamic=True)], SPEC)
    store.run_state = lambda run_id: "finished" if run_id == "a" else "active"
    with pytest.raises(ResourceExhausted, match="--max-state-bytes"):  # its share is whole
        store.register("b", 0, 1, 0, [TableSpec("u", 8, DIM, 0, 4, dynamic=True)], SPEC)
    store.register("c", 0, 1, 0, [TableSpec("s", 8, DIM, 0, 4)], SPEC)  # its fixed bytes fit
    assert store.partition("c", 0) is not None


def test_the_stats_show_each_tables_quota_and_the_bytes_its_store_holds() -> None:
    from hybridps.admin import format_shard_stats, run_summaries
    from ps.edge.sync_codec import stats_message

    held = _store().partition("r", 0)
    assert held is not None
    store = _store(max_state_bytes=2 * (held.state_bytes + 2 * 100))
    for seq, (ident, slot) in enumerate([(10, 0), (11, 1), (12, 2)], start=1):
        store.page("r", 0, 1, "u", _call(seq, seq, [ident], [slot], [], []))
    table = store.partition("r", 0).tables["u"]  # type: ignore[union-attr]
    assert table.paging is not None
    row = next(r for r in store.stats("r").partitions if r.table == "u")
    # the share's 200 bytes beyond the fixed state and the (empty) store's id map
    assert row.dynamic_paged_quota == table.paged_quota == 200 + held.tables[
        "u"].paged_bytes
    assert row.dynamic_paged_bytes <= row.dynamic_paged_quota
    assert row.dynamic_held_bytes <= (row.dynamic_paged_quota
                                      + table.paging.store.held_overhead_bytes)
    assert row.dynamic_held_bytes >= table.paging.store.capacity * table.paging.store.dim * 4
    text = format_shard_stats(stats_message(store.stats("r")))
    assert f"dropped {row.dynamic_dropped}  quota 0.0 MB  held" in text
    # the totals and the run's host bytes count what the paged-out rows' store holds too
    # (its pools at capacity: at least the content the budget's drops are decided on)
    msg = stats_message(store.stats())
    assert msg.dynamic_held_bytes_total == row.dynamic_held_bytes > 0
    part = store.partition("r", 0)
    assert part is not None
    (run,) = run_summaries(msg)
    assert run.state_bytes == (msg.state_bytes_total + msg.master_bytes_total
                               + msg.dynamic_held_bytes_total) >= part.state_bytes
    assert "paged-out rows 0.0 MB" in format_shard_stats(msg)


def test_under_a_quota_the_pools_hold_its_rows_and_one_calls_not_twice_them() -> None:
    """Pools that double would reach 128 positions for ~100 rows; capped by the quota
    they hold at most the quota's rows plus the rows of one call."""
    probe = Store()
    probe.register("r", 0, 1, 1, [TableSpec("u", 16, DIM, 0, 16, dynamic=True)], SPEC)
    part = probe.partition("r", 0)
    assert part is not None and part.tables["u"].paging is not None
    row_bytes = part.tables["u"].paging.store.row_bytes
    # ~100 rows and an id map for them and one call's (512 positions at most)
    room = 100 * row_bytes + 16 * 512 + 1000
    store = Store(max_state_bytes=part.state_bytes + room, run_shares=1)
    store.register("r", 0, 1, 1, [TableSpec("u", 16, DIM, 0, 16, dynamic=True)], SPEC)
    table = store.partition("r", 0).tables["u"]  # type: ignore[union-attr]
    assert table.paging is not None
    paged = table.paging.store
    quota_rows = quota_rows_for(table.paged_quota, row_bytes, 16)
    assert 100 <= quota_rows < 128 and paged.max_entries == quota_rows + 16
    for seq in range(1, 41):
        ids = list(range(16 * seq, 16 * seq + 16))
        store.page("r", 0, 1, "u", _call(seq, seq, ids, list(range(16)), [], []))
    assert paged.dropped > 0 and len(paged) <= quota_rows
    assert paged.capacity <= quota_rows + 16
    assert table.paged_bytes <= table.paged_quota


def test_under_a_quota_the_bytes_the_store_holds_stay_within_it() -> None:
    """The id map sized once from the quota, its capacity, the pools' capacity and the
    tombstones counted: after every call of a long run (drops, page-ins, tombstones
    taking more of the quota) the bytes held stay within the quota plus the store's
    fixed overhead, the pools shrink as the tombstones grow, and every row paged back in
    is the one paged out."""
    probe = _store().partition("r", 0)
    assert probe is not None
    fixed = probe.state_bytes - probe.tables["u"].paged_bytes
    store = _store(max_state_bytes=2 * (fixed + 40_000))
    table = store.partition("r", 0).tables["u"]  # type: ignore[union-attr]
    assert table.paging is not None and table.paged_quota == 40_000
    paged = table.paging.store
    map_bytes = paged.index.held_bytes
    peak = 0
    rng = np.random.default_rng(0)
    for seq in range(1, 301):
        out = [4 * seq + k for k in range(4)]
        back = sorted(set(rng.choice(4 * seq, size=2, replace=False).tolist()) - set(out))
        rows = torch.tensor(out, dtype=torch.float32)[:, None].repeat(1, DIM)
        result = store.page("r", 0, 1, "u", _call(seq, seq, out, [0, 1, 2, 3], back,
                                                  [0, 1][:len(back)], rows))
        got = result.got.ids.tolist()
        assert torch.equal(result.got.rows, torch.tensor(got, dtype=torch.float32)[
            :, None].repeat(1, DIM))
        assert set(got) <= set(back) and not set(got) & set(paged.entries().ids.tolist())
        assert paged.nbytes <= table.paged_quota
        assert paged.held_bytes <= table.paged_quota + paged.held_overhead_bytes
        assert paged.index.held_bytes == map_bytes  # sized once, never grown
        peak = max(peak, paged.capacity)
    assert paged.dropped > 0 and paged.tomb_count * 16 > 40_000 // 4
    assert paged.capacity < peak  # the tombstones took room the pools gave back
