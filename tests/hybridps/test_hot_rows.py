"""The row-granular hot set of hybridps/spilled_rows.py: rows found through the slot map,
cold rows appended to a log of pages in eviction order, the log's pages reused and
compacted within its reservation. Against the same columns held in memory (bitwise),
under reads and writes, partial writes, a checkpoint's reads, and runs long enough that
the log must reclaim its dead rows many times over."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridps.errors import CorruptSpill
from hybridps.spilled_rows import (
    HeldRows,
    SpilledRows,
    spilled_bookkeeping_bytes,
    spilled_bytes,
    spilled_rows_for_disk,
)

LAYOUT = [("m", 4), ("v", 4)]


def _pair(tmp_path: Path, rows: int, frames: int, unit_rows: int, page_rows: int = 6,
          name: str = "h") -> tuple[HeldRows, SpilledRows]:
    held = HeldRows({n: torch.zeros(rows, w) for n, w in LAYOUT})
    spilled = SpilledRows(tmp_path / f"{name}.pages", LAYOUT, rows, page_rows, frames,
                          unit_rows=unit_rows)
    return held, spilled


def _same(held: HeldRows, spilled: SpilledRows, lo: int = 0, hi: int | None = None) -> None:
    hi = held.rows if hi is None else hi
    want, got = held.read(lo, hi), spilled.read(lo, hi)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def _live_units(s: SpilledRows) -> int:
    """Units whose copy on disk is live: cold ones on disk, and resident clean copies."""
    cold = int((s.where >= 0).sum())
    return cold + int((s.disk_of[:s.used] >= 0).sum())


def _zipf_ids(rng: np.random.Generator, rows: int, spread: np.ndarray, draws: int
              ) -> torch.Tensor:
    x = rng.zipf(1.1, draws * 2)
    x = x[x <= rows][:draws] - 1
    return torch.from_numpy(np.unique(spread[x]))


@pytest.mark.parametrize("unit_rows,page_rows", [(1, 6), (3, 24)])
def test_a_long_run_keeps_the_log_within_its_reservation(tmp_path: Path, unit_rows: int,
                                                         page_rows: int) -> None:
    """Far more row versions written than the log holds: pages whose rows all died are
    reused, the least live ones compacted (a resident row's clean copy there dropped, the
    row written again when it leaves), the disk never beyond the reservation, bitwise."""
    rows = 300
    held, spilled = _pair(tmp_path, rows, 2, unit_rows, page_rows)
    g = torch.Generator().manual_seed(0)
    held.write(0, {n: torch.randn(rows, w, generator=g) for n, w in LAYOUT})
    spilled.write(0, held.read(0, rows))
    for step in range(400):
        n = int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randperm(rows, generator=g)[:n].sort().values
        write = step % 3 != 0  # reads too: clean copies stay live on disk
        for holder in (held, spilled):
            cols, at = holder.view(ids, write=write)
            if write:
                cols["m"].index_add_(0, at, torch.full((n, 4), 0.5))
                cols["v"].index_copy_(0, at, cols["v"].index_select(0, at) * 0.25 + step)
        assert spilled.disk_bytes <= spilled.max_disk_bytes == spilled_bytes(
            LAYOUT, rows, spilled.page_rows, unit_rows)
        assert int(spilled.live.sum()) == _live_units(spilled), step
        assert int(spilled.live.min()) >= 0
        if step % 50 == 0:
            _same(held, spilled, 7, rows - 3)
    _same(held, spilled)
    c = spilled.counters()
    assert c["compactions"] > 0 and c["moved_units"] > 0  # the log reclaimed pages
    assert c["spills"] > 2 * spilled.log_pages  # the pages written many times over
    assert c["log_pages_used"] <= spilled.log_pages
    spilled.close()
    assert not (tmp_path / "h.pages").exists()


def test_the_hot_set_is_row_granular(tmp_path: Path) -> None:
    """Zipf ids spread over the table: the hot rows stay in memory whatever pages they
    came from, a fill reads only the pages of the rows it misses, and a row leaving
    writes only its own rows (no page it shared with other rows comes along)."""
    rows, page_rows = 4000, 16
    held, spilled = _pair(tmp_path, rows, frames=1000 // page_rows, unit_rows=1,
                          page_rows=page_rows)
    rng = np.random.default_rng(0)
    spread = rng.permutation(rows)
    held.write(0, {n: torch.ones(rows, w) for n, w in LAYOUT})
    spilled.write(0, held.read(0, rows))
    for _ in range(150):
        ids = _zipf_ids(rng, rows, spread, 256)
        for holder in (held, spilled):
            cols, at = holder.view(ids)
            cols["m"].index_add_(0, at, torch.ones(ids.numel(), 4))
    before = spilled.counters()
    pushed = 0
    for _ in range(50):
        ids = _zipf_ids(rng, rows, spread, 256)
        pushed += ids.numel()
        for holder in (held, spilled):
            cols, at = holder.view(ids)
            cols["m"].index_add_(0, at, torch.ones(ids.numel(), 4))
    c = {k: v - before[k] for k, v in spilled.counters().items()}
    assert c["hits"] + c["misses"] == pushed
    # a quarter of the rows in memory holds most of the Zipf accesses, whatever page
    # each hot row was restored to (a page-granular clock over these spread rows, each
    # page holding 16 of them, keeps a page's one hot row at the cost of 15 cold ones)
    assert c["hits"] / pushed > 0.6
    assert c["fills"] - c["compacted_pages"] <= c["misses"]  # a page a missed row at most
    rows_written = c["spills"] * spilled.page_rows
    # its own rows only (and the rows a compaction moved), a part page or two a call
    assert rows_written <= c["misses"] + c["moved_units"] + 2 * 50 * spilled.page_rows
    _same(held, spilled)


def test_decisions_depend_only_on_the_holders_own_calls(tmp_path: Path) -> None:
    _, a = _pair(tmp_path, 200, 2, 1, name="a")
    _, b = _pair(tmp_path, 200, 2, 1, name="b")
    g = torch.Generator().manual_seed(3)
    calls = [torch.randperm(200, generator=g)[:int(torch.randint(1, 30, (1,), generator=g))]
             .sort().values for _ in range(120)]
    for holder in (a, b):
        for step, ids in enumerate(calls):
            cols, at = holder.view(ids, write=step % 4 != 0)
            cols["m"].index_fill_(0, at, float(step))
    assert np.array_equal(a.where, b.where) and np.array_equal(a.live, b.live)
    assert a.counters() == b.counters() and a.counters()["compactions"] > 0
    assert (tmp_path / "a.pages").read_bytes() == (tmp_path / "b.pages").read_bytes()


def test_partial_writes_and_reads_do_not_move_the_hot_set(tmp_path: Path) -> None:
    """A write of one column over rows that cut units (a seed of the master rows, a
    restore's piece) and a checkpoint's read leave the resident rows where they are and
    count no access; both are bitwise those of the columns in memory."""
    rows = 100
    held, spilled = _pair(tmp_path, rows, 2, unit_rows=4, page_rows=8)
    g = torch.Generator().manual_seed(5)
    for lo, hi in ((3, 61), (0, 100), (37, 38), (90, 100)):
        values = {"v": torch.randn(hi - lo, 4, generator=g)}
        ids = torch.randperm(rows, generator=g)[:9].sort().values
        for holder in (held, spilled):
            cols, at = holder.view(ids)
            cols["m"].index_add_(0, at, torch.ones(9, 4))
            holder.write(lo, values)
        _same(held, spilled)
    resident = spilled.where.copy()
    counters = spilled.counters()
    _same(held, spilled, 5, 77)
    assert np.array_equal(resident, spilled.where) and counters == spilled.counters()
    with pytest.raises(IndexError, match=r"rows \[95, 105\) outside \[0, 100\)"):
        spilled.write(95, {"v": torch.zeros(10, 4)})


def test_the_reservation_and_bookkeeping_are_what_the_holder_uses(tmp_path: Path) -> None:
    rows, page_rows = 1000, 6
    spilled = SpilledRows(tmp_path / "r.pages", LAYOUT, rows, page_rows, 3)
    assert spilled.max_disk_bytes == spilled_bytes(LAYOUT, rows, page_rows)
    assert spilled_rows_for_disk(LAYOUT, page_rows, spilled.max_disk_bytes) >= rows
    frames = spilled.nslots * spilled.unit_rows * 8 * 4
    assert spilled.memory_bytes > frames + spilled_bookkeeping_bytes(LAYOUT, rows, page_rows)


def test_rows_never_written_are_filled_without_a_read(tmp_path: Path) -> None:
    """A row never written holds its initial value (zeros): a miss on it reads nothing,
    evicting it clean writes nothing, and a checkpoint's read of it touches no page, so
    even a file damaged everywhere answers those rows; the written rows' pages are read
    and the damage found there."""
    rows, written = 200, 60
    held, spilled = _pair(tmp_path, rows, 2, unit_rows=1)
    g = torch.Generator().manual_seed(9)
    restored = {n: torch.randn(written, w, generator=g) for n, w in LAYOUT}
    for holder in (held, spilled):
        holder.write(0, restored)
    before = spilled.counters()
    read_before = spilled.file.bytes_read
    fresh = torch.arange(written, rows)
    for lo in range(0, fresh.numel(), 7):  # many more rows than the slots: misses, evictions
        ids = fresh[lo:lo + 7]
        cols, at = spilled.view(ids, write=False)
        for name, _ in LAYOUT:
            assert torch.equal(cols[name].index_select(0, at), torch.zeros(ids.numel(), 4))
    after = spilled.counters()
    assert after["misses"] - before["misses"] >= fresh.numel()
    assert after["fills"] == before["fills"] and spilled.file.bytes_read == read_before
    assert after["spills"] == before["spills"]
    # every byte of the file damaged: the never-written rows do not look at it
    size = spilled.file.pages * spilled.file.stride
    with open(spilled.file.path, "r+b") as f:
        f.write(b"\xa5" * size)
    cols, at = spilled.view(fresh[:5], write=False)
    assert torch.equal(cols["v"].index_select(0, at), torch.zeros(5, 4))
    _same(held, spilled, written, rows)
    assert spilled.counters()["fills"] == before["fills"]
    with pytest.raises(CorruptSpill, match="page"):
        spilled.view(torch.tensor([3]))
