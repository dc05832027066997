"""The fused native step of a dynamic table (worker/embedding/dynamic/fused.py over
hybridps/native/dynamic_step.c) against the Python steps it follows (SlotTable.translate,
DynamicIds' row moves, PagedRows.swap): the same stream trained both ways leaves every
array bitwise the same (rows, optimizer state, slots, maps, paged store, counts), for
each eviction and admission policy, with expiry, at staleness 0 and 2, and for optimizers
with and without per-row state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import worker.embedding.dynamic.ids as dynamic_ids
from tests.worker.embedding.dynamic.test_dynamic_train import Run, batches, dynamic_table
from worker.embedding.dynamic.slots import NATIVE

pytestmark = pytest.mark.skipif(not NATIVE, reason="the native extension is not built")


def _map_items(m: object) -> dict[int, int]:
    keys, values = m.items()  # type: ignore[attr-defined]
    return dict(zip(keys.tolist(), values.tolist(), strict=True))


def _assert_same(fused: Run, reference: Run) -> None:
    name = fused.name
    assert torch.equal(fused.emb.weights[name].data, reference.emb.weights[name].data)
    for key, t in fused.source.state[name].items():
        assert torch.equal(t, reference.source.state[name][key]), key
    a = fused.dynamic.tables[name].slots
    b = reference.dynamic.tables[name].slots
    for field in ("slot_id", "seen", "freq", "free"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert a.stats == b.stats
    assert not a.pinned.any()  # the fused step's scratch is left all zero
    assert _map_items(a.map) == _map_items(b.map)
    assert set(_map_items(a.paged)) == set(_map_items(b.paged))
    assert a.map.count == b.map.count and a.paged.count == b.paged.count
    sa, sb = fused.source.paged[name], reference.source.paged[name]
    assert len(sa) == len(sb) and sa.index.count == len(_map_items(sa.index))
    ea, eb = sa.entries(), sb.entries()
    for got, want in ((ea.ids, eb.ids), (ea.rows, eb.rows), (ea.seen, eb.seen),
                      (ea.freq, eb.freq)):
        assert torch.equal(got, want)
    for key in eb.state:
        assert torch.equal(ea.state[key], eb.state[key]), key
    assert all(np.array_equal(x, y) for x, y in zip(sa.tombstones(), sb.tombstones(),
                                                    strict=True))
    # the store's bookkeeping stays whole: every position is either free or holds an id
    used = set(_map_items(sa.index).values())
    free = set(sa.free[:sa.n_free].tolist())
    assert not used & free and len(used) + len(free) == sa.capacity


def _pair(capacity: int, staleness: int, kind: str = "adam", **spec: object
          ) -> tuple[Run, Run]:
    fused = Run(dynamic_table(capacity, **spec), staleness, kind)
    reference = Run(dynamic_table(capacity, **spec), staleness, kind)
    reference.dynamic.fused = False
    return fused, reference


@pytest.mark.parametrize(("staleness", "spec"), [
    (0, {"eviction": "lru"}),
    (2, {"eviction": "lru"}),
    (2, {"eviction": "lfu"}),
    (0, {"eviction": "lfu", "expire_steps": 3}),
    (2, {"eviction": "lru", "expire_steps": 6}),
    (1, {"admission": "threshold", "threshold": 2, "sketch_width": 64}),
    (2, {"admission": "probability", "probability": 0.5, "eviction": "lfu"}),
])
def test_the_fused_step_is_the_python_steps(staleness: int, spec: dict[str, object],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"fused": 0}
    serve = dynamic_ids.serve_fused

    def counted(*args: object, **kwargs: object) -> np.ndarray:
        calls["fused"] += 1
        return serve(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dynamic_ids, "serve_fused", counted)
    data = batches(60, 8)
    fused, reference = _pair(12, staleness, **spec)
    fused.train(data)
    assert calls["fused"] == len(data)  # every step took the fused path
    reference.train(data)
    assert calls["fused"] == len(data)  # ... and the reference never did
    stats = fused.dynamic.tables["user"].slots.stats
    assert stats.evictions > 20 and stats.page_ins > 5
    if spec.get("expire_steps"):
        assert stats.dropped_paged > 0
    if spec.get("admission", "always") != "always":
        assert stats.refused_filter > 0
    _assert_same(fused, reference)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "partial_rowwise_adam"])
def test_the_fused_step_moves_each_optimizers_state(kind: str) -> None:
    data = batches(40, 8)
    fused, reference = _pair(12, 2, kind)
    fused.train(data)
    reference.train(data)
    assert fused.dynamic.tables["user"].slots.stats.page_ins > 5
    _assert_same(fused, reference)


def test_capacity_refusals_are_the_same() -> None:
    """At K=2 with 6 slots for 8 distinct ids a step, the pin rule leaves too few slots:
    some ids are refused for capacity, on both paths alike."""
    data = batches(30, 8)
    fused, reference = _pair(6, 2)
    fused.train(data)
    reference.train(data)
    assert fused.dynamic.tables["user"].slots.stats.refused_capacity > 0
    _assert_same(fused, reference)


def test_rows_elsewhere_take_the_python_steps() -> None:
    """State that is not fp32 on the CPU (here: float64) is not fusable: the step falls
    back, with the same result."""
    from worker.embedding.dynamic.fused import fusable

    run = Run(dynamic_table(12), 0)
    table = run.dynamic.tables["user"]
    store, state = run.source.local_store("user")  # type: ignore[misc]
    weight = run.emb.weights["user"].data
    assert fusable(table.slots, store, weight, state)
    assert not fusable(table.slots, store, weight.double(), state)
    assert not fusable(table.slots, store, weight, {k: v[:5] for k, v in state.items()})


def test_the_lru_queue_compacts_and_rebuilds_without_changing_a_decision() -> None:
    """400 steps append more records than the queue's first size (it compacts its stale
    ones), and a run that leaves the fused path for stretches (the queue is rebuilt from
    the slots when it comes back) decides everything as the Python steps do."""
    data = batches(400, 8)
    fused, reference = _pair(12, 1)
    mixed, _ = _pair(12, 1)
    fused.train(data)
    reference.train(data)
    queue = fused.dynamic.tables["user"].slots.lru
    assert queue.valid and queue.records.shape[0] >= 1024
    assert queue.head > 0  # victims came off the head
    _assert_same(fused, reference)
    rebuilds = {"n": 0}
    table = mixed.dynamic.tables["user"].slots
    ready = table.lru.ready

    def counted(seen: np.ndarray, more: int) -> None:
        rebuilds["n"] += not table.lru.valid
        ready(seen, more)

    table.lru.ready = counted  # type: ignore[method-assign]
    for start in range(0, len(data), 50):
        mixed.dynamic.fused = (start // 50) % 2 == 0
        mixed.train_steps(data, range(start, start + 50))
    mixed.window.drain(len(data) - 1)
    assert rebuilds["n"] == 4
    _assert_same(mixed, reference)


def test_an_in_process_store_holds_the_only_set_of_paged_ids() -> None:
    """With the local optimizer, the slot table's paged ids are the store's own index
    (one map of them, not two), through training and a restore of the store."""
    run = Run(dynamic_table(12), 1)
    run.train(batches(30, 8))
    slots = run.dynamic.tables["user"].slots
    store = run.source.paged["user"]
    assert slots.paged is store.index and len(store) > 0
    assert slots.shares_paged_with(store)
    saved = store.entries()
    store.load(saved)
    assert slots.paged is store.index  # the restored store's new index
    assert sorted(slots.state_dict()["paged_ids"].tolist()) == sorted(saved.ids.tolist())


def test_a_bad_array_is_refused_before_anything_moves() -> None:
    """serve_step checks every array's size before it writes: with a hits-scratch array of
    the wrong size nothing moves (slots, maps, rows)."""
    from worker.embedding.dynamic.fused import serve_fused

    data = batches(20, 8)
    run = Run(dynamic_table(12), 0)
    run.train(data)
    table = run.dynamic.tables["user"]
    slots = table.slots
    store, state = run.source.local_store("user")  # type: ignore[misc]
    weight = run.emb.weights["user"].data
    before = (slots.slot_id.copy(), slots.seen.copy(), _map_items(slots.map),
              _map_items(store.index), weight.clone())
    good = slots.pinned
    slots.pinned = np.zeros(slots.n - 1, dtype=np.uint8)
    with pytest.raises(ValueError, match="inconsistent sizes"):
        serve_fused(slots, store, weight, state, np.arange(100, 120, dtype=np.int64),
                    step=20, applied_through=19, seed=0, table_index=0, init_std=0.5,
                    expire_steps=0)
    slots.pinned = good
    assert np.array_equal(before[0], slots.slot_id) and np.array_equal(before[1], slots.seen)
    assert before[2] == _map_items(slots.map) and before[3] == _map_items(store.index)
    assert torch.equal(before[4], weight)
    assert not slots.pinned.any()


@pytest.mark.parametrize("more", [3, 700])
def test_the_lru_queue_compacts_in_place_as_numpy_does(more: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full queue's compaction keeps exactly its live records, in order, natively in
    place (a bigger array only when the live ones and `more` fill over half of it) as
    the numpy filter does."""
    import worker.embedding.dynamic.slots as dynamic_slots
    from worker.embedding.dynamic.slots import LruQueue

    rng = np.random.default_rng(more)
    n, size = 500, 2048
    in_place = 0
    for _ in range(5):
        seen = rng.integers(0, 40, n).astype(np.int64)
        count = int(rng.integers(size // 2, size - 2))
        slots = rng.integers(0, n, count)
        values = np.where(rng.random(count) < 0.4, seen[slots], seen[slots] - 1)
        head = int(rng.integers(0, 5))
        need = size - (head + count) + more  # tail + need > size: a compaction
        queues = {}
        for name in ("native", "numpy"):
            q = LruQueue()
            q.records = np.full((size, 2), -7, dtype=np.int64)
            q.records[head:head + count, 0] = values
            q.records[head:head + count, 1] = slots
            q.head, q.tail, q.valid = head, head + count, True
            if name == "numpy":
                monkeypatch.setattr(dynamic_slots, "_ext", None)
            q.ready(seen, need)
            monkeypatch.undo()
            queues[name] = q
        records = np.stack([values, slots], axis=1)
        live = records[seen[slots] == values]
        for q in queues.values():
            assert np.array_equal(q.records[q.head:q.tail], live)
            assert q.tail + need <= q.records.shape[0]
        grew = 2 * (live.shape[0] + need) > size
        assert (queues["native"].records.shape[0] != size) == grew
        in_place += not grew
    assert in_place > 0 if more == 3 else in_place == 0
    assert dynamic_slots._ext is not None
