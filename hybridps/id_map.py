"""A hash map from raw int64 ids to int64 values, vectorized over batches (numpy).

Open addressing with linear probing over one int64 table [size, 2]: per position a key
and a value, the value also saying the position's state (>= 0: full, EMPTY, or GONE: a
removed entry's tombstone), so values are >= 0. The size is a power of two kept at most
half occupied (full + tombstones; a rebuild drops the tombstones). 16 bytes a position,
32 to 64 bytes an entry. A map sized once (`fix_capacity`, a store under a memory quota)
keeps its size: tombstones are cleared by rebuilding in place, so its bytes are known
before it fills; a probe reads one 16-byte entry (key and value side by side:
one cache miss, not one per array). Every operation works
on a whole batch of ids at once: each probe round is a handful of numpy operations over
the ids still probing, and at this load a round or two places or finds nearly all of
them. A key's home position is a salted splitmix64 of it (hybridps/dynamic.py), so any
int64, negative ones included, is a key.

Used by a dynamic table's owner (id -> slot, and the set of its paged-out ids) and by
the store of paged-out rows (id -> position in its pool), worker and server alike.

With the native extension (hybridps/native/dynamic.c) the probes run one id at a time in
C over the same arrays, by the same rules; these numpy batch probes are the reference
and the fallback (`IdMap(native=False)`). The two may put an id on different positions
(which of two ids reaching one free position takes it), never give it another value.
"""

from __future__ import annotations

import numpy as np

from hybridps.dynamic import salted
from hybridps.native import dynamic as _ext

EMPTY, GONE = -1, -2  # a position's value when it holds no entry
MAP_SALT = 0x6A09E667F3BCC909
MAX_LOAD = 0.5
# a map sized once for at most N entries (a store under a quota): N at most this load, so
# that at least an eighth of the positions take tombstones between two rebuilds in place
FIXED_LOAD = 0.375
MIN_SIZE = 16
WINDOW = 4  # positions probed per round
_STEPS = np.arange(WINDOW, dtype=np.int64)
_NATIVE = _ext is not None


def _size_for(entries: int) -> int:
    """The smallest power of two holding `entries` at a quarter load (a rebuild at half)."""
    size = MIN_SIZE
    while size * 0.25 < entries:
        size *= 2
    return size


def fixed_size_for(entries: int) -> int:
    """The power of two `fix_capacity(entries)` allocates."""
    size = MIN_SIZE
    while size * FIXED_LOAD < entries:
        size *= 2
    return size


def _check_values(values: np.ndarray) -> None:
    if values.size and int(values.min()) < 0:
        raise ValueError(f"IdMap: value {int(values.min())} is negative (values are >= 0)")


