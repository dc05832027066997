"""A file of fixed-size pages, each with a crc32: the disk tier of paged state. No grpc.

Page `p` lives at byte `p * stride`: a 16-byte header (magic, page number, crc32 of the
payload, payload length) and the payload, the stride a multiple of 4 KiB. A page is
written whole; `read` checks the header and the payload's crc32 both against the page
itself and against the crc32 this process recorded when it wrote the page, so a torn
write, a bit flipped on disk, a page written by another process or a stale copy all fail
with `PageCorrupt` naming the file and the page, never as wrong values.

Batches go to disk in large sequential blocks: `write_many` sorts its pages and writes
each run of consecutive pages with one pwrite; `read_pages` gathers its pages from a
read-only mapping of the file in one copy (a fill reads scattered pages: no call a page),
after checking the file still holds them (a truncated file fails, never faults), and
drops the mapping's pages from the process's resident set again. Headers are packed and
checked for a whole batch at once (numpy), the crc32 page by page.

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
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from hybridps.errors import CorruptSpill

MAGIC = 0x48505047  # "HPPG"
HEADER = struct.Struct("<IIQ")  # magic, crc32, page number (the payload length is fixed)
HEADER_BYTES = 16
BLOCK_BYTES = 4096
# the most pages one write or read moves (a block of at most this many strides)
MAX_IOV = 512


class PageCorrupt(CorruptSpill):
    """A page read back does not match what was written (file and page named)."""


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
        crc = np.fromiter((zlib.crc32(row) for row in
                           block[:, HEADER_BYTES:HEADER_BYTES + self.payload_bytes]),
                          dtype=np.uint32, count=pages_P.size)
        header = block[:, :HEADER_BYTES]
        header[:, 0:4] = np.full(pages_P.size, MAGIC, dtype="<u4").view(np.uint8).reshape(-1, 4)
        header[:, 4:8] = crc.astype("<u4").view(np.uint8).reshape(-1, 4)
        header[:, 8:16] = sorted_P.astype("<u8").view(np.uint8).reshape(-1, 8)
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
        """The payloads of written pages as one uint8 [pages, payload_bytes] array (rows
        possibly a page's stride apart), in the order asked (gathered from the mapping in
        one copy, every page's header and crc32 checked); PageCorrupt naming file and page
        when one does not."""
        pages_P = np.asarray(pages, dtype=np.int64)
        self._check_pages(pages_P)
        if not pages_P.size:
            return np.empty((0, self.payload_bytes), dtype=np.uint8)
        unwritten = pages_P[~self._written[pages_P]]
        if unwritten.size:
            raise PageCorrupt(f"page file {self.path}: page {int(unwritten[0])} was never "
                              "written")
        # a fill asks in page order (np.unique): no reorder then, the payloads a view
        ascending = bool((pages_P[1:] > pages_P[:-1]).all())
        order = None if ascending else np.argsort(pages_P, kind="stable")
        sorted_P = pages_P if order is None else pages_P[order]
        end = HEADER_BYTES + self.payload_bytes
        size = os.fstat(self._fd).st_size  # a page the file cuts is never touched
        short = np.flatnonzero(sorted_P * self.stride + end > size)
        if short.size:
            raise PageCorrupt(f"page file {self.path}: page {int(sorted_P[short[0]])} is "
                              f"truncated (the file ends at {size})")
        assert self._view is not None and self._map is not None
        block = self._view[sorted_P]  # one gather from the page cache, no call a page
        self.bytes_read += block.nbytes
        # the mapping's pages leave this process's resident set (the page cache keeps
        # them): the span read only, so the call costs what the read touched
        lo, hi = int(sorted_P[0]) * self.stride, (int(sorted_P[-1]) + 1) * self.stride
        self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        head = np.ascontiguousarray(block[:, :HEADER_BYTES])
        magic = head[:, 0:4].copy().view("<u4").reshape(-1)
        stored = head[:, 4:8].copy().view("<u4").reshape(-1)
        number = head[:, 8:16].copy().view("<u8").reshape(-1)
        bad = np.flatnonzero((magic != MAGIC) | (number != sorted_P.astype(np.uint64)))
        if bad.size:
            i = int(bad[0])
            raise PageCorrupt(f"page file {self.path}: page {int(sorted_P[i])} has a damaged "
                              f"header (magic {int(magic[i]):#x}, page number "
                              f"{int(number[i])})")
        payload = block[:, HEADER_BYTES:end]
        actual = np.fromiter((zlib.crc32(row) for row in payload), dtype=np.uint32,
                             count=pages_P.size)
        bad = np.flatnonzero((actual != stored) | (stored != self._crc[sorted_P]))
        if bad.size:
            i = int(bad[0])
            page = int(sorted_P[i])
            raise PageCorrupt(
                f"page file {self.path}: page {page} fails its crc32 (stored "
                f"{int(stored[i]):#010x}, computed {int(actual[i]):#010x}, written "
                f"{int(self._crc[page]):#010x})")
        if order is None:
            return payload
        out = np.empty((pages_P.size, self.payload_bytes), dtype=np.uint8)
        out[order] = payload
        return out

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
