"""hybridps/growable.py: a paged store's columns grow in place, keeping their rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridps import growable
from hybridps.growable import GrowableColumn
from hybridps.paged_rows import PagedOut, PagedRows


def test_growing_keeps_the_rows_and_moves_only_past_the_reservation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(growable, "_STRICT", False)  # the default overcommit policy
    col = GrowableColumn(np.float32, 16)
    rows = (growable.RESERVE_MIN_BYTES // col.row_bytes) * 2
    first = col.resize(rows)
    first[:] = np.arange(first.size, dtype=np.float32).reshape(first.shape)
    reserved = col.reserved_rows
    assert reserved >= rows * growable.RESERVE_FACTOR // 2  # reserved far beyond its size
    bigger = col.resize(reserved)
    assert bigger.shape == (reserved, 16) and col.copies == 0
    assert np.shares_memory(first, bigger)  # in place: the same memory, a longer view
    assert np.array_equal(bigger[:rows], first)
    beyond = col.resize(reserved + 1)  # past the reservation: one copy, rows kept
    assert col.copies == 1 and not np.shares_memory(beyond, first)
    assert np.array_equal(beyond[:rows].ravel(), np.arange(rows * 16, dtype=np.float32))


def test_small_columns_are_plain_and_a_refused_reservation_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    col = GrowableColumn(np.int64)
    small = col.resize(10)
    small[:] = np.arange(10)
    assert col.reserved_rows == 10  # below RESERVE_MIN_BYTES: an array of its size
    monkeypatch.setattr(growable, "_mapped", lambda nbytes: None)  # every mapping refused
    rows = growable.RESERVE_MIN_BYTES // 8 * 3
    grown = col.resize(rows)
    assert col.reserved_rows == rows and np.array_equal(grown[:10], np.arange(10))
    with pytest.raises(ValueError, match="column rows -1"):
        col.resize(-1)


def test_strict_overcommit_reserves_only_what_is_needed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vm.overcommit_memory = 2 charges every mapped byte: no reservation beyond need."""
    monkeypatch.setattr(growable, "_STRICT", True)
    col = GrowableColumn(np.float32, 16)
    rows = growable.RESERVE_MIN_BYTES // col.row_bytes * 2
    col.resize(rows)[:] = 1.0
    assert col.reserved_rows == rows
    grown = col.resize(rows + 1)
    assert col.copies == 1 and col.reserved_rows == rows + 1 and bool((grown[:rows] == 1).all())


def test_a_reservation_capped_by_memory_holds_whole_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(growable, "_STRICT", False)
    col = GrowableColumn(np.float32, 3)  # 12-byte rows
    rows = growable.RESERVE_MIN_BYTES // col.row_bytes + 1
    monkeypatch.setattr(growable, "_memory_bytes", lambda: rows * col.row_bytes * 4 + 5)
    view = col.resize(rows)
    assert view.shape == (rows, 3) and col.reserved_rows == rows * 4


def test_a_store_past_its_columns_first_reservation_keeps_every_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PagedRows over columns with a tiny reservation factor: growth moves the pools
    several times, and every stored row, state and count comes back bitwise."""
    monkeypatch.setattr(growable, "RESERVE_MIN_BYTES", 256)
    monkeypatch.setattr(growable, "RESERVE_FACTOR", 2)
    store = PagedRows(4, (("m", 4), ("v", 4)))
    gen = torch.Generator().manual_seed(0)
    n = 3000
    ids = torch.randperm(10 * n, generator=gen)[:n].to(torch.int64) - 5 * n
    rows, m, v = (torch.randn(n, 4, generator=gen) for _ in range(3))
    seen, freq = torch.arange(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64) % 7
    for lo in range(0, n, 250):
        part = slice(lo, lo + 250)
        store.put(PagedOut(ids[part], rows[part], {"m": m[part], "v": v[part]}, seen[part],
                           freq[part]))
    assert sum(c.copies for c in store._columns.values()) > 0
    found, got = store.take(ids.flip(0))
    assert bool(found.all()) and len(store) == 0
    assert torch.equal(got.ids, ids.flip(0)) and torch.equal(got.rows, rows.flip(0))
    assert torch.equal(got.state["m"], m.flip(0)) and torch.equal(got.state["v"], v.flip(0))
    assert torch.equal(got.seen, seen.flip(0)) and torch.equal(got.freq, freq.flip(0))
