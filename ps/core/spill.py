"""The shard server's disk tier: where partitions spill optimizer state (no grpc).

With `--spill-dir DIR`, a partition whose fixed optimizer state (its tables' state and
master rows) exceeds its share of the memory budget (ps/core/limits.py's `run_share`
over the run's world size) keeps that share in memory as a hot set of rows and the rest
in one page file per table (hybridps/spilled_rows.py: a clock over row accesses, the
rows that leave appended to a log of crc-checked pages, twice the state's pages
reserved). The decision is taken at Register from the partition's own sizes and the
flags alone, and which pages spill depends only on the partition's own pushes: a run is
bitwise the same run with every byte in memory.

Disk: every spilled table reserves, at Register, the most its file may hold; a Register
whose files would exceed `--spill-max-gb` (0: no limit of its own) is refused with one
line naming the sizes, nothing allocated. With `--spill-max-gb`, a dynamic table's
paged-out rows spill too (`paged_payload`): their quota grows by the rows its part of the
disk holds (the partition's equal part of --spill-max-gb less its static spill files), so
the drops, decided as before against that quota, come only beyond memory and disk.

Spill files are a cache of this process, never a recovery source: a checkpoint reads
spilled pages back (ps/core/checkpoint.py), the files of a freed or replaced partition
are removed with it, and each server process spills into a directory of its own under
DIR that it holds a lock on (`flock`); a new server removes every directory under DIR
whose lock no live process holds (left by a process killed with kill -9). The directory
is the operator's flag, never a client's: a run only names tables and sizes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

from hybridps import logs
from hybridps.errors import ResourceExhausted
from hybridps.locked_dirs import LockedDir, remove_stale
from hybridps.paged_spill import paged_quota
from hybridps.spilled_rows import (
    DEFAULT_PAGE_BYTES,
    RowColumns,
    SpilledRows,
    frame_bytes,
    page_rows_for,
    spilled_bookkeeping_bytes,
    spilled_bytes,
)
from ps.core.limits import gib
from ps.core.partition import ColumnsFactory, TableSpec

log = logging.getLogger("ps.spill")
kv = logs.kv

PROCESS_PREFIX = "ps-"
# the row columns of a table: (name, floats per row) each
Layout = list[tuple[str, int]]


class SpillTier:
    """The disk tier of one server process (module doc); `directory` '' is off."""

    def __init__(self, directory: str | Path = "", max_bytes: int = 0,
                 page_bytes: int = DEFAULT_PAGE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"spill max bytes {max_bytes} must be >= 0 (0: no limit)")
        if page_bytes < 1:
            raise ValueError(f"spill page bytes {page_bytes} must be >= 1")
        self.max_bytes = max_bytes
        self.page_bytes = page_bytes
        self._lock = threading.Lock()
        self._reserved = 0
        self._names = itertools.count()
        self.root = Path(directory) if directory else None
        self.directory: Path | None = None
        self._own: LockedDir | None = None
        self.removed_stale = 0
        if self.root is not None:
            self._open()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def _open(self) -> None:
        assert self.root is not None
        self.root.mkdir(parents=True, exist_ok=True)
        self.removed_stale = remove_stale(self.root, PROCESS_PREFIX)
        self._own = LockedDir(self.root, PROCESS_PREFIX)
        self.directory = self._own.path
        log.info(kv("spill_dir", directory=self.directory, stale_removed=self.removed_stale,
                    max_bytes=self.max_bytes))

    def close(self) -> None:
        """Remove this process's directory (its files: a cache of this process)."""
        if self._own is not None:
            self._own.close()
            self._own, self.directory = None, None

    # -- what a partition spills ------------------------------------------------------

    def plan(self, tables: list[tuple[int, Layout]], memory_bytes: int,
             what: str) -> list[int]:
        """The frames (pages in memory) each table gets when the partition's row columns
        (`tables`: rows and layout each) exceed `memory_bytes`: 0 for every table when they
        fit, the tier is off, or there is no budget (the table holds its rows in memory);
        else the memory in proportion to each table's bytes, at least one page each."""
        total = sum(rows * sum(w for _, w in layout) * 4 for rows, layout in tables)
        if not self.enabled or total <= memory_bytes:
            return [0] * len(tables)
        frames = []
        for rows, layout in tables:
            size = rows * sum(w for _, w in layout) * 4
            page = frame_bytes(layout, self.page_rows(layout)) or 1
            frames.append(max(1, memory_bytes * size // max(total, 1) // page))
        return frames

    def page_rows(self, layout: Layout) -> int:
        return page_rows_for(sum(w for _, w in layout) * 4, self.page_bytes)

    def disk_bytes(self, rows: int, layout: Layout) -> int:
        return spilled_bytes(layout, rows, self.page_rows(layout))

    def bookkeeping_bytes(self, rows: int, layout: Layout) -> int:
        """Memory a spilled table keeps besides its slots (hybridps/spilled_rows.py's
        memory_bytes: each unit's place, the log's per-page figures)."""
        return spilled_bookkeeping_bytes(layout, rows, self.page_rows(layout))

    def held_bytes(self, rows: int, layout: Layout, frames: int) -> int:
        """Memory a spilled table of `frames` pages' worth of slots holds."""
        return (frames * frame_bytes(layout, self.page_rows(layout))
                + self.bookkeeping_bytes(rows, layout))

    def reserve(self, nbytes: int, what: str) -> None:
        """Reserve `nbytes` of disk for a partition's spill files; ResourceExhausted
        naming the sizes when over --spill-max-gb."""
        with self._lock:
            if self.max_bytes and self._reserved + nbytes > self.max_bytes:
                raise ResourceExhausted(
                    f"{what}: its spill files need up to {gib(nbytes)}; {gib(self._reserved)}"
                    f" are reserved of the spill limit of {gib(self.max_bytes)} "
                    "(--spill-max-gb); nothing was allocated")
            self._reserved += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def paged_quota(self, dim: int, layout: Layout, memory_bytes: int, disk_bytes: int,
                    call_rows: int, row_bytes: int) -> tuple[int, int]:
        """(the quota a dynamic table's paged rows are dropped against, the frames of its
        spilled payload; 0: it does not spill) when `memory_bytes` of memory and
        `disk_bytes` of spill file hold them (hybridps/paged_spill.py's rule, the same
        for the worker's --local-optimizer)."""
        return paged_quota(dim, layout, memory_bytes, disk_bytes, call_rows, row_bytes,
                           self.page_bytes)

    def paged_payload(self, dim: int, layout: Layout, positions: int,
                      frames: int) -> SpilledRows:
        """The rows and state of a dynamic table's paged-out entries by pool position
        (hybridps/paged_rows.py's `spill_payload`), `frames` pages of them in memory."""
        assert self.directory is not None
        columns = [("rows", dim), *layout]
        path = self.directory / f"t{next(self._names)}.pages"
        return SpilledRows(path, columns, positions, self.page_rows(columns), frames)

    def factory(self, frames: dict[str, int]) -> ColumnsFactory:
        """A partition's columns factory (ps/core/partition.py): a spilled holder for the
        tables named in `frames` (name -> frames > 0), None (in memory) for the others."""
        def make(spec: TableSpec, layout: Layout) -> RowColumns | None:
            count = frames.get(spec.name, 0)
            if count <= 0 or self.directory is None:
                return None
            path = self.directory / f"t{next(self._names)}.pages"
            return SpilledRows(path, layout, spec.rows_held, self.page_rows(layout), count)
        return make
