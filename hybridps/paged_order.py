"""The order in which a paged store drops ids: seen longest ago first, ties the lowest id.

hybridps/paged_rows.py drops ids by expiry (last seen before a step) and by a memory
budget (the n seen longest ago). Sorting the whole store for each drop costs O(store) per
Page call: seconds at millions of paged rows. `SeenOrder` keeps the store's positions in
buckets by their last step seen, with a heap of the buckets' steps, so a drop touches only
the buckets it empties (and the one it takes from): a call costs O(rows in the call)
amortized, whatever the fill.

Entries are never removed from a bucket when their id leaves the store (a Page-in): each
pool position carries a generation, bumped whenever its content is written or released,
and a bucket entry counts only while its recorded generation is the position's. Stale
entries are discarded when their bucket is read, and the whole order is rebuilt from the
live positions when it holds more than twice as many entries as the store (O(store), at
most once per `len(store)` entries added: amortized O(1) per row).

The result is exactly the order of sorting the live entries by (seen, id): the drop rule
of the store, now independent of its size.
"""

from __future__ import annotations

import heapq

import numpy as np

# entries beyond 2 x the live ones (and this floor) rebuild the order
REBUILD_SLACK = 1024


class SeenOrder:
    """Pool positions by (last step seen, id) for drops (module doc). The caller owns the
    columns: `seen`, `ids` and `gen` (per pool position) are passed to each call."""

    def __init__(self) -> None:
        self._buckets: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._sorted: set[int] = set()  # buckets that are one part, id-sorted
        self._steps: list[int] = []  # heap of the buckets' keys
        self.entries = 0

    @property
    def nbytes(self) -> int:
        """Host bytes of the entries (a position and a generation, 16 bytes each)."""
        return 16 * self.entries

    def add(self, pos: np.ndarray, seen: np.ndarray, gen: np.ndarray) -> None:
        """Record positions just written with their steps seen and generations."""
        if pos.size == 0:
            return
        order = np.argsort(seen, kind="stable")
        pos, seen, gen = pos[order], seen[order], gen[order]
        starts = np.flatnonzero(np.r_[True, seen[1:] != seen[:-1]])
        ends = np.r_[starts[1:], seen.size]
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            key = int(seen[a])
            bucket = self._buckets.get(key)
            if bucket is None:
                self._buckets[key] = bucket = []
                heapq.heappush(self._steps, key)
            bucket.append((pos[a:b].copy(), gen[a:b].copy()))
            self._sorted.discard(key)
        self.entries += pos.size

    def _valid(self, key: int, ids: np.ndarray, gen: np.ndarray) -> tuple[np.ndarray,
                                                                           np.ndarray]:
        """Bucket `key`'s live entries sorted by id, kept as its one part."""
        parts = self._buckets[key]
        if key in self._sorted:  # id-sorted already; a take since may have left stale ones
            pos, g = parts[0]
            live = gen[pos] == g
            if not bool(live.all()):
                pos, g = pos[live], g[live]
                self.entries -= int(live.size - pos.size)
                self._buckets[key] = [(pos, g)]
            return pos, g
        pos = np.concatenate([p for p, _ in parts])
        g = np.concatenate([q for _, q in parts])
        live = gen[pos] == g
        pos, g = pos[live], g[live]
        order = np.argsort(ids[pos], kind="stable")
        pos, g = pos[order], g[order]
        self.entries -= sum(p.size for p, _ in parts) - pos.size
        self._buckets[key] = [(pos, g)]
        self._sorted.add(key)
        return pos, g

    def _pop(self, key: int) -> None:
        parts = self._buckets.pop(key)
        self.entries -= sum(p.size for p, _ in parts)
        self._sorted.discard(key)
        heapq.heappop(self._steps)

    def oldest(self, count: int, ids: np.ndarray, gen: np.ndarray) -> np.ndarray:
        """Remove and return the positions of the `count` live entries seen longest ago,
        in (seen, id) order (fewer when the store holds fewer)."""
        out: list[np.ndarray] = []
        need = count
        while need > 0 and self._steps:
            key = self._steps[0]
            pos, g = self._valid(key, ids, gen)
            if pos.size <= need:
                out.append(pos)
                need -= pos.size
                self._pop(key)
            else:
                out.append(pos[:need])
                self._buckets[key] = [(pos[need:], g[need:])]
                self.entries -= need
                need = 0
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def seen_before(self, step: int, ids: np.ndarray, gen: np.ndarray) -> np.ndarray:
        """Remove and return the positions of every live entry seen before `step`, by id."""
        out: list[np.ndarray] = []
        while self._steps and self._steps[0] < step:
            key = self._steps[0]
            out.append(self._valid(key, ids, gen)[0])
            self._pop(key)
        if not out:
            return np.empty(0, dtype=np.int64)
        pos = np.concatenate(out)
        return pos[np.argsort(ids[pos], kind="stable")]

    def needs_rebuild(self, live: int) -> bool:
        return self.entries > 2 * live + REBUILD_SLACK

    def rebuild(self, pos: np.ndarray, seen: np.ndarray, gen: np.ndarray) -> None:
        """Forget every entry and record the live positions `pos` anew."""
        self._buckets.clear()
        self._sorted.clear()
        self._steps.clear()
        self.entries = 0
        self.add(pos, seen[pos], gen[pos])
