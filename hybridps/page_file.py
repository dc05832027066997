"""A file of fixed-size pages, each with a crc32: the disk tier of paged state. No grpc.

Page `p` lives at byte `p * stride`: a 16-byte header (magic, page number, crc32 of the
payload, payload length) and the payload, the stride a multiple of 4 KiB. A page is
written whole; `read` checks the header and the payload's crc32 both against the page
itself and against the crc32 this process recorded when it wrote the page, so a torn
write, a bit flipped on disk, a page written by another process or a stale copy all fail
with `PageCorrupt` naming the file and the page, never as wrong values.

Batches go to disk in large sequential blocks: `write_many` and `read_many` sort their
pages and move each run of consecutive pages with one pwrite / preadv.

The file is a cache of this process (the shard server's spilled optimizer state, or a
worker's in-process paged store): it is opened new (any old content truncated) and
removed by `close`; a checkpoint never points at it.
"""

from __future__ import annotations

import contextlib
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
                   payloads: Sequence[np.ndarray]) -> None:
        """Write each page's payload (uint8-viewable, `payload_bytes` each), in page order:
        one block and one write per run of consecutive pages."""
        pages_P = np.asarray(pages, dtype=np.int64)
        self._check_pages(pages_P)
        if pages_P.size != len(payloads):
            raise ValueError(f"page file {self.path}: {len(payloads)} payloads for "
                             f"{pages_P.size} pages")
        order = np.argsort(pages_P, kind="stable")
        for k, first, run in _runs(pages_P, order):
            block = np.zeros(run * self.stride, dtype=np.uint8)
            for j in range(run):
                page = first + j
                payload = np.ascontiguousarray(payloads[int(order[k + j])]).view(
                    np.uint8).reshape(-1)
                if payload.size != self.payload_bytes:
                    raise ValueError(f"page file {self.path}: page {page} payload of "
                                     f"{payload.size} bytes, not {self.payload_bytes}")
                at = j * self.stride
                crc = zlib.crc32(payload.data)
                HEADER.pack_into(block.data, at, MAGIC, crc, page)
                block[at + HEADER_BYTES:at + HEADER_BYTES + self.payload_bytes] = payload
                self._crc[page] = crc
            self._pwrite(block, first * self.stride)
            self._written[first:first + run] = True

    def _pwrite(self, block: np.ndarray, offset: int) -> None:
        view = block.data
        done = 0
        while done < view.nbytes:  # a short write: the rest
            done += os.pwrite(self._fd, view[done:], offset + done)
        self.bytes_written += view.nbytes

    def read_many(self, pages: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """The payloads (uint8 [payload_bytes] each) of written pages, in the order
        asked; PageCorrupt naming file and page when one does not check."""
        pages_P = np.asarray(pages, dtype=np.int64)
        self._check_pages(pages_P)
        order = np.argsort(pages_P, kind="stable")
        out: list[np.ndarray | None] = [None] * pages_P.size
        for k, first, run in _runs(pages_P, order):
            for j in range(run):
                if not self._written[first + j]:
                    raise PageCorrupt(f"page file {self.path}: page {first + j} was never "
                                      "written")
            buf = np.empty(run * self.stride, dtype=np.uint8)
            got = os.preadv(self._fd, [buf.data], first * self.stride)
            self.bytes_read += got
            for j in range(run):
                page = first + j
                if got < j * self.stride + HEADER_BYTES + self.payload_bytes:
                    raise PageCorrupt(f"page file {self.path}: page {page} is truncated "
                                      f"(the file ends at {first * self.stride + got})")
                block = buf[j * self.stride:(j + 1) * self.stride]
                magic, crc, number = HEADER.unpack_from(block.data, 0)
                payload = block[HEADER_BYTES:HEADER_BYTES + self.payload_bytes]
                if magic != MAGIC or number != page:
                    raise PageCorrupt(f"page file {self.path}: page {page} has a damaged "
                                      f"header (magic {magic:#x}, page number {number})")
                actual = zlib.crc32(payload.data)
                if actual != crc or crc != int(self._crc[page]):
                    raise PageCorrupt(
                        f"page file {self.path}: page {page} fails its crc32 (stored "
                        f"{crc:#010x}, computed {actual:#010x}, written "
                        f"{int(self._crc[page]):#010x})")
                out[int(order[k + j])] = payload
        return [p for p in out if p is not None]

    def close(self, remove: bool = True) -> None:
        """Close the file and (by default) remove it: it is a cache of this process."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if remove:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def __del__(self) -> None:  # a dropped owner leaves no descriptor and no file
        with contextlib.suppress(AttributeError, OSError):
            self.close(remove=True)


def _runs(pages_P: np.ndarray, order: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(k, first page, length) of each run of consecutive pages in `pages_P` taken in
    `order` (k: the run's first position in `order`), at most MAX_IOV pages a run."""
    k = 0
    while k < order.size:
        run = 1
        while (k + run < order.size and run < MAX_IOV
               and pages_P[order[k + run]] == pages_P[order[k]] + run):
            run += 1
        yield k, int(pages_P[order[k]]), run
        k += run
