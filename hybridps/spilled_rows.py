"""Row-shaped float32 columns held in memory, or paged to disk beyond a budget. No grpc.

The optimizer state of a table's rows (Adam's m and v, a master row...) is a set of
columns, name -> [rows, width] float32. Two holders behind one interface:

- `HeldRows`: every row in memory (the tensors themselves);
- `SpilledRows`: the rows in fixed-size pages of `page_rows` rows, at most `frames`
  pages in memory (frame buffers, one per column) and the others in a crc-checked page
  file (hybridps/page_file.py). A page leaves memory by a clock (second chance) over
  page accesses: a touched page gets its reference bit, the hand clears bits and takes
  the first frame without one; a dirty victim is written back (victims of one call in
  page order, consecutive pages in one block), a clean one with a copy on disk is
  dropped. A page never written is zeros (the state of an untouched row), made in
  memory.

`view(rows)` makes the pages of `rows` resident and answers the tensors to index and the
rows to index them with: the kernels then update the frames in place, bitwise as they
update the full tensors (the same values at other addresses). Every decision depends
only on this holder's own calls, so two runs of a job spill the same pages. A call that
needs more pages than `frames` gets them (its pages stay until the next call), so a
push of any size applies whole.

Used by the shard server's partitions (ps/core/partition.py); a worker's in-process
store can hold its columns the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from hybridps.errors import NotRegistered
from hybridps.page_file import PageFile, page_stride

# default page payload: big enough for sequential disk blocks, small enough that a
# random row drags little else in
DEFAULT_PAGE_BYTES = 64 << 10


def page_rows_for(row_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES) -> int:
    return max(1, page_bytes // max(row_bytes, 1))


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
    """Columns in pages, `frames` of them in memory and the rest in `path` (module doc)."""

    def __init__(self, path: str | Path, layout: Sequence[tuple[str, int]], rows: int,
                 page_rows: int, frames: int) -> None:
        if page_rows < 1 or frames < 1 or rows < 0:
            raise ValueError(f"spilled rows {path}: page_rows={page_rows} and "
                             f"frames={frames} must be >= 1, rows={rows} >= 0")
        self.layout = tuple((str(n), int(w)) for n, w in layout)
        self.rows = rows
        self.page_rows = page_rows
        self.row_floats = sum(w for _, w in self.layout)
        self.pages = -(-rows // page_rows)
        self.frames_quota = min(frames, max(self.pages, 1))
        self.file = PageFile(path, page_rows * self.row_floats * 4, self.pages)
        self.frame_of = np.full(self.pages, -1, dtype=np.int64)
        self._alloc(self.frames_quota)
        self.hand = 0
        self.hits = 0     # page accesses found in memory
        self.misses = 0   # page accesses that were not
        self.fills = 0    # pages read back from disk
        self.spills = 0   # pages written to disk
        self.closed = False

    # -- frames ----------------------------------------------------------------------

    def _alloc(self, frames: int) -> None:
        self.nframes = frames
        # a frame is written whole (read from disk, or zeroed for a page never written)
        # before it is read: no need to zero the buffers
        self.buffers = {n: torch.empty(frames * self.page_rows, w, dtype=torch.float32)
                        for n, w in self.layout}
        self.page_of = np.full(frames, -1, dtype=np.int64)
        self.ref = np.zeros(frames, dtype=bool)
        self.dirty = np.zeros(frames, dtype=bool)

    def _grow(self, frames: int) -> None:
        old = self.nframes
        buffers, page_of = self.buffers, self.page_of
        ref, dirty = self.ref, self.dirty
        self._alloc(frames)
        keep = min(old, frames) * self.page_rows
        for n, t in buffers.items():
            self.buffers[n][:keep].copy_(t[:keep])
        k = min(old, frames)
        self.page_of[:k], self.ref[:k], self.dirty[:k] = page_of[:k], ref[:k], dirty[:k]

    def _frame_rows(self, frames: np.ndarray) -> torch.Tensor:
        """The buffer rows of `frames`, frame by frame."""
        rows = frames[:, None] * self.page_rows + np.arange(self.page_rows)[None, :]
        return torch.from_numpy(rows.reshape(-1))

    def _payloads(self, frames: np.ndarray) -> np.ndarray:
        """The pages of `frames` as payloads, [frames, payload floats]: each column's rows
        of the page in turn."""
        rows = self._frame_rows(frames)
        k = int(frames.size)
        return np.concatenate([t.index_select(0, rows).numpy().reshape(k, -1)
                               for t in self.buffers.values()], axis=1)

    def _load(self, frames: np.ndarray, payloads: list[np.ndarray] | None) -> None:
        """Fill `frames` with `payloads` (one a frame), or zeros (None)."""
        if not frames.size:
            return
        rows = self._frame_rows(frames)
        if payloads is None:
            for t in self.buffers.values():
                t.index_fill_(0, rows, 0.0)
            return
        floats = np.stack(payloads).view(np.float32)  # [frames, payload floats]
        at = 0
        for n, w in self.layout:
            size = self.page_rows * w
            block = np.ascontiguousarray(floats[:, at:at + size]).reshape(-1, w)
            self.buffers[n].index_copy_(0, rows, torch.from_numpy(block))
            at += size

    def _evict(self, frames: np.ndarray) -> None:
        """Write the dirty ones of `frames` back (one batch, in page order) and free all."""
        if not frames.size:
            return
        frames = frames[self.page_of[frames] >= 0]
        dirty = frames[self.dirty[frames]]
        if dirty.size:
            payloads = self._payloads(dirty)
            self.file.write_many(self.page_of[dirty], list(payloads))
            self.spills += int(dirty.size)
        self.frame_of[self.page_of[frames]] = -1
        self.page_of[frames] = -1
        self.ref[frames] = False
        self.dirty[frames] = False

    def _claim(self, count: int, pinned: np.ndarray) -> np.ndarray:
        """`count` frames for new pages: free ones first, then by the clock, never one of
        `pinned` (pages of this call); more frames when the others are pinned."""
        free = np.flatnonzero(self.page_of < 0)[:count]
        if free.size == count:
            return free
        need = count - free.size
        busy = np.zeros(self.nframes, dtype=bool)
        busy[pinned] = True
        busy[free] = True
        if self.nframes - int(busy.sum()) < need:  # one call's pages exceed the frames
            old = self.nframes
            self._grow(old + need - (self.nframes - int(busy.sum())))
            busy = np.concatenate([busy, np.zeros(self.nframes - old, dtype=bool)])
        victims: list[int] = []
        while len(victims) < need:
            f = self.hand
            self.hand = (self.hand + 1) % self.nframes
            if busy[f]:
                continue
            if self.page_of[f] < 0:  # a frame the growth added
                victims.append(f)
                busy[f] = True
                continue
            if self.ref[f]:
                self.ref[f] = False
                continue
            victims.append(f)
            busy[f] = True
        chosen = np.asarray(victims, dtype=np.int64)
        self._evict(chosen)
        return np.concatenate([free, chosen])

    def _shrink_to_quota(self) -> None:
        """Back to `frames_quota` frames after a call that needed more."""
        if self.nframes <= self.frames_quota:
            return
        beyond = np.arange(self.frames_quota, self.nframes)
        self._evict(beyond)
        self._grow(self.frames_quota)
        self.hand %= self.nframes

    def _resident(self, pages: np.ndarray, write: bool) -> None:
        """Make `pages` (distinct) resident, referenced, and dirty when `write`."""
        if self.closed:  # a call that found its partition before it was freed
            raise NotRegistered(f"spilled rows {self.file.path}: freed with their partition")
        self._shrink_to_quota()
        frames = self.frame_of[pages]
        here = frames >= 0
        self.hits += int(here.sum())
        missing = pages[~here]
        if missing.size:
            self.misses += int(missing.size)
            got = self._claim(int(missing.size), frames[here])
            on_disk = self.file.written_mask(missing)
            if on_disk.any():
                payloads = self.file.read_many(missing[on_disk])
                self._load(got[on_disk], payloads)
                self.fills += len(payloads)
            self._load(got[~on_disk], None)
            self.page_of[got] = missing
            self.frame_of[missing] = got
        frames = self.frame_of[pages]
        self.ref[frames] = True
        if write:
            self.dirty[frames] = True

    # -- the interface ---------------------------------------------------------------

    def view(self, rows_U: torch.Tensor, write: bool = True
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows = rows_U.numpy() if rows_U.dtype == torch.int64 else rows_U.long().numpy()
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"spilled rows {self.file.path}: rows outside [0, {self.rows})")
        pages = rows // self.page_rows
        self._resident(np.unique(pages), write)
        at = self.frame_of[pages] * self.page_rows + rows % self.page_rows
        return self.buffers, torch.from_numpy(at)

    def read(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows [lo, hi), without bringing pages in (a checkpoint reads every page once:
        it should not push the working set out)."""
        out = {n: torch.empty(max(hi - lo, 0), w, dtype=torch.float32) for n, w in self.layout}
        if hi <= lo:
            return out
        first, last = lo // self.page_rows, (hi - 1) // self.page_rows
        pages = np.arange(first, last + 1)
        on_disk = (self.frame_of[pages] < 0) & self.file.written_mask(pages)
        batch = 256  # pages read per block: a bounded buffer
        from_disk: dict[int, np.ndarray] = {}
        disk_pages = pages[on_disk]
        for k in range(0, disk_pages.size, batch):
            chunk = disk_pages[k:k + batch]
            from_disk.update(zip(chunk.tolist(), self.file.read_many(chunk), strict=True))
            for page in chunk.tolist():
                self._copy_page_out(page, from_disk.pop(page), out, lo, hi)
        for page in pages[~on_disk].tolist():
            self._copy_page_out(page, None, out, lo, hi)
        return out

    def _copy_page_out(self, page: int, payload: np.ndarray | None,
                       out: dict[str, torch.Tensor], lo: int, hi: int) -> None:
        p_lo = page * self.page_rows
        a, b = max(lo, p_lo), min(hi, p_lo + self.page_rows)
        frame = int(self.frame_of[page])
        at = 0
        floats = None if payload is None else payload.view(np.float32)
        for n, w in self.layout:
            dst = out[n][a - lo:b - lo]
            if frame >= 0:
                base = frame * self.page_rows
                dst.copy_(self.buffers[n][base + a - p_lo:base + b - p_lo])
            elif floats is not None:
                block = torch.from_numpy(floats[at:at + self.page_rows * w]).view(
                    self.page_rows, w)
                dst.copy_(block[a - p_lo:b - p_lo])
            else:
                dst.zero_()
            at += self.page_rows * w

    def write(self, lo: int, values: Mapping[str, torch.Tensor]) -> None:
        n = next(iter(values.values())).shape[0] if values else 0
        step = self.frames_quota * self.page_rows  # a quota's pages at a time
        for a in range(lo, lo + n, step):
            b = min(a + step, lo + n)
            cols, at = self.view(torch.arange(a, b, dtype=torch.int64))
            for name, v in values.items():
                cols[name].index_copy_(0, at, v[a - lo:b - lo].to(torch.float32))

    @property
    def memory_bytes(self) -> int:
        """The frames and the per-page bookkeeping (page map, crc, written flag)."""
        frames = self.nframes * self.page_rows * self.row_floats * 4
        return frames + self.pages * (8 + 4 + 1) + self.nframes * (8 + 2)

    @property
    def disk_bytes(self) -> int:
        return self.file.disk_bytes

    @property
    def max_disk_bytes(self) -> int:
        return self.pages * self.file.stride

    def counters(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "fills": self.fills,
                "spills": self.spills, "pages": self.pages, "frames": self.nframes}

    def close(self) -> None:
        self.closed = True
        self.file.close(remove=True)


def spilled_bytes(layout: Sequence[tuple[str, int]], rows: int, page_rows: int) -> int:
    """The most disk bytes a SpilledRows of these columns and rows may write."""
    pages = -(-rows // page_rows)
    return pages * page_stride(page_rows * sum(w for _, w in layout) * 4)


def frame_bytes(layout: Sequence[tuple[str, int]], page_rows: int) -> int:
    """Memory one page frame takes."""
    return page_rows * sum(w for _, w in layout) * 4
