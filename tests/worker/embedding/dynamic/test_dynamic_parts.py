"""Dynamic tables' pure parts (docs/dynamic_ids.md): the id hashes, the id map, the paged
store, admission filters, the slot table's eviction rules, and bad specs."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridps.checkpoint import (
    FileEntry,
    Manifest,
    ManifestShard,
    ManifestTable,
    OptimState,
    load_rows,
    rows_file,
    save_optim_state,
    save_shard,
)
from hybridps.dynamic import DynamicSpec, initial_rows, owner_of_ids
from hybridps.dynamic_files import restore_plan, save_ids, save_paged
from hybridps.id_map import _NATIVE as ID_MAP_NATIVE
from hybridps.id_map import GONE, IdMap
from hybridps.paged_rows import PagedOut, PagedRows
from worker.config.task_options import parse_tables
from worker.embedding.dynamic.admission import Admission, CountMinSketch
from worker.embedding.dynamic.ids import _first_seen_unique
from worker.embedding.dynamic.slots import PageAnswer, PageRequest, SlotTable
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding

INT64 = np.iinfo(np.int64)


def _raw_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    ids = rng.integers(INT64.min, INT64.max, size=n, dtype=np.int64)
    ids[:4] = [0, -1, INT64.min, INT64.max]
    return np.unique(ids)


def test_owner_is_a_fixed_function_of_the_id() -> None:
    ids = torch.tensor([0, -1, 2**63 - 1, -(2**63), 12345], dtype=torch.int64)
    assert owner_of_ids(ids, 1).tolist() == [0] * 5
    owners = owner_of_ids(ids, 7)
    assert owners.tolist() == owner_of_ids(ids.flip(0), 7).flip(0).tolist()
    assert ((owners >= 0) & (owners < 7)).all()
    many = owner_of_ids(torch.arange(70_000), 7)
    counts = torch.bincount(many, minlength=7)
    assert counts.min() > 9_000  # spread evenly (10,000 expected each)


def test_initial_rows_depend_on_the_id_only() -> None:
    ids = torch.tensor([5, -3, 2**62, 5], dtype=torch.int64)
    rows = initial_rows(ids, 7, seed=1, table_index=0, init_std=1.0)
    assert torch.equal(rows[0], rows[3])
    assert torch.equal(rows[1:2], initial_rows(ids[1:2], 7, seed=1, table_index=0,
                                              init_std=1.0))
    assert not torch.equal(rows[0], initial_rows(ids[:1], 7, seed=2, table_index=0,
                                                 init_std=1.0)[0])
    big = initial_rows(torch.arange(20_000), 8, seed=0, table_index=0, init_std=0.5)
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 0.5) < 0.01


def test_initial_rows_are_a_sum_of_four_uniforms_with_the_std() -> None:
    """The law the docs state: bounded at 2 sqrt(3) std, kurtosis 2.7 (a normal's: 3),
    every column alike, no two ids' rows the same."""
    big = initial_rows(torch.arange(-50_000, 50_000), 8, seed=3, table_index=1,
                       init_std=0.2).double()
    assert abs(float(big.mean())) < 0.002
    assert torch.allclose(big.std(dim=0), torch.full((8,), 0.2, dtype=torch.float64),
                          rtol=0.01)
    assert float(big.abs().max()) <= 2 * 3 ** 0.5 * 0.2 * (1 + 1e-6)
    z = (big - big.mean()) / big.std()
    assert abs(float((z ** 4).mean()) - 2.7) < 0.03
    assert torch.unique(big, dim=0).shape[0] == big.shape[0]


@pytest.mark.skipif(not ID_MAP_NATIVE, reason="the native extension is not built")
@pytest.mark.parametrize("dim", [1, 7, 16, 129])
def test_the_native_initial_rows_are_the_numpy_ones_bitwise(dim: int) -> None:
    ids = torch.from_numpy(_raw_ids(np.random.default_rng(dim), 30_000 // dim + 5))
    for seed, table_index, std in ((0, 0, 0.05), (2**40 + 1, 7, 1.0)):
        kw = {"seed": seed, "table_index": table_index, "init_std": std}
        assert torch.equal(initial_rows(ids, dim, **kw, native=True),
                           initial_rows(ids, dim, **kw, native=False))


@pytest.mark.skipif(not ID_MAP_NATIVE, reason="the native extension is not built")
def test_the_native_first_seen_unique_is_the_sorting_one() -> None:
    rng = np.random.default_rng(5)
    for n in (1, 2, 100, 5000):
        for high in (3, 1000, 2**62):
            ids = torch.from_numpy(rng.integers(-high, high, n, dtype=np.int64))
            got = _first_seen_unique(ids, native=True)
            want = _first_seen_unique(ids, native=False)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(got[0][got[1]], ids)


@pytest.mark.skipif(not ID_MAP_NATIVE, reason="the native extension is not built")
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_the_native_victims_are_the_numpy_ones(eviction: str) -> None:
    """Random slot states with many ties in seen and freq, pinned slots (some -1), counts
    above and below the evictable, narrow and wide ranges of steps (the native version
    counts or sorts by the range): the same slots in the same order."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        n = int(rng.integers(1, 300))
        seen = rng.integers(-1, 20 if trial % 2 else 10**6, n).astype(np.int64)
        freq = rng.integers(0, 5, n).astype(np.int64)
        local = rng.integers(-1, n, int(rng.integers(0, n + 1))).astype(np.int64)
        count = int(rng.integers(1, n + 3))
        applied = int(rng.integers(-1, 22)) if trial % 2 else int(rng.integers(-1, 10**6))
        got = []
        for native in (False, True):
            table = SlotTable("t", DynamicSpec(eviction=eviction), 0, n, seed=0,
                              table_index=0, native=native)
            table.seen, table.freq = seen.copy(), freq.copy()
            got.append(table._victims(count, local, applied))
        assert np.array_equal(got[0], got[1])


ID_MAP_KINDS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not ID_MAP_NATIVE, reason="the native extension is not built"))]


@pytest.mark.parametrize("native", ID_MAP_KINDS, ids=["numpy", "native"])
def test_id_map_matches_a_dict_through_inserts_and_removals(native: bool) -> None:
    rng = np.random.default_rng(0)
    ids = _raw_ids(rng, 5000)
    ref: dict[int, int] = {}
    m = IdMap(native=native)
    for lo in range(0, ids.size, 700):  # batches, with rebuilds as it grows
        batch = ids[lo:lo + 700]
        m.insert(batch, np.arange(lo, lo + batch.size))
        ref.update(zip(batch.tolist(), range(lo, lo + batch.size), strict=True))
        gone = batch[::3]
        assert m.remove(gone).all()
        for g in gone.tolist():
            del ref[g]
    query = np.concatenate([ids, _raw_ids(np.random.default_rng(1), 500)])
    want = np.array([ref.get(int(q), -1) for q in query])
    assert np.array_equal(m.find(query), want)
    assert len(m) == len(ref)
    keys, values = m.items()
    assert dict(zip(keys.tolist(), values.tolist(), strict=True)) == ref
    with pytest.raises(ValueError, match="distinct and absent"):
        m.insert(keys[:1], np.zeros(1, dtype=np.int64))


@pytest.mark.skipif(not ID_MAP_NATIVE, reason="the native extension is not built")
def test_the_native_id_map_answers_as_the_numpy_one_on_the_same_operations() -> None:
    """Clustered homes (ids that collide in a small table), tombstones reused, rebuilds:
    every find, remove and count agrees, and each map's bookkeeping matches its arrays;
    only the positions (so which tombstones are reused) may differ (module doc of
    hybridps/id_map.py)."""
    rng = np.random.default_rng(7)
    maps = [IdMap(native=False), IdMap(native=True)]
    live: set[int] = set()
    pool = _raw_ids(rng, 3000)
    for round_ in range(60):
        absent = np.array([i for i in rng.choice(pool, 80, replace=False).tolist()
                           if i not in live], dtype=np.int64)
        values = rng.integers(0, 1 << 40, size=absent.size)
        for m in maps:
            m.insert(absent, values, check=round_ % 2 == 0)
        live.update(absent.tolist())
        gone = rng.choice(pool, 60, replace=False)  # some present, some not
        hits = [m.remove(gone) for m in maps]
        assert np.array_equal(hits[0], hits[1])
        live.difference_update(gone[hits[0]].tolist())
        query = np.concatenate([rng.choice(pool, 200), _raw_ids(rng, 20)])
        finds = [m.find(query) for m in maps]
        assert np.array_equal(finds[0], finds[1])
        assert np.array_equal(maps[0].contains(query), maps[1].contains(query))
        for m in maps:
            assert len(m) == len(live) == int((m.values >= 0).sum())
            assert m.gone == int((m.values == GONE).sum())
    items = [dict(zip(*(a.tolist() for a in m.items()), strict=True)) for m in maps]
    assert items[0] == items[1] and set(items[0]) == live


@pytest.mark.skipif(not ID_MAP_NATIVE, reason="the native extension is not built")
@pytest.mark.parametrize("grow", [False, True], ids=["tombstones-dropped", "larger"])
def test_the_native_rebuild_is_placing_the_listed_entries(grow: bool) -> None:
    """A rebuild (idmap_rehash) leaves the table, position by position, as placing the
    entries listed in position order into a fresh table does, tombstones gone."""
    rng = np.random.default_rng(3)
    m = IdMap(native=True)
    ids = _raw_ids(rng, 4000)
    m.insert(ids, np.arange(ids.size))
    assert m.remove(ids[::2]).all() and m.gone > 0
    keys, values = m.items()
    want = IdMap(native=True)
    want._alloc(m.size * 2 if grow else m.size)
    want._place(keys, values)
    m._rebuild(want.size // 4)
    assert m.size == want.size and (m.count, m.gone) == (keys.size, 0)
    assert np.array_equal(m.table, want.table)
    assert np.array_equal(m.find(ids), np.where(np.arange(ids.size) % 2 == 1,
                                                np.arange(ids.size), -1))


def _entry(ids: list[int], dim: int = 3) -> PagedOut:
    n = len(ids)
    t = torch.tensor(ids, dtype=torch.int64)
    rows = torch.randn(n, dim)
    return PagedOut(t, rows, {"m": torch.randn(n, dim), "v": torch.rand(n, dim)},
                    torch.arange(n, dtype=torch.int64) * 10, torch.arange(n, dtype=torch.int64))


def test_paged_rows_round_trip_bitwise_and_expire() -> None:
    store = PagedRows(3, (("m", 3), ("v", 3)))
    out = _entry([7, -2, 2**63 - 1, 40])
    store.put(out)
    found, got = store.take(torch.tensor([40, 99, -2], dtype=torch.int64))
    assert found.tolist() == [True, False, True]
    for name in ("rows", "seen", "freq"):
        assert torch.equal(getattr(got, name), getattr(out, name)[[3, 1]])
    for name in ("m", "v"):
        assert torch.equal(got.state[name], out.state[name][[3, 1]])
    assert len(store) == 2  # taken ids are gone
    # left: 7 (seen at 0) and 2**63-1 (seen at 20); T=5 at step 26: both before 21 go
    assert store.expire(21, 5).tolist() == [7]
    dropped = store.expire(26, 5)
    assert sorted(dropped.tolist()) == [2**63 - 1] and len(store) == 0
    dropped = np.concatenate([np.array([7]), dropped])
    assert sorted(dropped.tolist()) == [7, 2**63 - 1] and len(store) == 0
    store.put(_entry([1, 2, 3]))
    assert store.drop_oldest(2, 30).tolist() == [1, 2]  # seen 0 and 10
    tomb_ids, tomb_steps = store.tombstones()
    assert tomb_ids.tolist()[-2:] == [1, 2] and tomb_steps.tolist()[-2:] == [30, 30]
    again = PagedRows(3, (("m", 3), ("v", 3)))
    state = store.state_dict()
    again.load(store.entries(), store.tombstones(), state["counters"])
    assert torch.equal(again.entries().rows, store.entries().rows)


def test_count_min_never_undercounts_and_stays_within_its_bound() -> None:
    rng = np.random.default_rng(3)
    sketch = CountMinSketch(width=512)
    truth: dict[int, int] = {}
    for _ in range(60):
        step_ids = np.unique(rng.integers(0, 3000, size=200))
        sketch.add(step_ids)
        for i in step_ids.tolist():
            truth[i] = truth.get(i, 0) + 1
    ids = np.array(sorted(truth))
    est = sketch.estimate(ids)
    true = np.array([truth[i] for i in ids.tolist()])
    assert (est >= true).all()
    over = est - true
    # the bound e/width * N holds with probability >= 1 - e^-4 per id: nearly all ids
    assert (over <= sketch.error_bound()).mean() > 0.95


def test_admission_filters() -> None:
    ids = np.arange(-50, 50, dtype=np.int64)
    always = Admission(DynamicSpec(), seed=0, table_index=0)
    assert always.admit(ids, 0).all()
    third = Admission(DynamicSpec(admission="threshold", threshold=3), seed=0, table_index=0)
    assert not third.admit(ids, 0).any() and not third.admit(ids, 1).any()
    assert third.admit(ids, 2).all()  # the third step each id was seen in
    spec = DynamicSpec(admission="probability", probability=0.25)
    a, b = Admission(spec, 7, 0), Admission(spec, 7, 0)
    many = np.arange(40_000, dtype=np.int64)
    first = a.admit(many, 5)
    assert np.array_equal(first, b.admit(many, 5))  # reproducible
    assert abs(first.mean() - 0.25) < 0.01
    assert not np.array_equal(first, a.admit(many, 6))  # a new chance each step
    assert not np.array_equal(first, Admission(spec, 8, 0).admit(many, 5))


class FakePager:
    """Records the page calls; holds what goes out (ids only)."""

    def __init__(self) -> None:
        self.stored: dict[int, tuple[int, int]] = {}
        self.calls: list[PageRequest] = []

    def __call__(self, req: PageRequest) -> PageAnswer:
        self.calls.append(req)
        for i, s, f in zip(req.out_ids.tolist(), req.out_seen.tolist(), req.out_freq.tolist(),
                           strict=True):
            self.stored[i] = (s, f)
        found = np.array([i in self.stored for i in req.in_ids.tolist()], dtype=bool)
        meta = [self.stored.pop(i) for i in req.in_ids[found].tolist()]
        return PageAnswer(found, np.array([m[0] for m in meta], dtype=np.int64),
                          np.array([m[1] for m in meta], dtype=np.int64))


def _table(eviction: str = "lru", n: int = 3, start: int = 10) -> SlotTable:
    return SlotTable("t", DynamicSpec(eviction=eviction), start, n, seed=0, table_index=0)


def _step(t: SlotTable, ids: list[int], step: int, applied: int, pager: FakePager
          ) -> list[int]:
    slots, _ = t.translate(np.array(ids, dtype=np.int64), step, applied, pager)
    return slots.tolist()


def test_free_slots_lowest_first_in_batch_order_then_lru() -> None:
    t, pager = _table(), FakePager()
    assert _step(t, [30, -5, 8], 0, -1, pager) == [10, 11, 12]
    assert _step(t, [8], 1, 0, pager) == [12]
    # 30 and -5 were both last seen at step 0: the tie goes to the lowest slot (10)
    assert _step(t, [99], 2, 1, pager) == [10]
    assert pager.calls[-1].out_ids.tolist() == [30]
    assert _step(t, [30, 8], 3, 2, pager) == [11, 12]  # 30 back onto -5's slot (LRU)
    assert pager.calls[-1].in_ids.tolist() == [30] and pager.calls[-1].out_ids.tolist() == [-5]
    assert t.stats.page_ins == 1 and t.stats.evictions == 2


def test_lfu_evicts_the_least_frequent_then_least_recent() -> None:
    t, pager = _table("lfu"), FakePager()
    _step(t, [1, 2, 3], 0, -1, pager)
    _step(t, [1, 2], 1, 0, pager)
    _step(t, [1], 2, 1, pager)  # freq: 1 -> 3, 2 -> 2, 3 -> 1
    assert _step(t, [4], 3, 2, pager) == [12]  # 3's slot
    assert _step(t, [5], 4, 3, pager) == [12]  # 4 (freq 1) before 2 (freq 2)
    _step(t, [6, 7], 5, 4, pager)  # slots of 5 then 2: freq 1 and 2
    assert pager.calls[-1].out_ids.tolist() == [5, 2]


def test_pin_rule() -> None:
    """A slot looked up after the newest applied step has an update pending: it is not
    evicted, and an id that would need it is refused (reads zeros) until it may go."""
    t, pager = _table(n=2), FakePager()
    _step(t, [1, 2], 0, -1, pager)
    assert _step(t, [3], 1, -1, pager) == [-1]  # both pinned (seen 0 > applied -1)
    assert t.stats.refused_capacity == 1 and not pager.calls
    assert _step(t, [3, 1], 2, 0, pager) == [11, 10]  # 2's slot, free since step 0 applied
    assert pager.calls[-1].out_ids.tolist() == [2]
    assert _step(t, [4], 3, 1, pager) == [-1]  # 1 and 3 seen at step 2 > 1


def test_bad_specs_name_the_value() -> None:
    with pytest.raises(ValueError, match="dynamic capacity 0 must be >= 1"):
        parse_tables("user:0:dynamic")
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        parse_tables("user:10:dynamic:mru")
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        DynamicSpec(eviction="fifo")
    with pytest.raises(ValueError, match="threshold=0 must be >= 1"):
        parse_tables("user:10:dynamic:threshold=0")
    with pytest.raises(ValueError, match="dynamic capacity 0 must be >= 1"):
        TableConfig("user", 0, 4, DynamicSpec())
    with pytest.raises(ValueError, match="dynamic capacity 1 is below the world size 2"):
        ShardedEmbedding([TableConfig("user", 1, 4, DynamicSpec())], rank=0, world_size=2)
    assert parse_tables("u:10:dynamic:lfu:probability=0.5:expire=7,s:4")[0][3] == DynamicSpec(
        eviction="lfu", admission="probability", probability=0.5, expire_steps=7)


@pytest.mark.parametrize(("options", "policy", "both"), [
    ("lru:lfu", "eviction", "(lru, lfu)"),
    ("lfu:lfu", "eviction", "(lfu, lfu)"),
    ("threshold=2:probability=0.5", "admission", "(threshold=2, probability=0.5)"),
    ("always:threshold=3", "admission", "(always, threshold=3)"),
    ("expire=3:lru:expire=4", "expire", "(expire=3, expire=4)"),
])
def test_a_policy_given_twice_is_refused_naming_both(options: str, policy: str,
                                                     both: str) -> None:
    with pytest.raises(ValueError, match=re.escape(
            f"dynamic spec {options!r}: {policy} given twice {both}")):
        parse_tables(f"user:10:dynamic:{options}")


def test_one_option_per_policy_in_any_order_is_accepted() -> None:
    want = DynamicSpec(eviction="lfu", admission="threshold", threshold=3, expire_steps=5)
    for options in ("lfu:threshold=3:expire=5", "expire=5:threshold=3:lfu"):
        assert parse_tables(f"u:10:dynamic:{options}")[0][3] == want
    assert parse_tables("u:10:dynamic:always:lru")[0][3] == DynamicSpec()
    assert parse_tables("u:10:dynamic:probability=0.25")[0][3] == DynamicSpec(
        admission="probability", probability=0.25)


def test_a_bad_table_config_or_spec_is_a_config_error_naming_the_value() -> None:
    """ConfigError: the worker reports it as one line (worker/main.py), also when a custom
    Task's tables() builds it (worker.tasks.task_tables names the task)."""
    from hybridps.cli import ConfigError
    from worker.tasks import task_tables

    bad: list[tuple[Callable[[], object], str]] = [
        (lambda: TableConfig("user", 0, 4), "table 'user': num_rows=0 must be >= 1"),
        (lambda: TableConfig("user", 10, 0), "table 'user': dim=0 must be >= 1"),
        (lambda: TableConfig("user", 1e6, 4), "table 'user': num_rows=1000000.0 is not an int"),
        (lambda: TableConfig("2x", 10, 4), "table name '2x' must be a Python identifier"),
        (lambda: TableConfig("user", 10, 4, "lru"), "dynamic='lru' is not a DynamicSpec"),
        (lambda: DynamicSpec(eviction="mru"), "unknown eviction policy 'mru'"),
        (lambda: DynamicSpec(threshold="2"), "threshold='2' is not an int"),
        (lambda: DynamicSpec(probability=0.0), "probability=0.0 must be in (0, 1]"),
    ]
    for make, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            make()
    assert TableConfig("user", np.int64(10), 4).num_rows == 10

    class BadTables:
        name = "bad_tables"

        def tables(self) -> list[TableConfig]:
            return [TableConfig("user", -5, 4)]

    with pytest.raises(ConfigError, match=re.escape(
            "task 'bad_tables': tables(): table 'user': num_rows=-5 must be >= 1")):
        task_tables(BadTables())  # type: ignore[arg-type]


def test_checkpoint_files_reshard_every_id_to_its_new_owner(tmp_path: Path) -> None:
    """Two saving ranks' slots and paged rows, read back at 1 and at 3 ranks: every live id
    is held exactly once, on its owner at the new world size, with its row, optimizer state,
    last step seen and frequency; an id keeps its slot where its new owner holds it."""
    capacity, dim, world = 10, 3, 2
    layout = (("m", dim), ("v", dim))
    rng = np.random.default_rng(5)
    truth: dict[int, tuple[torch.Tensor, ...]] = {}
    shards = []
    slot_of: dict[int, int] = {}
    for rank in range(world):
        start, end = rank * capacity // world, (rank + 1) * capacity // world
        n = end - start
        mine = [i for i in rng.integers(-10**12, 10**12, 200).tolist()
                if int(owner_of_ids(torch.tensor([i]), world)[0]) == rank][:n + 3]
        on_slots, paged_ids = mine[:n - 1], mine[n - 1:]  # one slot left free
        t = SlotTable("u", DynamicSpec(), start, n, seed=0, table_index=0)
        seen = np.full(n, -1, dtype=np.int64)
        seen[:n - 1] = rng.integers(0, 50, n - 1)
        slot_id = np.zeros(n, dtype=np.int64)
        slot_id[:n - 1] = on_slots
        freq = np.where(seen >= 0, rng.integers(1, 9, n), 0)
        t.load(slot_id, seen, freq, np.array(paged_ids, dtype=np.int64))
        rows, m, v = torch.randn(n, dim), torch.randn(n, dim), torch.rand(n, dim)
        store = PagedRows(dim, layout)
        entries = _entry(paged_ids, dim)
        store.put(entries)
        for s in range(n - 1):
            truth[on_slots[s]] = (rows[s], m[s], v[s], torch.tensor(int(seen[s])),
                                  torch.tensor(int(freq[s])))
            slot_of[on_slots[s]] = start + s
        for i, ident in enumerate(paged_ids):
            truth[ident] = (entries.rows[i], entries.state["m"][i], entries.state["v"][i],
                            entries.seen[i], entries.freq[i])
        files = {
            "rows": save_shard(tmp_path, rows_file("u", rank), kind="rows", table="u",
                               rank=rank, num_rows=capacity, dim=dim, row_start=start,
                               row_end=end, tensors={"weight": rows}),
            "optim": save_optim_state(tmp_path, table="u", rank=rank, num_rows=capacity,
                                      dim=dim, row_start=start, row_end=end,
                                      state=OptimState({"m": m, "v": v}, 4, 7),
                                      optimizer={"kind": "adam"}),
            "ids": save_ids(tmp_path, table="u", rank=rank, start=start, end=end,
                            state=t.state_dict(), step=7),
            "paged": save_paged(tmp_path, table="u", rank=rank, start=start, end=end,
                                store=store, step=7)}
        shards.append(ManifestShard(rank, start, end, {
            k: FileEntry(f.file, f.bytes, f.crc32) for k, f in files.items()}))
    manifest = Manifest(step=7, tables={"u": ManifestTable(capacity, dim, tuple(shards),
                                                           {"dynamic": {}})},
                        world_size=world)
    manifest.write(tmp_path)
    for new_world in (1, 3):
        held: dict[int, tuple[torch.Tensor, ...]] = {}
        for rank in range(new_world):
            start, end = rank * capacity // new_world, (rank + 1) * capacity // new_world
            plan = restore_plan(tmp_path, Manifest.read(tmp_path), "u", dim, layout, rank,
                                new_world, start, end)
            full_rows, _ = load_rows(tmp_path, "u", capacity, dim,
                                     manifest.shards("u", "rows"), start, end, ["weight"])
            full_state, _ = load_rows(tmp_path, "u", capacity, dim,
                                      manifest.shards("u", "optim"), start, end, ["m", "v"])
            for s in np.flatnonzero(plan.kept).tolist():
                ident = int(plan.slot_id[s])
                assert slot_of[ident] == start + s  # kept its slot
                assert ident not in held
                held[ident] = (full_rows["weight"][s], full_state["m"][s],  # type: ignore
                               full_state["v"][s], torch.tensor(int(plan.seen[s])),  # type: ignore
                               torch.tensor(int(plan.freq[s])))
            p = plan.paged
            assert (owner_of_ids(p.ids, new_world) == rank).all()
            for i, ident in enumerate(p.ids.tolist()):
                assert ident not in held
                held[ident] = (p.rows[i], p.state["m"][i], p.state["v"][i], p.seen[i],
                               p.freq[i])
        assert set(held) == set(truth)
        for ident, want in truth.items():
            for a, b in zip(held[ident], want, strict=True):
                assert torch.equal(a, b), (new_world, ident)
