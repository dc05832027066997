"""The page file's CRC-32C (hybridps/native/page_check.c and its numpy fallback in
hybridps/page_file.py): every implementation computes the same checksum, and a bit
flipped anywhere in a page, header or payload, fails the read naming file and page."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridps import page_file
from hybridps.errors import CorruptSpill
from hybridps.page_file import (
    HEADER_BYTES,
    MAGIC,
    PageCorrupt,
    PageFile,
    crc32c_rows,
    crc32c_rows_numpy,
)
from hybridps.spilled_rows import HeldRows, SpilledRows

ext = page_file._ext
needs_ext = pytest.mark.skipif(ext is None, reason="native extension not built")
CHECK = b"123456789"  # the CRC-32C check value of the standard (RFC 3720, B.4)
CHECK_CRC = 0xE3069283


@pytest.fixture(params=["native", "numpy"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if ext is None:
            pytest.skip("native extension not built")
    else:
        monkeypatch.setattr(page_file, "_ext", None)
    return str(request.param)


def _native(data: bytes, crc: int = 0, portable: bool = False) -> int:
    assert ext is not None
    buf = ctypes.create_string_buffer(data, len(data))
    return int(ext.crc32c(ctypes.addressof(buf), len(data), crc, portable))


def test_the_check_value_of_the_standard() -> None:
    rows = np.frombuffer(CHECK, dtype=np.uint8)[None, :]
    assert int(crc32c_rows_numpy(rows)[0]) == CHECK_CRC
    assert int(crc32c_rows_numpy(np.zeros((1, 0), np.uint8))[0]) == 0
    if ext is not None:
        assert _native(CHECK) == CHECK_CRC
        assert _native(CHECK, portable=True) == CHECK_CRC
        assert int(crc32c_rows(rows)[0]) == CHECK_CRC


@needs_ext
def test_native_and_fallback_checksums_agree_on_random_pages() -> None:
    assert ext is not None
    rng = np.random.default_rng(7)
    for length in [1, 7, 8, 9, 63, 4080, 4088, 4096, 8183]:
        rows = rng.integers(0, 256, size=(5, length), dtype=np.uint8)
        want = crc32c_rows_numpy(rows)
        assert np.array_equal(crc32c_rows(rows), want), length
        # rows a stride apart (a block's pages after their first bytes)
        wide = rng.integers(0, 256, size=(5, length + 24), dtype=np.uint8)
        wide[:, 16:16 + length] = rows
        assert np.array_equal(crc32c_rows(wide[:, 16:16 + length]), want), length
        for r in range(rows.shape[0]):
            data = rows[r].tobytes()
            assert _native(data) == int(want[r])
            assert _native(data, portable=True) == int(want[r])
            cut = length // 3  # continuing from the checksum of what precedes
            assert _native(data[cut:], _native(data[:cut])) == int(want[r])
    assert len(set(crc32c_rows_numpy(rng.integers(0, 256, (64, 4088), np.uint8)))) == 64


def _flip(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as raw:
        raw.seek(offset)
        byte = raw.read(1)[0]
        raw.seek(offset)
        raw.write(bytes([byte ^ (1 << bit)]))


def test_pages_written_by_either_implementation_read_by_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=(6, 5000), dtype=np.uint8)
    writers = [None] if ext is None else [None, ext]
    for i, writer in enumerate(writers):
        monkeypatch.setattr(page_file, "_ext", writer)
        f = PageFile(tmp_path / f"w{i}.pages", 5000, 8)
        f.write_many([5, 0, 2, 3, 7, 1], data)
        for reader in writers:
            monkeypatch.setattr(page_file, "_ext", reader)
            got = f.read_pages([7, 0, 3, 3, 1])
            assert np.array_equal(got, data[[4, 1, 3, 3, 5]])
        f.close()


def test_a_flipped_bit_anywhere_in_a_page_fails(tmp_path: Path, impl: str) -> None:
    path = tmp_path / "f.pages"
    payload = 4000  # a page of one 4 KiB block: header, payload and padding
    f = PageFile(path, payload, 4)
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, size=(4, payload), dtype=np.uint8)
    f.write_many([0, 1, 2, 3], data)
    stride = f.stride
    assert stride == 4096
    positions = [(b, bit) for b in range(HEADER_BYTES) for bit in range(8)]
    if impl == "native":  # every byte of the page
        positions += [(b, int(rng.integers(8))) for b in range(HEADER_BYTES, stride)]
    else:  # the numpy fallback is slower: payload and padding sampled
        positions += [(int(b), int(rng.integers(8))) for b in
                      rng.choice(np.arange(HEADER_BYTES, stride), 24, replace=False)]
        positions += [(stride - 1, 7), (HEADER_BYTES + payload, 0)]  # padding
    for offset, bit in positions:
        _flip(path, 2 * stride + offset, bit)
        with pytest.raises(PageCorrupt, match=r"f\.pages: page 2\b"):
            f.read_pages([1, 2, 3])
        _flip(path, 2 * stride + offset, bit)
    assert np.array_equal(f.read_pages([3, 2, 1, 0]), data[::-1])
    f.close()


def test_a_page_of_the_older_format_is_refused_by_name(tmp_path: Path, impl: str) -> None:
    path = tmp_path / "o.pages"
    f = PageFile(path, 64, 2)
    f.write_many([0, 1], np.ones((2, 64), np.uint8))
    with open(path, "r+b") as raw:
        raw.seek(f.stride)
        raw.write((0x48505047).to_bytes(4, "little"))
    with pytest.raises(PageCorrupt, match=r"o\.pages: page 1 is of page format 1 .* reads "
                                          rf"format 2 \(magic {MAGIC:#x}\): a stale file"):
        f.read_pages([0, 1])
    with open(path, "r+b") as raw:
        raw.seek(os.SEEK_SET)
        raw.write(b"\0")
    with pytest.raises(PageCorrupt, match=r"o\.pages: page 0 has a damaged header"):
        f.read_pages([0])
    f.close()


LAYOUT = [("m", 3), ("v", 3), ("master", 5)]


@pytest.mark.parametrize("unit_rows", [1, 0])  # 0: by the row's bytes
def test_fills_native_and_fallback_are_bitwise_the_held_rows(
        tmp_path: Path, impl: str, unit_rows: int) -> None:
    rows = 61
    g = torch.Generator().manual_seed(5)
    init = {n: torch.randn(rows, w, generator=g) for n, w in LAYOUT}
    held = HeldRows({n: torch.zeros(rows, w) for n, w in LAYOUT})
    spilled = SpilledRows(tmp_path / "s.pages", LAYOUT, rows, 4, 2, unit_rows=unit_rows)
    held.write(0, init)
    spilled.write(0, init)  # a restore: every row on disk
    for step in range(40):
        n = int(torch.randint(1, 25, (1,), generator=g))
        ids = torch.randperm(rows, generator=g)[:n].sort().values
        grads = torch.randn(n, 3, generator=g)
        for holder in (held, spilled):
            cols, at = holder.view(ids)
            cols["m"].index_add_(0, at, grads)
            cols["master"].index_fill_(0, at[: n // 2], float(step))
    for name, want in held.read(0, rows).items():
        assert torch.equal(spilled.read(0, rows)[name], want), name
    assert spilled.counters()["fills"] > 0
    spilled.close()


def test_a_page_holding_another_unit_fails_the_fill(tmp_path: Path, impl: str) -> None:
    spilled = SpilledRows(tmp_path / "u.pages", LAYOUT, 40, 4, 1, unit_rows=1)
    spilled.write(0, {n: torch.ones(40, w) for n, w in LAYOUT})
    spilled.view(torch.tensor([39]))  # rows 3 and 7 are on disk only
    assert spilled.where[3] >= 0 and spilled.where[7] >= 0
    spilled.where[3], spilled.where[7] = spilled.where[7], spilled.where[3]
    with pytest.raises(CorruptSpill, match=r"u\.pages: page \d+ holds unit 7 where unit 3 "
                                           "was written"):
        spilled.view(torch.tensor([3]))
    spilled.close()
