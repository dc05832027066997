"""The paged store's drop order (hybridps/paged_order.py through hybridps/paged_rows.py):
under random puts, takes, expiries and budget drops it drops exactly the ids a full sort
by (seen, id) names, and its bookkeeping stays bounded by the store's size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridps.paged_order import REBUILD_SLACK
from hybridps.paged_rows import PagedOut, PagedRows

DIM = 2
LAYOUT = [("m", 2)]


def _out(ids: np.ndarray, seen: np.ndarray) -> PagedOut:
    n = ids.size
    return PagedOut(torch.from_numpy(ids.astype(np.int64)), torch.randn(n, DIM),
                    {"m": torch.randn(n, 2)}, torch.from_numpy(seen.astype(np.int64)),
                    torch.ones(n, dtype=torch.int64))


def _reference_oldest(store: PagedRows, count: int) -> list[int]:
    e = store.entries()
    order = np.lexsort((e.ids.numpy(), e.seen.numpy()))[:count]
    return e.ids.numpy()[order].tolist()


def _reference_expired(store: PagedRows, before: int) -> list[int]:
    e = store.entries()
    return sorted(e.ids.numpy()[e.seen.numpy() < before].tolist())


@pytest.mark.parametrize("ordered", [True, False])
def test_random_drops_match_a_full_sort(ordered: bool) -> None:
    """The ordered store (the server's) and the scanning one (the worker's) alike."""
    rng = np.random.default_rng(11)
    store = PagedRows(DIM, LAYOUT, ordered=ordered)
    held: set[int] = set()
    step = 0
    for _ in range(400):
        step += int(rng.integers(0, 3))
        op = rng.random()
        if op < 0.5:  # rows leave slots, seen at recent (repeated) steps
            fresh = np.setdiff1d(rng.integers(0, 3000, size=int(rng.integers(1, 60))),
                                 np.fromiter(held, dtype=np.int64, count=len(held)))
            seen = step - rng.integers(0, 30, size=fresh.size)
            store.put(_out(fresh, seen))
            held |= set(fresh.tolist())
        elif op < 0.75:  # some come back, some never were here
            ask = rng.integers(0, 3000, size=int(rng.integers(1, 80)))
            ask = np.unique(ask)
            _, got = store.take(torch.from_numpy(ask))
            assert set(got.ids.tolist()) == held & set(ask.tolist())
            held -= set(got.ids.tolist())
        elif op < 0.9:
            count = int(rng.integers(0, 40))
            want = _reference_oldest(store, count)
            assert store.drop_oldest(count, step).tolist() == want
            held -= set(want)
        else:
            expire = int(rng.integers(1, 20))
            store.last_expiry = -1  # every call scans (the cadence is not under test)
            want = _reference_expired(store, step - expire)
            assert store.expire(step, expire).tolist() == want
            held -= set(want)
        assert set(store.entries().ids.tolist()) == held
        assert store.order.entries <= 2 * len(store) + REBUILD_SLACK + 80


def test_a_drop_costs_the_rows_it_drops_not_the_store() -> None:
    """A full store's drop of a few ids reads only the oldest bucket: the order's other
    buckets stay untouched (none is re-sorted), whatever the store holds."""
    store = PagedRows(DIM, LAYOUT, ordered=True)
    n = 50_000
    store.put(_out(np.arange(n), np.arange(n) // 10))  # 5,000 steps, 10 ids each
    untouched = len(store.order._buckets) - 1
    assert store.drop_oldest(3, 9_999).tolist() == [0, 1, 2]
    assert len(store.order._sorted) == 1 and len(store.order._buckets) == untouched + 1
    assert store.drop_oldest(8, 9_999).tolist() == list(range(3, 11))
    assert store.expire(9_999, 9_999 - 3).tolist() == list(range(11, 30))


def test_an_id_taken_from_a_partly_dropped_step_is_not_dropped_again() -> None:
    """A drop leaves the rest of its step's bucket sorted; an id of it paged back in
    since is no longer the store's to drop."""
    store = PagedRows(DIM, LAYOUT, ordered=True)
    store.put(_out(np.arange(10), np.ones(10)))
    assert store.drop_oldest(3, 5).tolist() == [0, 1, 2]
    found, _ = store.take(torch.tensor([3]))
    assert found.tolist() == [True]
    assert store.drop_oldest(2, 6).tolist() == [4, 5]
    assert store.entries().ids.tolist() == [6, 7, 8, 9] and len(store) == 4
