"""--local-memory-budget-mb: a rank's in-process optimizer state bounded in host memory.

The local optimizer (worker/updates/source.py) holds, per unit (worker/embedding/groups.py),
row columns: the optimizer's state by name and, for bf16 rows, the fp32 master rows
(`MASTER`). Without a budget they are tensors on the rows' device (`HeldRows`). With
`--local-memory-budget-mb B` and `--local-spill-dir DIR`, when a rank's columns exceed B
they are held the way the shard server's disk tier holds a partition's
(ps/core/spill.py): each unit's columns in fixed-size pages (hybridps/spilled_rows.py's
`SpilledRows`), B split over the units in proportion to their bytes as page frames (at
least one page each), the other pages in one crc-checked page file per unit, read back
when a push touches them. The split is taken once, at construction, from the rank's own
sizes and the flags; which pages spill depends only on the rank's own pushes. The kernels
update the frames bitwise as they update the full tensors, so a run under any budget is
the unbounded run.

What stays in memory besides the frames: the bookkeeping (the split counts
PAGE_BOOKKEEPING_BYTES a page, less than the row-granular hot set's slot map and log
figures, hybridps/spilled_rows.py `spilled_bookkeeping_bytes`), a changed flag per row
(incremental checkpoints), and a dynamic table's paged-out rows (hybridps/paged_rows.py:
they are not bounded here). A checkpoint reads spilled pages
back (the spill file is a cache, never the recovery source).

Spill files are this rank's: each rank spills into a directory of its own under DIR that
it holds a lock on (`flock`), removed at `close`; a new rank removes every directory
under DIR whose lock no live process holds (left by a process killed with kill -9). A
bad flag (a directory that cannot be written, a budget below the state with no
directory, a disk limit the files could pass) is a `ConfigError` (worker/main.py: one line,
exit 2) naming the sizes, raised before training starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridps.cli import ConfigError
from hybridps.locked_dirs import LockedDir, remove_stale
from hybridps.spilled_rows import (
    DEFAULT_PAGE_BYTES,
    RowColumns,
    SpilledRows,
    frame_bytes,
    page_rows_for,
    spilled_bytes,
)

MASTER = "master"  # the fp32 master rows' column, next to the optimizer's
PROCESS_PREFIX = "rank"
# memory a spilled unit keeps per page besides its frames (SpilledRows.memory_bytes: the
# page's frame, crc32 and written flag)
PAGE_BOOKKEEPING_BYTES = 8 + 4 + 1
Layout = Sequence[tuple[str, int]]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class LocalBudget:
    """The flags: `memory_bytes` (0: no bound), `spill_dir` ('' : none), `max_disk_bytes`
    (0: no limit), `page_bytes` (a page's payload)."""

    memory_bytes: int = 0
    spill_dir: str = ""
    max_disk_bytes: int = 0
    page_bytes: int = DEFAULT_PAGE_BYTES

    @classmethod
    def from_flags(cls, budget_mb: int, spill_dir: str, max_gb: float,
                   page_kb: int) -> LocalBudget:
        return cls(budget_mb << 20, spill_dir, int(max_gb * 2**30), page_kb << 10)

    def __post_init__(self) -> None:
        if self.memory_bytes < 0:
            raise ConfigError(f"--local-memory-budget-mb {self.memory_bytes >> 20} must "
                              "be >= 0 (0: no bound)")
        if self.max_disk_bytes < 0:
            raise ConfigError(f"--local-spill-max-gb {self.max_disk_bytes / 2**30:g} must "
                              "be >= 0 (0: no limit)")
        if self.page_bytes < 1:
            raise ConfigError(f"--local-spill-page-kb {self.page_bytes >> 10} must be >= 1")

    def page_rows(self, layout: Layout) -> int:
        return page_rows_for(sum(w for _, w in layout) * 4, self.page_bytes)


def plan_frames(units: Sequence[tuple[str, int, Layout]], budget: LocalBudget,
                what: str) -> dict[str, int]:
    """Per unit (name, rows, layout), the page frames it keeps in memory; 0: all its rows
    in memory (no budget, or the rank's columns fit it). Beyond the budget: the budget less
    the pages' bookkeeping, in proportion to each unit's bytes, at least one page each.
    ConfigError (one line, the sizes) when they spill but there is no spill directory or
    the disk limit is short."""
    sizes = {name: rows * sum(w for _, w in layout) * 4 for name, rows, layout in units}
    total = sum(sizes.values())
    if not budget.memory_bytes or total <= budget.memory_bytes:
        return dict.fromkeys(sizes, 0)
    if not budget.spill_dir:
        raise ConfigError(f"{what}: the optimizer state and master rows take {_mib(total)}, "
                          f"more than --local-memory-budget-mb {budget.memory_bytes >> 20}; "
                          "give --local-spill-dir DIR to spill the rest to disk")
    disk = sum(spilled_bytes(layout, rows, budget.page_rows(layout))
               for _, rows, layout in units if rows)
    if budget.max_disk_bytes and disk > budget.max_disk_bytes:
        raise ConfigError(f"{what}: its spill files need up to {disk / 2**30:.3f} GiB, more "
                          f"than --local-spill-max-gb {budget.max_disk_bytes / 2**30:g}")
    # the per-page bookkeeping of every spilled unit comes out of the budget first
    pages = sum(-(-rows // budget.page_rows(layout)) for _, rows, layout in units)
    memory = max(budget.memory_bytes - PAGE_BOOKKEEPING_BYTES * pages, 0)
    frames = {}
    for name, rows, layout in units:
        page = frame_bytes(layout, budget.page_rows(layout)) or 1
        frames[name] = max(1, memory * sizes[name] // total // page) if rows else 0
    return frames


class SpillDir:
    """This rank's directory under the spill root (module doc)."""

    def __init__(self, root: str | Path, rank: int) -> None:
        self.root = Path(root)
        problem = _writable_problem(self.root)
        if problem is not None:
            raise ConfigError(problem)
        self.removed_stale = remove_stale(self.root, PROCESS_PREFIX)
        self._own = LockedDir(self.root, f"{PROCESS_PREFIX}{rank}-")
        self.path = self._own.path
        self._next = 0

    def columns(self, layout: Layout, rows: int, budget: LocalBudget,
                frames: int) -> RowColumns:
        assert self.path is not None
        path = self.path / f"u{self._next}.pages"
        self._next += 1
        return SpilledRows(path, layout, rows, budget.page_rows(layout), frames)

    def close(self) -> None:
        self._own.close()
        self.path = None


def _writable_problem(root: Path) -> str | None:
    """Why a rank cannot spill under `root` (created when missing); None: it can."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"--local-spill-dir {str(root)!r}: cannot create it ({exc.strerror or exc})"
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        return f"--local-spill-dir {str(root)!r} is not a writable directory"
    return None
