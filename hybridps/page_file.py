"""A file of fixed-size pages, each with a CRC-32C: the disk tier of paged state. No grpc.

Page `p` lives at byte `p * stride`: a 16-byte header (magic with the page format, the
CRC-32C, page number) and the payload, the stride a multiple of 4 KiB. The checksum
covers every byte of the page after itself (page number, payload and padding) and the
magic is compared whole, so a bit flipped anywhere in a page fails. A page is written
whole; `read` checks the header and the checksum both against the page itself and
against the checksum this process recorded when it wrote the page, so a torn write, a
bit flipped on disk, a page written by another process, a stale copy or a file of an
older page format all fail with `PageCorrupt` naming the file and the page, never as
wrong values.

Batches go to disk in large sequential blocks: `write_many` sorts its pages and writes
each run of consecutive pages with one pwrite; `read_pages` checks and copies its pages
out of a read-only mapping of the file in one native call (hybridps/native/page_check.c:
the SSE4.2 crc32 instruction where the CPU has it, the GIL released), after checking the
file still holds them (a truncated file fails, never faults), and drops the mapping's
pages from the process's resident set again; `check` checks without the copy, for a
caller that gathers from the mapping itself (the spilled rows' fill). Without the native
extension, numpy does the same work and computes the same checksum
(`crc32c_rows_numpy`), slower.

The file is a cache of this process (the shard server's spilled optimizer state, or a
worker's in-process paged store): it is opened new (any old content truncated) and
removed by `close`; a checkpoint never points at it.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from hybridps import native
from hybridps.errors import CorruptSpill

# the magic: "HPP" and the page format (the low byte); a page of another format fails
PAGE_FORMAT = 2  # 2: CRC-32C over bytes [8, stride)
MAGIC = 0x48505000 | PAGE_FORMAT
# the magics of the formats before, each refused by name
OLD_FORMATS = {0x48505047: "format 1 (zlib crc32 of the payload)"}
HEADER = struct.Struct("<IIQ")  # magic, CRC-32C, page number (the payload length is fixed)
HEADER_BYTES = 16
CHECKED_FROM = 8  # the checksum covers the page from the page number on
CRC32C_POLY = 0x82F63B78  # reflected Castagnoli polynomial
BLOCK_BYTES = 4096
# the most pages one write or read moves (a block of at most this many strides)
MAX_IOV = 512


class PageCorrupt(CorruptSpill):
    """A page read back does not match what was written (file and page named)."""


NATIVE_FUNCTIONS = ("crc32c", "crc32c_pages", "check_pages", "gather_units")
# the native page check and checksum (page_check.c), or None: numpy, the same results
_ext = native.ext if native.ext is not None and all(
    hasattr(native.ext, f) for f in NATIVE_FUNCTIONS) else None


def native_pages() -> ModuleType | None:
    """The extension with page_check.c's functions (NATIVE_FUNCTIONS), or None."""
    return _ext


def _crc_tables() -> np.ndarray:
    """The slice-by-8 tables, uint32 [8, 256] (page_check.c builds the same)."""
    tables = np.empty((8, 256), dtype=np.uint32)
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(CRC32C_POLY), t >> 1).astype(np.uint32)
    tables[0] = t
    for k in range(1, 8):
        tables[k] = (tables[k - 1] >> 8) ^ tables[0][tables[k - 1] & 0xFF]
    return tables


_TABLES = _crc_tables()


def crc32c_rows_numpy(rows_PL: np.ndarray) -> np.ndarray:
    """The CRC-32C of each row of uint8 `rows_PL` (uint32 [P]), in numpy: slice-by-8
    with the rows side by side, page_check.c's portable loop."""
    rows = np.asarray(rows_PL, dtype=np.uint8)
    if rows.ndim != 2:
        raise ValueError(f"crc32c rows of shape {rows.shape}: want [rows, bytes]")
    count, length = rows.shape
    t = _TABLES
    crc = np.full(count, 0xFFFFFFFF, dtype=np.uint32)
    words = length // 8
    if words and count:
        # [words, 2, rows]: each step's two 32-bit halves contiguous across the rows
        w = np.ascontiguousarray(rows[:, :words * 8]).view("<u4").astype(np.uint32)
        w = np.ascontiguousarray(w.reshape(count, words, 2).transpose(1, 2, 0))
        for j in range(words):
            lo = w[j, 0] ^ crc
            hi = w[j, 1]
            crc = (t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF]
                   ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF]
                   ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24])
    for j in range(words * 8, length):
        crc = t[0][(crc ^ rows[:, j]) & 0xFF] ^ (crc >> 8)
    return crc ^ np.uint32(0xFFFFFFFF)


