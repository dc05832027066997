"""Columns that grow in place: a paged store's pools (hybridps/paged_rows.py). No grpc.

A pool that doubles by allocating anew copies every entry it holds: at millions of paged
rows that is a stall of a second or more inside one training step. A column of
`RESERVE_MIN_BYTES` or more therefore lives in an anonymous mapping reserved well beyond
its size (`RESERVE_FACTOR` times, at most the machine's memory). The kernel backs a
mapping with pages only where it is written, so the reservation costs address space, not
memory, and growing within it is a longer view of the same memory: nothing is copied
until a column outgrows its reservation. On Linux the mapping is MAP_NORESERVE, so the
default overcommit policy does not count it. Under strict overcommit
(vm.overcommit_memory = 2) every mapped byte is charged against the commit limit, so
there, and wherever a reservation is refused, a column takes exactly what it needs and
copies when it grows, as a plain array does.
"""

from __future__ import annotations

import mmap
import os
import sys

import numpy as np

RESERVE_MIN_BYTES = 1 << 20
RESERVE_FACTOR = 64
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):  # no sysconf: assume no cap of our own
        return 1 << 62


def _strict_overcommit() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "2"
    except OSError:  # not Linux, or no procfs
        return False


_STRICT = _strict_overcommit()


def _mapped(nbytes: int) -> mmap.mmap | None:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    try:
        return mmap.mmap(-1, nbytes, flags=flags)
    except (OSError, OverflowError, ValueError):
        return None


class GrowableColumn:
    """One column of `dtype`, [n] (width None) or [n, width], resized by `resize(n)`: the
    first rows keep their values, rows past the old size are unwritten (module doc)."""

    def __init__(self, dtype: np.dtype | type, width: int | None = None) -> None:
        self.dtype = np.dtype(dtype)
        self.width = width
        self.row_bytes = self.dtype.itemsize * (1 if width is None else width)
        self._base = self._plain(0)
        self.size = 0
        self.reserved_rows = 0  # rows the current base holds without a copy
        self.copies = 0         # times the column moved to a larger base

    def _shape(self, rows: int) -> tuple[int, ...]:
        return (rows,) if self.width is None else (rows, self.width)

    def _plain(self, rows: int) -> np.ndarray:
        return np.empty(self._shape(rows), dtype=self.dtype)

    def _reserve(self, rows: int) -> np.ndarray:
        need = rows * self.row_bytes
        mapping = None if need < RESERVE_MIN_BYTES or _STRICT else _mapped(
            min(need * RESERVE_FACTOR, max(need, _memory_bytes())))
        if mapping is None:  # exactly what is needed, as a plain array
            return self._plain(rows)
        fit = len(mapping) // self.row_bytes  # the memory cap need not be a row multiple
        flat = np.frombuffer(mapping, dtype=self.dtype,
                             count=fit * self.row_bytes // self.dtype.itemsize)
        return flat.reshape(self._shape(fit))

    def resize(self, rows: int) -> np.ndarray:
        """The column's first `rows` rows, a view: views taken before alias the column
        until a call moves it to a larger base (when `reserved_rows < rows`)."""
        if rows < 0:
            raise ValueError(f"column rows {rows} must be >= 0")
        if rows > self.reserved_rows:
            keep = self._base[:min(self.size, rows)]
            base = self._reserve(rows)
            base[:keep.shape[0]] = keep
            self.copies += keep.shape[0] > 0
            self._base, self.reserved_rows = base, int(base.shape[0])
        self.size = rows
        return self._base[:rows]

    def shrink(self, rows: int) -> np.ndarray:
        """Keep the first `rows` rows in a base of their size and release the rest (the
        old base's memory goes back when no view of it is left); a view, as `resize`."""
        if not 0 <= rows <= self.size:
            raise ValueError(f"column rows {rows} must be in [0, {self.size}]")
        base = self._reserve(rows)
        base[:rows] = self._base[:rows]
        self.copies += 1
        self._base, self.reserved_rows, self.size = base, int(base.shape[0]), rows
        return self._base[:rows]
