"""A hash map from raw int64 ids to int64 values, vectorized over batches (numpy).

Open addressing with linear probing: `keys`, `values` and a `state` byte per position
(empty, full, or a removed entry's tombstone), the size a power of two kept at most
70% occupied (full + tombstones; a rebuild drops the tombstones). Every operation works
on a whole batch of ids at once: each probe round is a handful of numpy operations over
the ids still probing, and at this load a round or two places or finds nearly all of
them. A key's home position is a salted splitmix64 of it (hybridps/dynamic.py), so any
int64, negative ones included, is a key.

Used by a dynamic table's owner (id -> slot, and the set of its paged-out ids) and by
the store of paged-out rows (id -> position in its pool), worker and server alike.
"""

from __future__ import annotations

import numpy as np

from hybridps.dynamic import salted

EMPTY, FULL, GONE = 0, 1, 2
MAP_SALT = 0x6A09E667F3BCC909
MAX_LOAD = 0.7
MIN_SIZE = 16


def _size_for(entries: int) -> int:
    """The smallest power of two holding `entries` at half load."""
    size = MIN_SIZE
    while size * 0.5 < entries:
        size *= 2
    return size


class IdMap:
    """int64 id -> int64 value (see the module doc)."""

    def __init__(self, expected: int = 0) -> None:
        self._alloc(_size_for(expected))

    def _alloc(self, size: int) -> None:
        self.size = size
        self.bits = size.bit_length() - 1
        self.keys = np.zeros(size, dtype=np.int64)
        self.values = np.zeros(size, dtype=np.int64)
        self.state = np.zeros(size, dtype=np.uint8)
        self.count = 0
        self.gone = 0

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.state.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (salted(ids.view(np.uint64), MAP_SALT) >> np.uint64(64 - self.bits)).astype(
            np.int64)

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        """The position of each id, -1 where absent."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.full(ids.size, -1, dtype=np.int64)
        if ids.size == 0 or self.count == 0:
            return out
        mask = self.size - 1
        idx = np.arange(ids.size)
        pos = self._home(ids)
        while idx.size:
            st = self.state[pos]
            hit = (st == FULL) & (self.keys[pos] == ids[idx])
            out[idx[hit]] = pos[hit]
            going = ~hit & (st != EMPTY)
            idx, pos = idx[going], (pos[going] + 1) & mask
        return out

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The value of each id, -1 where absent (values are >= 0 by convention)."""
        pos = self._locate(ids)
        out = np.full(pos.size, -1, dtype=np.int64)
        hit = pos >= 0
        out[hit] = self.values[pos[hit]]
        return out

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self._locate(ids) >= 0

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Add distinct ids that are absent (ValueError otherwise) with their values."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        values = np.ascontiguousarray(values, dtype=np.int64)
        if ids.size == 0:
            return
        if np.unique(ids).size != ids.size or bool(self.contains(ids).any()):
            raise ValueError("IdMap.insert: ids must be distinct and absent")
        if self.count + self.gone + ids.size > MAX_LOAD * self.size:
            self._rebuild(self.count + ids.size)
        self._place(ids, values)

    def _place(self, ids: np.ndarray, values: np.ndarray) -> None:
        mask = self.size - 1
        idx = np.arange(ids.size)
        pos = self._home(ids)
        while idx.size:
            free = np.flatnonzero(self.state[pos] != FULL)
            # several ids may reach one free position in a round: the first of them takes it
            _, first = np.unique(pos[free], return_index=True)
            won = free[first]
            at = pos[won]
            self.gone -= int((self.state[at] == GONE).sum())
            self.state[at] = FULL
            self.keys[at] = ids[idx[won]]
            self.values[at] = values[idx[won]]
            self.count += won.size
            going = np.ones(idx.size, dtype=bool)
            going[won] = False
            idx, pos = idx[going], (pos[going] + 1) & mask

    def set_values(self, ids: np.ndarray, values: np.ndarray) -> None:
        """New values for ids that are present (ValueError otherwise)."""
        pos = self._locate(ids)
        if bool((pos < 0).any()):
            raise ValueError("IdMap.set_values: an id is absent")
        self.values[pos] = values

    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Remove the ids that are present; returns which were."""
        pos = self._locate(ids)
        hit = pos >= 0
        at = np.unique(pos[hit])
        self.state[at] = GONE
        self.count -= at.size
        self.gone += at.size
        return hit

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, values) of every entry, in position order."""
        full = self.state == FULL
        return self.keys[full].copy(), self.values[full].copy()

    def _rebuild(self, entries: int) -> None:
        keys, values = self.items()
        self._alloc(_size_for(entries))
        self._place(keys, values)

    def clear(self) -> None:
        self._alloc(MIN_SIZE)