def crc32c_rows(rows_PL: np.ndarray) -> np.ndarray:
    """The CRC-32C of each row of uint8 `rows_PL` (uint32 [P]): natively where the
    extension is built (rows a fixed stride apart), else crc32c_rows_numpy."""
    rows = np.asarray(rows_PL)
    if (_ext is None or rows.dtype != np.uint8 or rows.ndim != 2
            or (rows.shape[1] > 1 and rows.strides[1] != 1) or rows.strides[0] < 0):
        return crc32c_rows_numpy(rows)
    out = np.empty(rows.shape[0], dtype=np.uint32)
    if rows.shape[0]:
        _ext.crc32c_pages(rows.ctypes.data, rows.shape[0], rows.strides[0], rows.shape[1],
                          out.ctypes.data)
    return out


def page_stride(payload_bytes: int) -> int:
    """Bytes a page of `payload_bytes` takes in the file: header and payload, rounded up
    to whole 4 KiB blocks."""
    return -(-(HEADER_BYTES + payload_bytes) // BLOCK_BYTES) * BLOCK_BYTES


class PageFile:
    """Pages of `payload_bytes` bytes each in file `path` (module doc). Not thread-safe:
    its owner serialises calls (the partition lock on the server)."""

    def __init__(self, path: str | Path, payload_bytes: int, pages: int) -> None:
        if payload_bytes <= 0 or pages < 0:
            raise ValueError(f"page file {path}: payload_bytes={payload_bytes} must be > 0 "
                             f"and pages={pages} >= 0")
        self.path = Path(path)
        self.payload_bytes = payload_bytes
        self.stride = page_stride(payload_bytes)
        self.pages = pages
        self._crc = np.zeros(pages, dtype=np.uint32)
        self._written = np.zeros(pages, dtype=bool)
        self.bytes_written = 0
        self.bytes_read = 0
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(self.path, flags, 0o600)
        # the whole extent at once (sparse: only written pages take disk), mapped for reads
        self._map: mmap.mmap | None = None
        self._view: np.ndarray | None = None
        if pages:
            os.ftruncate(self._fd, pages * self.stride)
            self._map = mmap.mmap(self._fd, pages * self.stride, prot=mmap.PROT_READ)
            self._view = np.frombuffer(self._map, dtype=np.uint8).reshape(pages, self.stride)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the pages written so far (the file is sparse elsewhere)."""
        return int(self._written.sum()) * self.stride

    def written(self, page: int) -> bool:
        return bool(self._written[page])

    def written_mask(self, pages: np.ndarray) -> np.ndarray:
        """Which of `pages` were written (bool, one each)."""
        return self._written[pages]

    def _check_pages(self, pages: np.ndarray) -> None:
        if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= self.pages):
            raise IndexError(f"page file {self.path}: pages {pages.tolist()[:8]} outside "
                             f"[0, {self.pages})")

    def write_many(self, pages: Sequence[int] | np.ndarray,
                   payloads: Sequence[np.ndarray] | np.ndarray) -> None:
        """Write each page's payload (uint8-viewable, `payload_bytes` each; or one
        [pages, payload_bytes] array), in page order: one block and one write per run of
        consecutive pages."""
        pages_P = np.asarray(pages, dtype=np.int64)
        self._check_pages(pages_P)
        if isinstance(payloads, np.ndarray) and payloads.ndim == 2:
            data = payloads.view(np.uint8) if payloads.dtype != np.uint8 else payloads
        else:
            if pages_P.size != len(payloads):
                raise ValueError(f"page file {self.path}: {len(payloads)} payloads for "
                                 f"{pages_P.size} pages")
            rows = [np.ascontiguousarray(p).view(np.uint8).reshape(-1) for p in payloads]
            for page, row in zip(pages_P.tolist(), rows, strict=True):
                if row.size != self.payload_bytes:
                    raise ValueError(f"page file {self.path}: page {page} payload of "
                                     f"{row.size} bytes, not {self.payload_bytes}")
            data = np.stack(rows) if rows else np.empty((0, self.payload_bytes), np.uint8)
        if data.shape != (pages_P.size, self.payload_bytes):
            raise ValueError(f"page file {self.path}: payloads of shape {data.shape} for "
                             f"{pages_P.size} pages of {self.payload_bytes} bytes")
        if len(np.unique(pages_P)) != pages_P.size:
            raise ValueError(f"page file {self.path}: a page written twice in one batch")
        order = np.argsort(pages_P, kind="stable")
        sorted_P = pages_P[order]
        block = np.zeros((pages_P.size, self.stride), dtype=np.uint8)
        block[:, HEADER_BYTES:HEADER_BYTES + self.payload_bytes] = data[order]
        header = block[:, :HEADER_BYTES]
        header[:, 8:16] = sorted_P.astype("<u8").view(np.uint8).reshape(-1, 8)
        crc = crc32c_rows(block[:, CHECKED_FROM:])  # page number, payload, padding
        header[:, 0:4] = np.full(pages_P.size, MAGIC, dtype="<u4").view(np.uint8).reshape(-1, 4)
        header[:, 4:8] = crc.astype("<u4").view(np.uint8).reshape(-1, 4)
        for a, b in _runs(sorted_P):
            self._pwrite(block[a:b].reshape(-1), int(sorted_P[a]) * self.stride)
        self._crc[sorted_P] = crc
        self._written[sorted_P] = True

    def _pwrite(self, block: np.ndarray, offset: int) -> None:
        view = block.data
        done = 0
        while done < view.nbytes:  # a short write: the rest
            done += os.pwrite(self._fd, view[done:], offset + done)
        self.bytes_written += view.nbytes

    def read_many(self, pages: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """The payloads (uint8 [payload_bytes] each) of written pages, in the order
        asked; PageCorrupt naming file and page when one does not check."""
        return list(self.read_pages(pages))

    def read_pages(self, pages: Sequence[int] | np.ndarray) -> np.ndarray:
        """The payloads of written pages as one uint8 [pages, payload_bytes] array, in
        the order asked (every page's header and checksum checked, and the payloads
        copied out of the mapping, in one native call); PageCorrupt naming file and page
        when one does not check."""
        pages_P = np.ascontiguousarray(pages, dtype=np.int64)
        out = np.empty((pages_P.size, self.payload_bytes), dtype=np.uint8)
        self._read(pages_P, out)
        return out

    def check(self, pages: Sequence[int] | np.ndarray) -> None:
        """Check written pages as read_pages does, copying nothing: the caller then reads
        them from `mapping()` (until the next write or close)."""
        self._read(np.ascontiguousarray(pages, dtype=np.int64), None)

    def mapping(self) -> np.ndarray:
        """The read-only mapping of the file, uint8 [pages, stride]. A caller reading it
        natively holds this array meanwhile: while it is held, a close cannot unmap it
        (mmap refuses to close with its buffer exported)."""
        if self._view is None:
            raise ValueError(f"page file {self.path}: no pages mapped (closed, or none)")
        return self._view

    def _read(self, pages_P: np.ndarray, out: np.ndarray | None) -> None:
        """Check `pages_P` (int64, contiguous), their payloads into `out` unless None."""
        self._check_pages(pages_P)
        if not pages_P.size:
            return
        unwritten = pages_P[~self._written[pages_P]]
        if unwritten.size:
            raise PageCorrupt(f"page file {self.path}: page {int(unwritten[0])} was never "
                              "written")
        size = os.fstat(self._fd).st_size  # a page the file cuts is never touched
        short = np.flatnonzero((pages_P + 1) * self.stride > size)
        if short.size:
            raise PageCorrupt(f"page file {self.path}: page {int(pages_P[short[0]])} is "
                              f"truncated (the file ends at {size})")
        assert self._view is not None and self._map is not None
        if _ext is not None:
            view = self._view  # held through the call: a close cannot unmap it meanwhile
            status = np.empty(pages_P.size, dtype=np.uint8)
            failed = _ext.check_pages(view.ctypes.data, self.pages, self.stride,
                                      self.payload_bytes, MAGIC, pages_P.ctypes.data,
                                      pages_P.size, self._crc.ctypes.data, status.ctypes.data,
                                      0 if out is None else out.ctypes.data, self.payload_bytes)
        else:
            status = self._check_numpy(pages_P, out)
            failed = int(np.count_nonzero(status))
        self.bytes_read += pages_P.size * self.stride
        if out is not None:
            self.drop_resident(pages_P)
        if failed:
            i = int(np.flatnonzero(status)[0])
            raise self._corrupt(int(pages_P[i]), int(status[i]))

    def drop_resident(self, pages_P: np.ndarray) -> None:
        """The mapping's pages leave this process's resident set (the page cache keeps
        them): the span of `pages_P` only, so the call costs what the read touched."""
        if not pages_P.size or self._map is None:
            return
        lo, hi = int(pages_P.min()) * self.stride, (int(pages_P.max()) + 1) * self.stride
        self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _check_numpy(self, pages_P: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """check_pages of page_check.c in numpy: the payloads into `out` (unless None), a
        status each (0 checks, 1 magic, 2 page number, 3 checksum, 4 not the checksum
        written)."""
        assert self._view is not None
        block = self._view[pages_P]
        if out is not None:
            out[:] = block[:, HEADER_BYTES:HEADER_BYTES + self.payload_bytes]
        head = np.ascontiguousarray(block[:, :HEADER_BYTES])
        magic = head[:, 0:4].copy().view("<u4").reshape(-1)
        stored = head[:, 4:8].copy().view("<u4").reshape(-1)
        number = head[:, 8:16].copy().view("<u8").reshape(-1)
        actual = crc32c_rows_numpy(block[:, CHECKED_FROM:])
        return np.select([magic != MAGIC, number != pages_P.astype(np.uint64),
                          actual != stored, stored != self._crc[pages_P]],
                         [1, 2, 3, 4], 0).astype(np.uint8)

    def _corrupt(self, page: int, status: int) -> PageCorrupt:
        """The error for `page`, which failed with check status `status`."""
        assert self._view is not None
        raw = self._view[page]
        magic, stored, number = HEADER.unpack(raw[:HEADER_BYTES].tobytes())
        where = f"page file {self.path}: page {page}"
        if status == 1 and magic in OLD_FORMATS:
            return PageCorrupt(f"{where} is of page {OLD_FORMATS[magic]} (magic "
                               f"{magic:#x}); this build reads format {PAGE_FORMAT} "
                               f"(magic {MAGIC:#x}): a stale file")
        if status in (1, 2):
            return PageCorrupt(f"{where} has a damaged header (magic {magic:#x}, page "
                               f"number {number})")
        actual = int(crc32c_rows(raw[None, CHECKED_FROM:])[0])
        return PageCorrupt(f"{where} fails its crc32c (stored {stored:#010x}, computed "
                           f"{actual:#010x}, written {int(self._crc[page]):#010x})")

    def close(self, remove: bool = True) -> None:
        """Close the file and (by default) remove it: it is a cache of this process."""
        if self._map is not None:
            self._view = None
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __del__(self) -> None:  # a dropped owner leaves no descriptor and no file
        with contextlib.suppress(AttributeError, OSError):
            self.close(remove=True)


def _runs(sorted_P: np.ndarray) -> Iterator[tuple[int, int]]:
    """[a, b) of each run of consecutive pages in sorted `sorted_P`, at most MAX_IOV pages
    a run."""
    if not sorted_P.size:
        return
    cuts = np.flatnonzero(np.diff(sorted_P) != 1) + 1
    bounds = np.concatenate([[0], cuts, [sorted_P.size]]).tolist()
    for a, b in itertools.pairwise(bounds):
        for k in range(a, b, MAX_IOV):
            yield k, min(k + MAX_IOV, b)
