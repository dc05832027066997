"""Row-shaped float32 columns held in memory, or paged to disk beyond a budget. No grpc.

The optimizer state of a table's rows (Adam's m and v, a master row...) is a set of
columns, name -> [rows, width] float32. Two holders behind one interface:

- `HeldRows`: every row in memory (the tensors themselves);
- `SpilledRows`: a hot set of rows in memory and the others in a crc-checked page file
  (hybridps/page_file.py) used as a log. Rows go in units (`unit_rows`: one row, or a
  few narrow ones so a unit holds UNIT_BYTES at least). A unit in memory sits in a slot,
  found through `where` (unit -> slot, or its place on disk); slots leave memory by a
  clock (second chance) over unit accesses, run a window of slots at a time with numpy.
  A dirty unit that leaves is appended to the log in the order units left (page by page,
  each page holding its unit ids and rows), a clean one keeps its copy on disk; a fill
  reads only the pages of the units a call misses. A unit never written is zeros, made
  in memory. The log reserves twice the pages the state fills: a page whose units are
  all dead (rewritten, or overwritten while resident) is reused, and when none is free
  the pages with the fewest live units are compacted (their live units rewritten with
  the ones leaving), so the disk stays within the reservation.

`view(rows)` makes the units of `rows` resident and answers the tensors to index and the
rows to index them with: the kernels then update the slots in place, bitwise as they
update the full tensors (the same values at other addresses). Every decision depends
only on this holder's own calls, so two runs of a job spill the same rows. A call that
needs more units than the slots gets them (its slots stay until the next call), so a
push of any size applies whole. `read` (a checkpoint) and `write` (a restore, a seed)
go to the rows where they are and leave the hot set as it is.

Used by the shard server's partitions (ps/core/partition.py); a worker's in-process
store can hold its columns the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from hybridps.errors import CorruptSpill, NotRegistered, ResourceExhausted
from hybridps.page_file import HEADER_BYTES, PageFile, native_pages, page_stride

# default log page: one 4 KiB block (header, unit ids and rows): a fill reads a whole
# page to check its crc32, so a page is what one cold row costs to bring back
DEFAULT_PAGE_BYTES = 4 << 10
# the least bytes a unit of the hot set holds (rows_for: narrow rows go in groups)
UNIT_BYTES = 128
# memory per slot besides its rows: unit, disk copy (int64 each), reference, dirty and
# pinned flags
SLOT_BOOKKEEPING = 8 + 8 + 3
# memory per log page: live count, crc32, written flag, free stack entry (4, 4, 1, 4)
LOG_PAGE_BOOKKEEPING = 4 + 4 + 1 + 4
# pages a checkpoint's read moves at a time (a bounded buffer), rows a write handles
READ_PAGES = 256
WRITE_ROWS = 1 << 16


class RowColumns:
    """The interface both holders implement (module doc)."""

    layout: tuple[tuple[str, int], ...]
    rows: int

    def view(self, rows_U: torch.Tensor, write: bool = True
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(columns by name, the positions of `rows_U` in them): valid until the next
        call. `write`: the caller may change them."""
        raise NotImplementedError

    def read(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """A copy of rows [lo, hi) of every column."""
        raise NotImplementedError

    def write(self, lo: int, values: Mapping[str, torch.Tensor]) -> None:
        """Rows [lo, lo + n) of the columns named in `values` ([n, width] each)."""
        raise NotImplementedError

    def fill(self, rows_U: torch.Tensor, names: Sequence[str], value: float = 0.0) -> None:
        """Set rows `rows_U` of the columns `names` to `value`."""
        cols, at = self.view(rows_U)
        for name in names:
            cols[name].index_fill_(0, at, value)

    @property
    def memory_bytes(self) -> int:
        raise NotImplementedError

    @property
    def disk_bytes(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        """hits, misses (page accesses in memory or not), fills, spills (pages read from
        and written to disk), pages, frames (pages in memory); empty: nothing spills."""
        return {}

    def close(self) -> None:
        """Release what it holds outside memory (its page file)."""


class HeldRows(RowColumns):
    """Every row in memory: the tensors themselves."""

    def __init__(self, columns: Mapping[str, torch.Tensor]) -> None:
        self.columns = dict(columns)
        self.layout = tuple((n, int(t.shape[1])) for n, t in self.columns.items())
        self.rows = int(next(iter(self.columns.values())).shape[0]) if self.columns else 0

    def view(self, rows_U: torch.Tensor, write: bool = True
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self.columns, rows_U

    def read(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        return {n: t[lo:hi] for n, t in self.columns.items()}

    def write(self, lo: int, values: Mapping[str, torch.Tensor]) -> None:
        for n, v in values.items():
            self.columns[n][lo:lo + v.shape[0]].copy_(v)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.columns.values())


class SpilledRows(RowColumns):
    """Rows in a hot set of `frames * page_rows` rows in memory and a log of crc-checked
    pages on disk (module doc)."""

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, int]], rows: int,
                 page_rows: int, frames: int, unit_rows: int = 0) -> None:
        if page_rows < 1 or frames < 1 or rows < 0 or unit_rows < 0:
            raise ValueError(f"spilled rows {path}: page_rows={page_rows} and "
                             f"frames={frames} must be >= 1, rows={rows} and "
                             f"unit_rows={unit_rows} >= 0")
        self.layout = tuple((str(n), int(w)) for n, w in layout)
        self.rows = rows
        self.row_floats = sum(w for _, w in self.layout)
        self.unit_rows = unit_rows or unit_rows_for(self.row_floats * 4)
        g = self.unit_rows
        self.units = -(-rows // g)
        self.page_units = max(1, page_rows // g)  # units a log page holds
        self.page_rows = self.page_units * g
        self.pages = -(-rows // self.page_rows)  # the state in pages (the stats' unit)
        self.slots_quota = max(1, min(frames * self.page_rows // g, max(self.units, 1)))
        self.log_pages = log_pages_for(self.units, self.page_units)
        self.file = PageFile(path, log_payload_bytes(self.layout, self.page_rows, g),
                             self.log_pages)
        # a unit's place: >= 0 its live copy on disk (page * page_units + k), -1 none (zeros:
        # never written), <= -2 resident in slot -2 - value
        self.where = np.full(self.units, -1, dtype=np.int64)
        self.live = np.zeros(self.log_pages, dtype=np.int32)  # live units in each page
        self._free_pages = np.empty(self.log_pages, dtype=np.int32)  # a stack
        self._nfree = 0
        self._fresh = 0  # pages [fresh, log_pages) were never written
        self._alloc(self.slots_quota)
        self.used = 0  # slots [0, used) hold units
        self.hand = 0
        self.hits = 0     # unit accesses found in memory
        self.misses = 0   # unit accesses that were not
        self.fills = 0    # pages read back from disk
        self.spills = 0   # pages written to disk
        self.compactions = 0
        self.compacted = 0  # pages a compaction read (counted in fills too)
        self.moved = 0    # live units a compaction rewrote
        self.closed = False

    # -- slots -----------------------------------------------------------------------

    def _alloc(self, slots: int) -> None:
        self.nslots = slots
        # a slot is written whole (from disk, or zeroed) before it is read
        self.buffers = {n: torch.empty(slots * self.unit_rows, w, dtype=torch.float32)
                        for n, w in self.layout}
        self.unit_of = np.full(slots, -1, dtype=np.int64)
        self.disk_of = np.full(slots, -1, dtype=np.int64)  # its clean copy on disk, or -1
        self.ref = np.zeros(slots, dtype=bool)
        self.dirty = np.zeros(slots, dtype=bool)
        self.pinned = np.zeros(slots, dtype=bool)

    def _resize(self, slots: int) -> None:
        old = self.nslots
        buffers = self.buffers
        arrays = (self.unit_of, self.disk_of, self.ref, self.dirty, self.pinned)
        self._alloc(slots)
        keep = min(old, slots)
        for n, t in buffers.items():
            self.buffers[n][:keep * self.unit_rows].copy_(t[:keep * self.unit_rows])
        for new, prev in zip((self.unit_of, self.disk_of, self.ref, self.dirty,
                              self.pinned), arrays, strict=True):
            new[:keep] = prev[:keep]

    def _slot_rows(self, slots: np.ndarray) -> torch.Tensor:
        g = self.unit_rows
        if g == 1:
            return torch.from_numpy(slots)
        return torch.from_numpy((slots[:, None] * g + np.arange(g)[None, :]).reshape(-1))

    def _victims(self, count: int) -> np.ndarray:
        """`count` occupied, unpinned slots by the clock (second chance): from the hand,
        a slot with its reference bit loses it, the first ones without are taken; a
        window of the ring at a time (vectorised), so the work is that of the hand's
        move."""
        n = self.used
        taken: list[np.ndarray] = []
        window = max(2 * count, 256)
        while count:
            w = min(window, n)
            idx = (self.hand + np.arange(w)) % n
            eligible = ~self.pinned[idx]
            pos = np.flatnonzero(eligible & ~self.ref[idx])
            if pos.size >= count:
                last = int(pos[count - 1])
                chosen = idx[pos[:count]]
                passed = idx[:last + 1]
                self.ref[passed[eligible[:last + 1]]] = False
                self.hand = (int(idx[last]) + 1) % n
            else:
                chosen = idx[pos]
                self.ref[idx[eligible]] = False
                self.hand = (self.hand + w) % n
                window *= 2
            self.pinned[chosen] = True  # not taken twice
            taken.append(chosen)
            count -= int(chosen.size)
        return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)

    def _claim(self, count: int) -> np.ndarray:
        """`count` slots for units coming in: free ones first, then the clock's victims
        (evicted), never a pinned one (this call's); more slots when a call needs more
        than the others."""
        free = min(count, self.nslots - self.used)
        got = [np.arange(self.used, self.used + free, dtype=np.int64)]
        self.pinned[got[0]] = True
        self.used += free
        rest = count - free
        if rest:
            evictable = self.used - int(self.pinned[:self.used].sum())
            if evictable < rest:  # one call's units exceed the slots
                extra = rest - evictable
                self._resize(self.nslots + extra)
                got.append(np.arange(self.used, self.used + extra, dtype=np.int64))
                self.pinned[got[-1]] = True
                self.used += extra
                rest -= extra
        if rest:
            victims = self._victims(rest)
            self._evict(victims)
            got.append(victims)
        slots = np.concatenate(got)
        self.pinned[slots] = True
        return slots

    def _evict(self, slots: np.ndarray) -> None:
        """Move the units of `slots` out: a dirty one appended to the log (in the order
        they left), a clean one keeps its copy on disk (or is zeros); the slots are free."""
        if not slots.size:
            return
        units = self.unit_of[slots]
        dirty = self.dirty[slots]
        clean = ~dirty
        self.where[units[clean]] = self.disk_of[slots[clean]]
        out_units = units[dirty]
        data = None
        if out_units.size:
            rows = self._slot_rows(slots[dirty])
            data = {n: t.index_select(0, rows) for n, t in self.buffers.items()}
            self.where[out_units] = -1  # until appended below
        self.unit_of[slots] = -1
        self.disk_of[slots] = -1
        self.ref[slots] = False
        self.dirty[slots] = False
        if data is not None:
            self._append(out_units, data)

    def _shrink_to_quota(self) -> None:
        """Back to `slots_quota` slots after a call that needed more."""
        if self.nslots <= self.slots_quota:
            return
        beyond = np.arange(self.slots_quota, self.used, dtype=np.int64)
        self._evict(beyond[self.unit_of[beyond] >= 0])
        self._resize(self.slots_quota)
        self.used = min(self.used, self.slots_quota)
        self.hand = self.hand % max(self.used, 1)

    # -- the log ---------------------------------------------------------------------

    def _drop_copies(self, positions: np.ndarray) -> None:
        """The disk copies at `positions` are dead: a page without live units is free."""
        if not positions.size:
            return
        pages = positions // self.page_units
        np.subtract.at(self.live, pages, 1)
        pages = np.unique(pages)
        self._push_free(pages[self.live[pages] == 0])

    def _push_free(self, pages: np.ndarray) -> None:
        self._free_pages[self._nfree:self._nfree + pages.size] = pages
        self._nfree += int(pages.size)

    def _free_count(self) -> int:
        return self._nfree + self.log_pages - self._fresh

    def _take_pages(self, count: int) -> np.ndarray:
        """`count` free pages: freed ones first (the file stays small), then new ones."""
        reuse = min(count, self._nfree)
        pages = [self._free_pages[self._nfree - reuse:self._nfree][::-1].astype(np.int64)]
        self._nfree -= reuse
        fresh = count - reuse
        pages.append(np.arange(self._fresh, self._fresh + fresh, dtype=np.int64))
        self._fresh += fresh
        return np.concatenate(pages)

    def _append(self, units: np.ndarray, data: Mapping[str, torch.Tensor]) -> None:
        """Write `units` (their rows of every column in `data`, unit by unit) to fresh
        pages of the log, in this order; compact first when the free pages do not hold
        them."""
        need = -(-int(units.size) // self.page_units)
        if self._free_count() < need:
            moved_units, moved = self._compact(int(units.size))
            if moved_units.size:
                units = np.concatenate([units, moved_units])
                data = {n: torch.cat([data[n], moved[n]]) for n in data}
            need = -(-int(units.size) // self.page_units)
        pages = self._take_pages(need)
        k = self.page_units
        count = int(units.size)
        ids = np.full(need * k, -1, dtype=np.int64)
        ids[:count] = units
        parts = [ids.view(np.uint8).reshape(need, -1)]
        g = self.unit_rows
        for n, w in self.layout:
            block = np.zeros((need * k * g, w), dtype=np.float32)
            block[:count * g] = data[n].numpy()
            parts.append(block.view(np.uint8).reshape(need, -1))
        self.file.write_many(pages, np.concatenate(parts, axis=1))
        self.spills += need
        at = np.arange(count, dtype=np.int64)
        self.where[units] = pages[at // k] * k + at % k
        self.live[pages] = k
        self.live[pages[-1]] = count - (need - 1) * k

    def _compact(self, incoming: int) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        """Free pages for `incoming` units: the pages with the fewest live units (ties:
        the lowest page) are read, their live units taken out (rewritten by the caller
        with the incoming ones), the pages freed. A resident unit's clean copy there is
        dropped instead (the unit is marked dirty). The log holds twice the pages of
        the state (log_pages_for), so pages at most half live always free enough."""
        k = self.page_units
        written = np.arange(self._fresh, dtype=np.int64)
        candidates = written[self.live[:self._fresh] > 0]
        candidates = candidates[np.argsort(self.live[candidates], kind="stable")]
        live = np.cumsum(self.live[candidates].astype(np.int64))
        free = self._free_count() + np.arange(1, candidates.size + 1)
        enough = np.flatnonzero(free >= -(-(incoming + live) // k))
        if not enough.size:
            raise ResourceExhausted(
                f"spilled rows {self.file.path}: the log's {self.log_pages} pages hold no "
                f"room for {incoming} more units ({int(self.live.sum())} live)")
        victims = candidates[:int(enough[0]) + 1]
        payloads = self.file.read_pages(victims)
        self.fills += int(victims.size)
        self.compacted += int(victims.size)
        ids = payloads[:, :k * 8].copy().view(np.int64).reshape(-1)  # [victims * k]
        positions = (victims[:, None] * k + np.arange(k)[None, :]).reshape(-1)
        ids_ok = ids >= 0
        place = np.full(ids.size, -1, dtype=np.int64)
        place[ids_ok] = self.where[ids[ids_ok]]
        on_disk = ids_ok & (place == positions)
        resident = ids_ok & (place <= -2)
        slots = -2 - place[resident]
        clean_here = self.disk_of[slots] == positions[resident]
        slots = slots[clean_here]
        self.disk_of[slots] = -1
        self.dirty[slots] = True
        self.live[victims] = 0
        self._push_free(victims)
        self.compactions += 1
        units = ids[on_disk]
        self.moved += int(units.size)
        at = np.flatnonzero(on_disk)  # victim by victim, place by place
        cols = self._unpack(payloads, at // k, at % k)
        self.where[units] = -1  # until appended
        return units, cols

    def _unpack(self, payloads: np.ndarray, page_at: np.ndarray,
                k_at: np.ndarray) -> dict[str, torch.Tensor]:
        """The units at (row `page_at` of `payloads`, place `k_at` in it), [units * g, w]
        each column."""
        k, g = self.page_units, self.unit_rows
        out = {}
        at = k * 8
        for n, w in self.layout:
            size = k * g * w * 4
            block = payloads[:, at:at + size].view(np.float32).reshape(-1, k, g * w)
            out[n] = torch.from_numpy(block[page_at, k_at].reshape(-1, w))
            at += size
        return out

    def _load(self, units: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows of `units` (not resident), [units * g, w] each column: from their
        pages or zeros (never written)."""
        g = self.unit_rows
        out = {n: torch.zeros(units.size * g, w, dtype=torch.float32)
               for n, w in self.layout}
        positions = self.where[units]
        on_disk = np.flatnonzero(positions >= 0)
        if on_disk.size:
            self._fill(units[on_disk], positions[on_disk], out, on_disk)
        return out

    def _fill(self, units: np.ndarray, pos: np.ndarray, dst: Mapping[str, torch.Tensor],
              dst_at: np.ndarray) -> None:
        """The rows of `units` from their copies at `pos` on disk into unit `dst_at` of
        `dst` (each column [units * g, w]): natively, straight from the checked pages
        (one check of the batch, then one gather, the unit id each page holds checked
        first); else through _read_units."""
        ext = native_pages()
        cols = [dst[n] for n, _ in self.layout]
        if ext is None or not all(t.dtype == torch.float32 and t.is_contiguous()
                                  for t in cols):
            got = self._read_units(units, pos)
            rows = self._slot_rows(dst_at)
            for n, t in dst.items():
                t.index_copy_(0, rows, got[n])
            return
        k, g = self.page_units, self.unit_rows
        page_of = np.ascontiguousarray(pos // k, dtype=np.int64)
        places = np.ascontiguousarray(pos % k, dtype=np.int64)
        pages = np.unique(page_of)
        self.file.check(pages)
        self.fills += int(pages.size)
        unit_bytes = np.array([g * w * 4 for _, w in self.layout], dtype=np.int64)
        col_off = HEADER_BYTES + k * 8 + np.concatenate([[0], np.cumsum(unit_bytes * k)[:-1]])
        col_off = np.ascontiguousarray(col_off, dtype=np.int64)
        col_dst = np.array([t.data_ptr() for t in cols], dtype=np.uint64)
        ids = np.ascontiguousarray(units, dtype=np.int64)
        at = np.ascontiguousarray(dst_at, dtype=np.int64)
        mapping = self.file.mapping()  # held through the call (PageFile.mapping)
        bad = ext.gather_units(mapping.ctypes.data, self.file.stride, HEADER_BYTES,
                               page_of.ctypes.data, places.ctypes.data, ids.ctypes.data,
                               ids.size, col_off.ctypes.data, unit_bytes.ctypes.data,
                               col_dst.ctypes.data, len(cols), at.ctypes.data)
        self.file.drop_resident(pages)
        if bad >= 0:
            held = self.file.read_pages([page_of[bad]])[0, :k * 8].view(np.int64)
            raise CorruptSpill(f"spilled rows {self.file.path}: page {int(page_of[bad])} "
                               f"holds unit {int(held[places[bad]])} where unit "
                               f"{int(units[bad])} was written")

    def _read_units(self, units: np.ndarray, pos: np.ndarray) -> dict[str, torch.Tensor]:
        """The rows of `units` from their copies at `pos` on disk, [units * g, w] each
        column: their pages read in one batch (each once, in page order, crc-checked),
        the unit id each page holds checked."""
        k = self.page_units
        page_of = pos // k
        pages = np.unique(page_of)
        payloads = self.file.read_pages(pages)
        self.fills += int(pages.size)
        page_at = np.searchsorted(pages, page_of)
        self._check_ids(payloads, page_at, pos % k, units, pages)
        return self._unpack(payloads, page_at, pos % k)

    def _resident(self, units: np.ndarray, write: bool) -> np.ndarray:
        """Make `units` (distinct) resident, referenced, and dirty when `write`: their
        slots."""
        if self.closed:  # a call that found its partition before it was freed
            raise NotRegistered(f"spilled rows {self.file.path}: freed with their partition")
        self._shrink_to_quota()
        place = self.where[units]
        here = place <= -2
        self.hits += int(here.sum())
        self.pinned[-2 - place[here]] = True
        missing = units[~here]
        if missing.size:
            self.misses += int(missing.size)
            slots = self._claim(int(missing.size))
            positions = self.where[missing]  # after the evictions (a compaction moves)
            # straight into the slots: a unit never written is its initial value (zeros,
            # as the state is allocated), no read; the others from their pages
            on_disk = positions >= 0
            if not on_disk.all():
                zero_rows = self._slot_rows(slots[~on_disk])
                for t in self.buffers.values():
                    t.index_fill_(0, zero_rows, 0.0)
            if on_disk.any():
                self._fill(missing[on_disk], positions[on_disk], self.buffers,
                           slots[on_disk])
            self.unit_of[slots] = missing
            self.disk_of[slots] = positions
            self.where[missing] = -2 - slots
        slots = -2 - self.where[units]
        self.pinned[slots] = False
        self.ref[slots] = True
        if write:
            self.dirty[slots] = True
            copies = self.disk_of[slots]
            copies = copies[copies >= 0]
            if copies.size:
                self.disk_of[slots] = -1
                self._drop_copies(copies)
        return slots

    # -- the interface ---------------------------------------------------------------

    def view(self, rows_U: torch.Tensor, write: bool = True
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows = rows_U.numpy() if rows_U.dtype == torch.int64 else rows_U.long().numpy()
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"spilled rows {self.file.path}: rows outside [0, {self.rows})")
        g = self.unit_rows
        units = rows // g if g > 1 else rows
        self._resident(np.unique(units), write)
        at = (-2 - self.where[units]) * g + (rows % g if g > 1 else 0)
        return self.buffers, torch.from_numpy(at)

    def read(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows [lo, hi), without bringing rows in (a checkpoint reads every row once:
        it should not push the working set out); each page read once, READ_PAGES at a
        time."""
        out = {n: torch.zeros(max(hi - lo, 0), w, dtype=torch.float32) for n, w in self.layout}
        if hi <= lo:
            return out
        if self.closed:
            raise NotRegistered(f"spilled rows {self.file.path}: freed with their partition")
        g, k = self.unit_rows, self.page_units
        rows = np.arange(lo, hi, dtype=np.int64)
        place = self.where[rows // g]
        resident = np.flatnonzero(place <= -2)
        if resident.size:
            src = torch.from_numpy((-2 - place[resident]) * g + rows[resident] % g)
            dst = torch.from_numpy(resident)
            for n, t in out.items():
                t.index_copy_(0, dst, self.buffers[n].index_select(0, src))
        disk = np.flatnonzero(place >= 0)
        if disk.size:
            disk = disk[np.argsort(place[disk] // k, kind="stable")]
            pos = place[disk]
            page_of = pos // k
            bounds = np.flatnonzero(np.diff(page_of)) + 1
            starts = np.concatenate([[0], bounds])
            for b in range(0, starts.size, READ_PAGES):
                a = int(starts[b])
                e = int(starts[b + READ_PAGES]) if b + READ_PAGES < starts.size else disk.size
                pages = page_of[starts[b:b + READ_PAGES]]
                payloads = self.file.read_pages(pages)
                page_at = np.searchsorted(pages, page_of[a:e])
                self._check_ids(payloads, page_at, pos[a:e] % k, rows[disk[a:e]] // g, pages)
                self._copy_rows(payloads, page_at, pos[a:e] % k, rows[disk[a:e]] % g,
                                disk[a:e], out)
        return out

    def _check_ids(self, payloads: np.ndarray, page_at: np.ndarray, k_at: np.ndarray,
                   units: np.ndarray, pages: np.ndarray) -> None:
        held = payloads[:, :self.page_units * 8].copy().view(np.int64)[page_at, k_at]
        wrong = np.flatnonzero(held != units)
        if wrong.size:
            i = int(wrong[0])
            raise CorruptSpill(f"spilled rows {self.file.path}: page {int(pages[page_at[i]])} "
                               f"holds unit {int(held[i])} where unit {int(units[i])} was "
                               "written")

    def _copy_rows(self, payloads: np.ndarray, page_at: np.ndarray, k_at: np.ndarray,
                   off: np.ndarray, dst: np.ndarray, out: dict[str, torch.Tensor]) -> None:
        k, g = self.page_units, self.unit_rows
        at = k * 8
        index = torch.from_numpy(dst)
        for n, w in self.layout:
            size = k * g * w * 4
            block = payloads[:, at:at + size].view(np.float32).reshape(-1, k, g, w)
            out[n].index_copy_(0, index, torch.from_numpy(block[page_at, k_at, off]))
            at += size

    def write(self, lo: int, values: Mapping[str, torch.Tensor]) -> None:
        """Rows [lo, lo + n) of the columns in `values`: resident rows in place, the
        others straight to the log (a restore does not push the working set out), a
        unit only partly written read first; WRITE_ROWS at a time."""
        n = next(iter(values.values())).shape[0] if values else 0
        if self.closed:
            raise NotRegistered(f"spilled rows {self.file.path}: freed with their partition")
        if n and (lo < 0 or lo + n > self.rows):
            raise IndexError(f"spilled rows {self.file.path}: rows [{lo}, {lo + n}) outside "
                             f"[0, {self.rows})")
        g = self.unit_rows
        whole = set(values) == {name for name, _ in self.layout}
        step = max(WRITE_ROWS // g, 1) * g
        for a in range(lo, lo + n, step):
            b = min(a + step, lo + n)
            units = np.arange(a // g, -(-b // g), dtype=np.int64)
            self._shrink_to_quota()
            resident = self.where[units] <= -2
            if resident.any():  # in place
                self._resident(units[resident], write=True)
                rows = np.arange(a, b, dtype=np.int64)
                slots = -2 - self.where[rows // g]
                mine = slots >= 0
                at = torch.from_numpy(slots[mine] * g + rows[mine] % g)
                src = torch.from_numpy(np.flatnonzero(mine) + a - lo)
                for name, v in values.items():
                    self.buffers[name].index_copy_(0, at, v.index_select(0, src).to(
                        torch.float32))
            cold = units[~resident]
            if not cold.size:
                continue
            # a unit wholly written with every column needs no read of what it held
            partial = (cold * g < a) | ((cold + 1) * g > b)
            if not whole:
                partial[:] = True
            cols = {name: torch.zeros(cold.size * g, w, dtype=torch.float32)
                    for name, w in self.layout}
            if partial.any():
                got = self._load(cold[partial])
                into = self._slot_rows(np.flatnonzero(partial))  # the units' rows in cols
                for name in cols:
                    cols[name].index_copy_(0, into, got[name])
            unit_rows = (cold[:, None] * g + np.arange(g)[None, :]).reshape(-1)
            inside = (unit_rows >= a) & (unit_rows < b)
            dst = torch.from_numpy(np.flatnonzero(inside))
            src = torch.from_numpy(unit_rows[inside] - lo)
            for name, v in values.items():
                cols[name].index_copy_(0, dst, v.index_select(0, src).to(torch.float32))
            old = self.where[cold]
            self._drop_copies(old[old >= 0])
            self.where[cold] = -1
            self._append(cold, cols)

    @property
    def memory_bytes(self) -> int:
        """The slots and the bookkeeping (unit places, the log's page counts and crc)."""
        return (self.nslots * self.unit_rows * self.row_floats * 4
                + self.nslots * SLOT_BOOKKEEPING
                + bookkeeping_bytes(self.units, self.log_pages))

    @property
    def disk_bytes(self) -> int:
        return self.file.disk_bytes

    @property
    def max_disk_bytes(self) -> int:
        return self.log_pages * self.file.stride

    def counters(self) -> dict[str, int]:
        """hits, misses (unit accesses in memory or not), fills, spills (pages read from
        and written to disk), pages (the state in pages), frames (the slots' rows in
        pages), and the hot set's and the log's own figures."""
        live = int(self.live.sum())
        return {"hits": self.hits, "misses": self.misses, "fills": self.fills,
                "spills": self.spills, "pages": self.pages,
                "frames": self.nslots * self.unit_rows // self.page_rows,
                "rows_in_memory": self.nslots * self.unit_rows,
                "log_pages_used": self._fresh - self._nfree, "live_units": live,
                "compactions": self.compactions, "compacted_pages": self.compacted,
                "moved_units": self.moved}

    def close(self) -> None:
        self.closed = True
        self.file.close(remove=True)


def unit_rows_for(row_bytes: int) -> int:
    """Rows a unit of the hot set holds: the fewest (a power of two) whose bytes reach
    UNIT_BYTES, so a unit's bookkeeping (its place, 8 bytes) stays a small share."""
    g = 1
    while g * max(row_bytes, 1) < UNIT_BYTES:
        g *= 2
    return g


def log_payload_bytes(layout: Sequence[tuple[str, int]], page_rows: int,
                      unit_rows: int) -> int:
    """A log page's payload: its units' ids (int64), then each column's rows in turn."""
    return page_rows // unit_rows * 8 + page_rows * sum(w for _, w in layout) * 4


def log_pages_for(units: int, page_units: int) -> int:
    """The pages of a log of `units` units: twice the pages they fill and a few, so that
    when no page is free the written ones are at most half live on average and a
    compaction of the least live always frees room."""
    return 2 * -(-units // page_units) + 4


def bookkeeping_bytes(units: int, log_pages: int) -> int:
    """Memory of the places of `units` units (int64 each) and of a log of `log_pages`
    pages (live count, crc32, written flag, free stack)."""
    return units * 8 + log_pages * LOG_PAGE_BOOKKEEPING


def page_rows_for(row_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES) -> int:
    """Rows a log page of about `page_bytes` (its header, unit ids and rows) holds: whole
    units, at least one."""
    g = unit_rows_for(row_bytes)
    unit = g * max(row_bytes, 1) + 8
    return max(1, (page_bytes - HEADER_BYTES) // unit) * g


def _layout_geometry(layout: Sequence[tuple[str, int]], rows: int, page_rows: int,
                     unit_rows: int = 0) -> tuple[int, int, int, int]:
    """(unit rows, units, page units, log pages) of a SpilledRows of these columns
    (`unit_rows` 0: by the row's bytes, as SpilledRows picks them)."""
    g = unit_rows or unit_rows_for(sum(w for _, w in layout) * 4)
    units = -(-rows // g)
    page_units = max(1, page_rows // g)
    return g, units, page_units, log_pages_for(units, page_units)


def spilled_bytes(layout: Sequence[tuple[str, int]], rows: int, page_rows: int,
                  unit_rows: int = 0) -> int:
    """The most disk bytes a SpilledRows of these columns and rows may write (its log)."""
    g, _, page_units, pages = _layout_geometry(layout, rows, page_rows, unit_rows)
    return pages * page_stride(log_payload_bytes(layout, page_units * g, g))


def spilled_rows_for_disk(layout: Sequence[tuple[str, int]], page_rows: int,
                          disk_bytes: int, unit_rows: int = 0) -> int:
    """The most rows a SpilledRows of these columns whose log fits `disk_bytes` holds."""
    g, _, page_units, _ = _layout_geometry(layout, 0, page_rows, unit_rows)
    stride = page_stride(log_payload_bytes(layout, page_units * g, g))
    pages = disk_bytes // stride - 4
    return max(pages // 2, 0) * page_units * g


def spilled_bookkeeping_bytes(layout: Sequence[tuple[str, int]], rows: int,
                              page_rows: int, unit_rows: int = 0) -> int:
    """Memory a SpilledRows of these columns keeps besides its slots."""
    _, units, _, pages = _layout_geometry(layout, rows, page_rows, unit_rows)
    return bookkeeping_bytes(units, pages)


def frame_bytes(layout: Sequence[tuple[str, int]], page_rows: int) -> int:
    """Memory a page's worth of slots takes (its rows and the slots' bookkeeping)."""
    g = unit_rows_for(sum(w for _, w in layout) * 4)
    return page_rows * sum(w for _, w in layout) * 4 + max(page_rows // g, 1) * SLOT_BOOKKEEPING
