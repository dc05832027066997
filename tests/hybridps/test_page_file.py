"""The spill tier's page file and paged columns (hybridps/page_file.py,
hybridps/spilled_rows.py): pages round-trip bitwise, damage of any kind fails naming the
file and the page, and columns through a small hot set (a row or a unit of rows at a
time) are bitwise the same columns held in memory under random updates."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridps.page_file import HEADER_BYTES, PageCorrupt, PageFile
from hybridps.spilled_rows import HeldRows, SpilledRows

LAYOUT = [("m", 3), ("v", 1), ("master", 2)]


def _payloads(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def test_pages_read_back_bitwise_in_any_order(tmp_path: Path) -> None:
    f = PageFile(tmp_path / "a.pages", 100, 10)
    data = _payloads(10, 100, 0)
    f.write_many([3, 1, 2, 9, 0], [data[3], data[1], data[2], data[9], data[0]])
    got = f.read_many([9, 0, 1, 2, 3])
    for page, payload in zip([9, 0, 1, 2, 3], got, strict=True):
        assert np.array_equal(payload, data[page])
    assert f.disk_bytes == 5 * f.stride and f.stride % 4096 == 0
    f.write_many([1], [data[7]])  # a page written again holds its new content
    assert np.array_equal(f.read_many([1])[0], data[7])
    f.close()
    assert not (tmp_path / "a.pages").exists()  # a cache: removed with its owner


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "stale", "never"])
def test_a_damaged_page_fails_naming_file_and_page(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "b.pages"
    f = PageFile(path, 64, 4)
    data = _payloads(4, 64, 1)
    f.write_many([0, 1, 2], data[:3])
    stride = f.stride
    if damage == "payload":  # one bit flipped on disk
        with open(path, "r+b") as raw:
            raw.seek(2 * stride + HEADER_BYTES + 5)
            byte = raw.read(1)[0]
            raw.seek(-1, os.SEEK_CUR)
            raw.write(bytes([byte ^ 1]))
    elif damage == "header":
        with open(path, "r+b") as raw:
            raw.seek(2 * stride)
            raw.write(b"\0\0\0\0")
    elif damage == "truncated":
        os.truncate(path, 2 * stride + HEADER_BYTES + 10)
    elif damage == "stale":  # a consistent page, but not the content this process wrote
        other = PageFile(tmp_path / "c.pages", 64, 4)
        other.write_many([2], [data[0]])
        with open(tmp_path / "c.pages", "rb") as raw:
            raw.seek(2 * stride)
            page2 = raw.read(stride)
        with open(path, "r+b") as raw:
            raw.seek(2 * stride)
            raw.write(page2)
    page = 3 if damage == "never" else 2
    with pytest.raises(PageCorrupt, match=rf"b\.pages: page {page}\b"):
        f.read_many([0, page])
    assert np.array_equal(f.read_many([0])[0], data[0])  # the other pages still read


def _model(rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(rows, w, generator=g) for n, w in LAYOUT}


@pytest.mark.parametrize("unit_rows", [1, 0])  # 0: by the row's bytes (8 rows here)
@pytest.mark.parametrize("frames", [1, 2, 5])
def test_spilled_columns_are_bitwise_the_held_ones(tmp_path: Path, frames: int,
                                                   unit_rows: int) -> None:
    rows, page_rows = 53, 4
    held = HeldRows({n: torch.zeros(rows, w) for n, w in LAYOUT})
    spilled = SpilledRows(tmp_path / "s.pages", LAYOUT, rows, page_rows, frames,
                          unit_rows=unit_rows)
    init = _model(rows, 0)
    held.write(0, init)
    spilled.write(0, init)
    g = torch.Generator().manual_seed(1)
    for step in range(60):
        n = int(torch.randint(1, 30, (1,), generator=g))
        ids = torch.randperm(rows, generator=g)[:n].sort().values
        grads = torch.randn(n, 3, generator=g)
        for holder in (held, spilled):
            cols, at = holder.view(ids)
            cols["m"].index_add_(0, at, grads)
            cols["v"].index_copy_(0, at, cols["v"].index_select(0, at) * 0.5 + step)
            cols["master"].index_fill_(0, at[: n // 2], float(step))
        if step % 7 == 0:  # a checkpoint's read: every row, without paging in
            got, want = spilled.read(3, rows - 2), held.read(3, rows - 2)
            for name in want:
                assert torch.equal(got[name], want[name]), (step, name)
        # at most one call's units beyond the quota
        assert spilled.nslots <= max(spilled.slots_quota, n)
    got, want = spilled.read(0, rows), held.read(0, rows)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    counters = spilled.counters()
    assert counters["spills"] > 0 and counters["fills"] > 0  # the disk tier was used
    spilled.view(torch.tensor([0]))
    assert spilled.nslots == spilled.slots_quota  # back to its quota
    assert spilled.counters()["frames"] == spilled.slots_quota * spilled.unit_rows // \
        spilled.page_rows
    spilled.close()
    assert not (tmp_path / "s.pages").exists()


def test_untouched_pages_are_zeros_and_never_written(tmp_path: Path) -> None:
    spilled = SpilledRows(tmp_path / "z.pages", LAYOUT, 40, 4, 2)
    got = spilled.read(0, 40)
    assert all(bool((t == 0).all()) for t in got.values())
    cols, at = spilled.view(torch.tensor([0, 39]), write=False)
    assert all(bool((t.index_select(0, at) == 0).all()) for t in cols.values())
    assert spilled.disk_bytes == 0


def test_a_call_needing_more_rows_than_slots_applies_whole(tmp_path: Path) -> None:
    spilled = SpilledRows(tmp_path / "w.pages", LAYOUT, 40, 4, 2, unit_rows=1)
    assert spilled.slots_quota == 8
    ids = torch.arange(0, 40, 3)  # 14 rows at once
    cols, at = spilled.view(ids)
    cols["m"].index_fill_(0, at, 2.0)
    assert spilled.nslots >= 14
    cols, at = spilled.view(torch.tensor([1]))  # back to its quota
    assert spilled.nslots == 8
    m = spilled.read(0, 40)["m"]
    assert torch.equal(m[ids], torch.full((ids.numel(), 3), 2.0))
    assert int((m != 0).any(dim=1).sum()) == ids.numel()


def test_damage_on_disk_fails_a_push_loudly(tmp_path: Path) -> None:
    spilled = SpilledRows(tmp_path / "d.pages", LAYOUT, 40, 4, 1)
    cols, at = spilled.view(torch.tensor([0]))
    cols["m"].index_fill_(0, at, 1.0)
    spilled.view(torch.tensor([39]))  # page 0 goes to disk
    with open(tmp_path / "d.pages", "r+b") as raw:
        raw.seek(HEADER_BYTES)
        raw.write(b"\x55")
    with pytest.raises(PageCorrupt, match=r"d\.pages: page 0 fails its crc32"):
        spilled.view(torch.tensor([1]))


def test_closed_columns_refuse_instead_of_reading_a_removed_file(tmp_path: Path) -> None:
    from hybridps.errors import NotRegistered

    spilled = SpilledRows(tmp_path / "c.pages", LAYOUT, 40, 4, 1)
    spilled.view(torch.tensor([0]))
    spilled.close()
    with pytest.raises(NotRegistered, match="freed with their partition"):
        spilled.view(torch.tensor([39]))
