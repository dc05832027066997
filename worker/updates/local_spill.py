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

What the budget holds: the frames and each spilled unit's bookkeeping (its units' places
and its log's per-page figures: hybridps/spilled_rows.py `spilled_bookkeeping_bytes`,
taken out of the budget before the split, so the columns' `memory_bytes` stay within
it), and a dynamic table's paged-out rows. Outside it: a changed flag per row
(incremental checkpoints, on the rows' device). A checkpoint reads spilled pages back
(the spill file is a cache, never the recovery source).

Dynamic tables (`plan_paged`), as the shard server's partitions (ps/core/store.py): with
a dynamic table on the rank, the columns get half the budget (spilling beyond it), and
the paged-out rows what the columns leave of it, split over the dynamic tables in
proportion to their columns' bytes in memory (equally when they hold none). A store's
share is its quota (hybridps/paged_rows.py `set_quota`): past it the ids seen longest
ago are dropped after a page call (counted as the slots' `dropped_paged`). With
--local-spill-dir and --local-spill-max-gb, its rows and state spill too
(`PagedRows.spill_payload`) to the disk the static spill files leave of
--local-spill-max-gb, split like the quotas (hybridps/paged_spill.py `paged_quota`:
each entry's bookkeeping stays in the quota, an eighth of it as page frames), so rows
are dropped only beyond memory and disk, by the same decisions. A bounded store's page
calls take the reference step (the fused one, worker/embedding/dynamic/fused.py, neither
drops nor reads a spilled payload).

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
from hybridps.paged_rows import PagedRows
from hybridps.paged_spill import paged_quota, payload_columns, payload_page_rows
from hybridps.spilled_rows import (
    DEFAULT_PAGE_BYTES,
    RowColumns,
    SpilledRows,
    frame_bytes,
    page_rows_for,
    spilled_bookkeeping_bytes,
    spilled_bytes,
)

MASTER = "master"  # the fp32 master rows' column, next to the optimizer's
PROCESS_PREFIX = "rank"
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
                what: str, dynamic: bool = False) -> dict[str, int]:
    """Per unit (name, rows, layout), the page frames it keeps in memory; 0: all its rows
    in memory (no budget, or the rank's columns fit their part of it). Their part: the
    budget, half of it with `dynamic` tables on the rank (module doc). Beyond it: the part
    less every spilled unit's bookkeeping, in proportion to each unit's bytes, at least
    one page each. ConfigError (one line, the sizes) when they spill but there is no
    spill directory or the disk limit is short."""
    sizes = {name: rows * sum(w for _, w in layout) * 4 for name, rows, layout in units}
    total = sum(sizes.values())
    part = budget.memory_bytes // 2 if dynamic else budget.memory_bytes
    if not budget.memory_bytes or total <= part:
        return dict.fromkeys(sizes, 0)
    if not budget.spill_dir:
        of = "half of " if dynamic else ""
        why = " (the other half is the dynamic tables' paged rows')" if dynamic else ""
        raise ConfigError(f"{what}: the optimizer state and master rows take {_mib(total)}, "
                          f"more than {of}--local-memory-budget-mb "
                          f"{budget.memory_bytes >> 20}{why}; give --local-spill-dir DIR to "
                          "spill the rest to disk")
    disk = spill_disk_bytes(units, budget)
    if budget.max_disk_bytes and disk > budget.max_disk_bytes:
        raise ConfigError(f"{what}: its spill files need up to {disk / 2**30:.3f} GiB, more "
                          f"than --local-spill-max-gb {budget.max_disk_bytes / 2**30:g}")
    # every spilled unit's bookkeeping comes out of the budget first
    bookkeeping = sum(spilled_bookkeeping_bytes(layout, rows, budget.page_rows(layout))
                      for _, rows, layout in units if rows)
    memory = max(part - bookkeeping, 0)
    frames = {}
    for name, rows, layout in units:
        page = frame_bytes(layout, budget.page_rows(layout)) or 1
        frames[name] = max(1, memory * sizes[name] // total // page) if rows else 0
    return frames


def spill_disk_bytes(units: Sequence[tuple[str, int, Layout]], budget: LocalBudget) -> int:
    """The most disk the spill files of these units (name, rows, layout) may take."""
    return sum(spilled_bytes(layout, rows, budget.page_rows(layout))
               for _, rows, layout in units if rows)


def held_bytes(rows: int, layout: Layout, frames: int, budget: LocalBudget) -> int:
    """The most memory a unit's columns hold: every row (`frames` 0), or `frames` pages
    of slots and the spilled bookkeeping (SpilledRows.memory_bytes, between calls that
    fit the slots)."""
    if not frames:
        return rows * sum(w for _, w in layout) * 4
    page_rows = budget.page_rows(layout)
    return (frames * frame_bytes(layout, page_rows)
            + spilled_bookkeeping_bytes(layout, rows, page_rows))


@dataclass(frozen=True)
class PagedBound:
    """How a dynamic table's paged-out rows are bounded: `quota` the bytes its drops are
    decided on (0: no bound), `frames` its spilled payload's pages in memory (0: the
    payload stays in memory), `memory` its share of the budget, `disk` of the disk."""

    quota: int = 0
    frames: int = 0
    memory: int = 0
    disk: int = 0


def plan_paged(stores: Sequence[tuple[str, PagedRows, int, int]], budget: LocalBudget,
               held: int, disk: int, what: str) -> dict[str, PagedBound]:
    """Per dynamic table (name, its paged store, its slots: the most ids a page call puts,
    its columns' bytes in memory), the bound of its paged rows (module doc) when the
    rank's columns hold `held` bytes of memory and may take `disk` bytes of spill files.
    ConfigError (one line, the sizes) when the columns leave nothing of the budget."""
    if not budget.memory_bytes or not stores:
        return {name: PagedBound() for name, *_ in stores}
    left = budget.memory_bytes - held
    if left <= 0:
        raise ConfigError(f"{what}: its optimizer state and master rows hold {_mib(held)} "
                          f"of --local-memory-budget-mb {budget.memory_bytes >> 20}: nothing "
                          "is left for its dynamic tables' paged rows")
    weights = [w for *_, w in stores]
    if not sum(weights):
        weights = [1] * len(stores)
    quotas = [max(1, left * w // sum(weights)) for w in weights]
    room = budget.max_disk_bytes - disk if budget.spill_dir and budget.max_disk_bytes else 0
    out = {}
    for (name, store, slots, _), quota in zip(stores, quotas, strict=True):
        part = max(room, 0) * quota // sum(quotas)
        bound, frames = (quota, 0) if not part else paged_quota(
            store.dim, store.layout, quota, part, slots, store.row_bytes, budget.page_bytes)
        out[name] = PagedBound(bound, frames, quota, part)
    return out


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

    def payload(self, store: PagedRows, budget: LocalBudget, frames: int) -> SpilledRows:
        """A spilled payload for a dynamic table's paged store (`PagedRows.spill_payload`):
        its rows and state by pool position, as many positions as the store may use,
        `frames` pages of them in memory."""
        assert self.path is not None
        path = self.path / f"p{self._next}.pages"
        self._next += 1
        return SpilledRows(path, payload_columns(store.dim, store.layout), store.max_entries,
                           payload_page_rows(store.dim, store.layout, budget.page_bytes),
                           frames)

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