class IdMap:
    """int64 id -> int64 value (see the module doc)."""

    def __init__(self, expected: int = 0, *, native: bool | None = None) -> None:
        """`native`: the C probes (None: where the extension is built; True: required)."""
        if native and not _NATIVE:
            raise RuntimeError("IdMap(native=True): the native extension is not built")
        self.native = _NATIVE if native is None else native
        self.fixed = False  # sized once (fix_capacity): rebuilds keep the size
        self._alloc(_size_for(expected))

    def _alloc(self, size: int) -> None:
        self.size = size
        self.bits = size.bit_length() - 1
        self.table = np.zeros((size, 2), dtype=np.int64)
        self.table[:, 1] = EMPTY
        self.keys = self.table[:, 0]    # views of the table's columns
        self.values = self.table[:, 1]
        # _place's scratch, allocated by the numpy path only (the C probes need none)
        self._claim = np.zeros(0, dtype=np.int64)
        self.count = 0
        self.gone = 0

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def note_changes(self, added: int, gone: int) -> None:
        """A native step wrote the table in place: `added` entries more (net) and `gone`
        more tombstones."""
        self.count += added
        self.gone += gone

    @property
    def held_bytes(self) -> int:
        """Host bytes it holds: the table and the insert's scratch column."""
        return int(self.table.nbytes + self._claim.nbytes)

    def fix_capacity(self, entries: int) -> None:
        """Size the table once for at most `entries` entries (at FIXED_LOAD) and keep that
        size: a removal's tombstone is cleared by a rebuild in place, not by growing, so
        the map's bytes are known from `entries` alone. More entries than that still fit
        (the table then grows as an unfixed one would)."""
        self.fixed = True
        size = fixed_size_for(max(entries, self.count))
        if size != self.size:
            self._rebuild(self.count, size)

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (salted(ids.view(np.uint64), MAP_SALT) >> np.uint64(64 - self.bits)).astype(
            np.int64)

    def _native_find(self, ids: np.ndarray, positions: bool) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty(ids.size, dtype=np.int64)
        if ids.size == 0 or self.count == 0:
            out.fill(-1)
            return out
        assert _ext is not None
        _ext.idmap_find(self.table.ctypes.data, self.size, MAP_SALT, ids.ctypes.data,
                        ids.size, out.ctypes.data, positions)
        return out

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        """The position of each id, -1 where absent."""
        if self.native:
            return self._native_find(ids, True)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.full(ids.size, -1, dtype=np.int64)
        if ids.size == 0 or self.count == 0:
            return out
        mask = self.size - 1
        idx = np.arange(ids.size)
        pos = self._home(ids)
        while idx.size:  # WINDOW positions of every id still probing at once
            at = (pos[:, None] + _STEPS) & mask
            st = self.values[at]
            hit = (st >= 0) & (self.keys[at] == ids[idx][:, None])
            stop = hit | (st == EMPTY)  # found, or an empty position: absent
            first = stop.argmax(axis=1)
            rows = np.arange(idx.size)
            found = hit[rows, first]
            out[idx[found]] = at[rows, first][found]
            going = ~stop[rows, first]
            idx, pos = idx[going], (pos[going] + WINDOW) & mask
        return out

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The value of each id, -1 where absent (values are >= 0 by convention)."""
        if self.native:
            return self._native_find(ids, False)
        pos = self._locate(ids)
        out = np.full(pos.size, -1, dtype=np.int64)
        hit = pos >= 0
        out[hit] = self.values[pos[hit]]
        return out

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self._locate(ids) >= 0

    def insert(self, ids: np.ndarray, values: np.ndarray, *, check: bool = True) -> None:
        """Add distinct ids that are absent with their values (`check`: ValueError
        otherwise; a caller that knows it may skip the check)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        values = np.ascontiguousarray(values, dtype=np.int64)
        if ids.size == 0:
            return
        if check and (np.unique(ids).size != ids.size or bool(self.contains(ids).any())):
            raise ValueError("IdMap.insert: ids must be distinct and absent")
        _check_values(values)
        self.reserve(ids.size)
        self._place(ids, values)

    def reserve(self, more: int) -> None:
        """Room for `more` new entries at most half load (a rebuild drops tombstones)."""
        if self.count + self.gone + more > MAX_LOAD * self.size:
            fits = self.fixed and self.count + more <= MAX_LOAD * self.size
            self._rebuild(self.count + more, self.size if fits else None)

    def _place(self, ids: np.ndarray, values: np.ndarray) -> None:
        if self.native:
            assert _ext is not None
            self.gone -= _ext.idmap_place(self.table.ctypes.data, self.size, MAP_SALT,
                                          ids.ctypes.data, values.ctypes.data, ids.size)
            self.count += ids.size
            return
        mask = self.size - 1
        idx = np.arange(ids.size)
        pos = self._home(ids)
        if self._claim.size != self.size:
            self._claim = np.zeros(self.size, dtype=np.int64)
        claim = self._claim
        while idx.size:
            # each id's first free position within WINDOW of where it is (else move on)
            at = (pos[:, None] + _STEPS) & mask
            open_ = self.values[at] < 0
            first = open_.argmax(axis=1)
            rows = np.arange(idx.size)
            has = open_[rows, first]
            pos = np.where(has, at[rows, first], (pos + WINDOW) & mask)
            free = np.flatnonzero(has)
            # several ids may reach one free position in a round: one of them takes it
            # (which one changes only where an id sits in the table, never its value)
            claim[pos[free]] = idx[free]
            won = free[claim[pos[free]] == idx[free]]
            at = pos[won]
            self.gone -= int((self.values[at] == GONE).sum())
            self.keys[at] = ids[idx[won]]
            self.values[at] = values[idx[won]]
            self.count += won.size
            going = np.ones(idx.size, dtype=bool)
            going[won] = False
            # a loser probes on after the position it lost; the others moved on already
            nxt = np.where(has, pos + 1, pos) & mask
            idx, pos = idx[going], nxt[going]

    def set_values(self, ids: np.ndarray, values: np.ndarray) -> None:
        """New values for ids that are present (ValueError otherwise)."""
        pos = self._locate(ids)
        if bool((pos < 0).any()):
            raise ValueError("IdMap.set_values: an id is absent")
        _check_values(values)
        self.values[pos] = values

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove the ids that are present (distinct); returns which were."""
        if self.native:
            ids = np.ascontiguousarray(ids, dtype=np.int64)
            hit_u8 = np.zeros(ids.size, dtype=np.uint8)
            if ids.size and self.count:
                assert _ext is not None
                removed = _ext.idmap_remove(self.table.ctypes.data, self.size, MAP_SALT,
                                            ids.ctypes.data, ids.size, hit_u8.ctypes.data)
                self.count -= removed
                self.gone += removed
            return hit_u8.view(bool)
        pos = self._locate(ids)
        hit = pos >= 0
        at = pos[hit]
        self.values[at] = GONE
        self.count -= at.size
        self.gone += at.size
        return hit

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values) of every entry, in position order."""
        full = self.values >= 0
        return self.keys[full].copy(), self.values[full].copy()

    def _rebuild(self, entries: int, size: int | None = None) -> None:
        """Every entry placed anew in a table of `size` positions (None: the size for
        `entries` at a quarter load); the tombstones go."""
        size = _size_for(entries) if size is None else size
        if self.native:  # the same placements as _place(*self.items()), without the lists
            assert _ext is not None
            old, old_size = self.table, self.size
            self._alloc(size)
            self.count = _ext.idmap_rehash(old.ctypes.data, old_size, self.table.ctypes.data,
                                           self.size, MAP_SALT)
            return
        keys, values = self.items()
        self._alloc(size)
        self._place(keys, values)

    def clear(self) -> None:
        self._alloc(self.size if self.fixed else MIN_SIZE)
