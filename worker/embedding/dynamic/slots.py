"""One owner's share of a dynamic table's slots: the id -> slot map, admission, eviction.

Pure bookkeeping (numpy, no device rows, no I/O): `translate` turns the distinct ids
this owner serves in a step into slots, deciding which unknown ids are admitted
(worker/embedding/dynamic/admission.py), which slots are evicted and which ids come back
from the paged store; the caller moves the rows (worker/embedding/dynamic/ids.py) through
the `Pager` it gives.

Slots: this owner holds the table's global slots [start, start + n) (row-wise, like a
static table's rows); here they are local, 0..n-1. Per slot: the id on it, the last step
it was looked up in (`seen`, -1 for a free slot) and how many steps it was (`freq`).

Rules (docs/dynamic_ids.md):
- order: the step's ids in the order given (first occurrence in the batch, requesters in
  rank order); new and returning ids take free slots lowest first, then evicted ones;
- eviction: only slots whose every update is in the rows: seen <= applied_through (the
  staleness window's newest applied step), and not looked up this step (the pin rule);
  lru: the smallest `seen`; lfu: the smallest `freq`, then the smallest `seen`; then
  the lowest slot;
- an id that finds neither a free nor an evictable slot is refused this step (capacity);
- a refused id (filter or capacity) gets slot -1: the caller reads zeros for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridps.dynamic import DynamicSpec
from hybridps.id_map import IdMap
from hybridps.native import dynamic as _ext
from hybridps.paged_rows import PagedRows
from worker.embedding.dynamic.admission import Admission

SLOTS_FORMAT = "hybridps-dynamic-slots-v1"
LFU_FREQ_CAP = (1 << 31) - 1
NATIVE = _ext is not None


@dataclass
class PageRequest:
    """What `translate` asks the pager to do, in local slots: evict `out_slots` (their ids
    `out_ids`, last seen `out_seen`, frequencies `out_freq`) into the paged store, then bring
    `in_ids` (paged out earlier) onto `in_slots`; `new_slots` get the new ids `new_ids`
    (fresh rows, zero optimizer state)."""

    out_slots: np.ndarray
    out_ids: np.ndarray
    out_seen: np.ndarray
    out_freq: np.ndarray
    in_slots: np.ndarray
    in_ids: np.ndarray
    new_slots: np.ndarray
    new_ids: np.ndarray
    placed_slots: np.ndarray  # the slot of every id placed, in the order of the ids

    @property
    def moves(self) -> bool:
        return bool(self.out_slots.size or self.in_slots.size)


@dataclass
class PageAnswer:
    """The pager's answer: which `in_ids` it held (`found`), their frequencies and last
    steps seen (for the found ones, in order), and the ids it dropped from its store
    meanwhile (expired, or over its memory budget)."""

    found: np.ndarray
    in_seen: np.ndarray
    in_freq: np.ndarray
    dropped: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


Pager = Callable[[PageRequest], PageAnswer]


@dataclass
class SlotStats:
    lookups: int = 0      # distinct ids looked up, summed over steps
    hits: int = 0         # of them on a slot already
    admissions: int = 0   # new ids given a slot
    refused_filter: int = 0
    refused_capacity: int = 0
    evictions: int = 0
    page_ins: int = 0
    dropped_paged: int = 0  # paged-out ids the store dropped (expiry, budget)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _k_smallest(keys: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k smallest keys, ties by lowest position, in (key, position)
    order; deterministic whatever numpy's partition does with ties."""
    if k >= keys.size:
        return np.lexsort((np.arange(keys.size), keys))
    kth = np.partition(keys, k - 1)[k - 1]
    below = np.flatnonzero(keys < kth)
    equal = np.flatnonzero(keys == kth)[:k - below.size]
    chosen = np.concatenate([below, equal])
    return chosen[np.lexsort((chosen, keys[chosen]))]


class LruQueue:
    """The fused step's LRU order (hybridps/native/dynamic_step.c): (seen, slot) records in
    that order, [head, tail) of `records`. Each step appends a record for every slot it
    looked up (sorted by slot); a record is stale once its slot is looked up again, so the
    live ones are the used slots, each once, and the victims come from the head instead
    of a scan of every slot. Derived from `seen` alone: rebuilt when not `valid` (the
    Python steps and a restore do not keep it)."""

    def __init__(self) -> None:
        self.records = np.empty((0, 2), dtype=np.int64)
        self.head = self.tail = 0
        self.valid = False

    def invalidate(self) -> None:
        """The order is rebuilt from `seen` at the next `ready`."""
        self.valid = False

    def ready(self, seen: np.ndarray, more: int) -> None:
        """Valid, with room for `more` records after the tail."""
        if not self.valid:
            used = np.flatnonzero(seen >= 0)
            order = np.lexsort((used, seen[used]))
            self._set(np.stack([seen[used][order], used[order]], axis=1), more)
            self.valid = True
        elif self.tail + more > self.records.shape[0]:
            if _ext is None:
                live = self.records[self.head:self.tail]
                self._set(live[seen[live[:, 1]] == live[:, 0]], more)
                return
            # in place: a new array (and its page faults) only when the live ones and
            # `more` fill over half of it, which keeps the compactions linear overall
            kept = _ext.lru_compact(self.records, self.head, self.tail, seen)
            self.head, self.tail = 0, kept
            if 2 * (kept + more) > self.records.shape[0]:
                self._set(self.records[:kept], more)  # the view keeps the old array

    def _set(self, live: np.ndarray, more: int) -> None:
        size = max(1024, 2 * (live.shape[0] + more))
        self.records = np.empty((size, 2), dtype=np.int64)
        self.records[:live.shape[0]] = live
        self.head, self.tail = 0, live.shape[0]


class SlotTable:
    """The slots [start, start + n) of one dynamic table on its owner (module doc)."""

    def __init__(self, name: str, spec: DynamicSpec, start: int, n: int, *, seed: int,
                 table_index: int, native: bool | None = None) -> None:
        """`native`: the victims chosen by hybridps/native/dynamic.c (None: where built),
        the same ones as the numpy reference here."""
        self.name, self.spec, self.start, self.n = name, spec, start, n
        self.native = NATIVE if native is None else native
        self.map = IdMap(n)
        self._paged = IdMap()  # ids in the paged store (value unused), when it is remote
        self._store: PagedRows | None = None  # the in-process store (share_paged)
        self.slot_id = np.zeros(n, dtype=np.int64)
        self.seen = np.full(n, -1, dtype=np.int64)
        self.freq = np.zeros(n, dtype=np.int64)
        self.free = np.arange(n, dtype=np.int64)  # sorted
        # the fused step's mark of its hits (no victim among them), all zero between calls:
        # kept, because a fresh n-byte array each step page-faults at a million slots
        self.pinned = np.zeros(n, dtype=np.uint8)
        self.admission = Admission(spec, seed, table_index)
        self.stats = SlotStats()
        self.lru = LruQueue()

    @property
    def paged(self) -> IdMap:
        """The ids in the paged store: the in-process store's own index when shared
        (`share_paged`), else this table's set (the store is the shard server's)."""
        return self._paged if self._store is None else self._store.index

    def shares_paged_with(self, store: PagedRows) -> bool:
        return self._store is store

    def share_paged(self, store: PagedRows) -> None:
        """The store is in this process: its index is the set of paged ids (no second
        map of the same ids); the store adds and removes them as it pages."""
        if len(self._paged) and set(self._paged.items()[0].tolist()) != set(
                store.index.items()[0].tolist()):
            raise ValueError(f"table {self.name!r}: its paged ids are not the store's")
        self._store = store
        self._paged = IdMap()

    @property
    def occupied(self) -> int:
        return self.n - int(self.free.size)

    def note_served(self, took_free: int, evicted: int, reused: int) -> None:
        """After the fused step (worker/embedding/dynamic/fused.py) wrote the map in place:
        `took_free` free slots taken, `evicted` slots given new ids (`reused` of the map's
        entries refilled)."""
        self.free = self.free[took_free:]
        self.map.note_changes(took_free, evicted - reused)

    @property
    def nbytes(self) -> int:
        """Host bytes of this bookkeeping (the map, the per-slot arrays, the sketch)."""
        return (self.map.nbytes + self._paged.nbytes + self.slot_id.nbytes + self.seen.nbytes
                + self.freq.nbytes + self.free.nbytes + self.admission.nbytes)

    # -- the step's translation -------------------------------------------------------
    def find(self, ids: np.ndarray) -> np.ndarray:
        """Local slot of each id, -1 where it is not on one (no state change)."""
        return self.map.find(ids)

    def is_paged(self, ids: np.ndarray) -> np.ndarray:
        return self.paged.contains(ids)

    def translate(self, ids: np.ndarray, step: int, applied_through: int,
                  pager: Pager) -> tuple[np.ndarray, PageRequest]:
        """Distinct ids in order (module doc) -> their GLOBAL slots, -1 where refused; and
        what moved (the caller gives `new_slots` their new ids' initial rows)."""
        stats = self.stats
        self.lru.invalidate()  # these steps do not keep the fused step's queue
        local = self.map.find(ids)
        hit = local >= 0
        stats.lookups += ids.size
        stats.hits += int(hit.sum())
        miss = np.flatnonzero(~hit)
        is_paged = np.zeros(ids.size, dtype=bool)
        is_paged[miss] = self.paged.contains(ids[miss])
        new = miss[~is_paged[miss]]
        admitted = self.admission.admit(ids[new], step)
        stats.refused_filter += int((~admitted).sum())
        want = np.sort(np.concatenate([miss[is_paged[miss]], new[admitted]]))  # batch order
        request, placed = self._make_room(ids, want, local, is_paged, applied_through)
        answer = pager(request) if request.moves else PageAnswer(
            np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self._commit(request, answer, step)
        slots = local.copy()
        slots[want[:placed]] = request.placed_slots
        got = slots >= 0
        self.seen[slots[got]] = step
        self.freq[local[hit]] = np.minimum(self.freq[local[hit]] + 1, LFU_FREQ_CAP)
        stats.refused_capacity += want.size - placed
        return np.where(got, slots + self.start, -1), request

    def _make_room(self, ids: np.ndarray, want: np.ndarray, local: np.ndarray,
                   is_paged: np.ndarray, applied_through: int) -> tuple[PageRequest, int]:
        """Slots for the wanted ids (positions into `ids`): free ones, then evicted ones."""
        take_free = min(want.size, self.free.size)
        slots = self.free[:take_free]
        victims = np.empty(0, dtype=np.int64)
        if want.size > take_free:
            victims = self._victims(want.size - take_free, local, applied_through)
            slots = np.concatenate([slots, victims])
        placed = int(slots.size)
        chosen = want[:placed]
        paged = is_paged[chosen]
        request = PageRequest(
            out_slots=victims, out_ids=self.slot_id[victims].copy(),
            out_seen=self.seen[victims].copy(), out_freq=self.freq[victims].copy(),
            in_slots=slots[paged], in_ids=ids[chosen][paged],
            new_slots=slots[~paged], new_ids=ids[chosen][~paged], placed_slots=slots)
        self.free = self.free[take_free:]
        return request, placed

    def _victims(self, count: int, local: np.ndarray, applied_through: int) -> np.ndarray:
        if self.native:
            assert _ext is not None
            pinned = np.ascontiguousarray(local[local >= 0])
            out = np.empty(count, dtype=np.int64)
            got = _ext.victims(self.seen.ctypes.data, self.freq.ctypes.data, self.n,
                               applied_through, pinned.ctypes.data, pinned.size,
                               self.spec.eviction == "lfu", count, out.ctypes.data)
            return out[:got]
        used = self.seen >= 0
        evictable = used & (self.seen <= applied_through)
        evictable[local[local >= 0]] = False  # looked up this step
        candidates = np.flatnonzero(evictable)
        if candidates.size == 0:
            return candidates
        seen = self.seen[candidates]
        if self.spec.eviction == "lru":
            keys = seen
        else:  # lfu: frequency, then last seen (steps < 2^32)
            keys = (np.minimum(self.freq[candidates], LFU_FREQ_CAP) << 32) | seen
        return candidates[_k_smallest(keys, count)]

    def _commit(self, req: PageRequest, answer: PageAnswer, step: int) -> None:
        stats = self.stats
        own = self._store is None  # else the store's index already changed with it
        if req.out_slots.size:
            self.map.remove(req.out_ids)
            if own:
                self._paged.insert(req.out_ids, np.zeros(req.out_ids.size, dtype=np.int64),
                                   check=False)  # they were on slots: not paged
            stats.evictions += req.out_slots.size
        if answer.dropped.size:
            if own:
                self._paged.remove(answer.dropped)
            stats.dropped_paged += answer.dropped.size
        if req.in_ids.size:
            if own:
                self._paged.remove(req.in_ids)
            found = answer.found
            stats.page_ins += int(found.sum())
            self.freq[req.in_slots[~found]] = 1  # dropped meanwhile: a fresh row
            self.freq[req.in_slots[found]] = np.minimum(answer.in_freq + 1, LFU_FREQ_CAP)
        self.freq[req.new_slots] = 1
        stats.admissions += req.new_slots.size
        slots = np.concatenate([req.in_slots, req.new_slots])
        ids = np.concatenate([req.in_ids, req.new_ids])
        self.map.insert(ids, slots, check=False)  # distinct misses of this step
        self.slot_id[slots] = ids
        self.seen[slots] = step

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per local slot: its id (valid where seen >= 0), last step seen, frequency; the
        paged ids' set and the admission state."""
        paged_ids, _ = self.paged.items()
        return {"format": SLOTS_FORMAT, "start": self.start, "n": self.n,
                "slot_id": self.slot_id.copy(), "seen": self.seen.copy(),
                "freq": self.freq.copy(), "paged_ids": np.sort(paged_ids),
                "admission": self.admission.state_dict()}

    def delta_state_dict(self, since: int) -> dict[str, Any]:
        """What changed since the checkpoint of step `since`: the slots looked up after it
        (local positions; a slot changes only when looked up: its id taken or evicted
        for a new one, its step and frequency), their id, step and frequency; how many
        slots are used (a check of the composition); the admission state, whole.
        hybridps/dynamic_files.py composes it onto its parent."""
        slot = np.flatnonzero(self.seen > since)
        return {"format": SLOTS_FORMAT, "start": self.start, "n": self.n, "since": since,
                "slot": slot, "slot_id": self.slot_id[slot], "seen": self.seen[slot],
                "freq": self.freq[slot], "used": int((self.seen >= 0).sum()),
                "admission": self.admission.state_dict()}

    def load(self, slot_id: np.ndarray, seen: np.ndarray, freq: np.ndarray,
             paged_ids: np.ndarray) -> None:
        """Set the slots (local arrays of length n; seen < 0: free) and the paged set."""
        if not slot_id.size == seen.size == freq.size == self.n:
            raise ValueError(f"table {self.name!r}: {slot_id.size} saved slots for {self.n}")
        used = seen >= 0
        self.slot_id = np.where(used, slot_id, 0).astype(np.int64)
        self.seen = np.where(used, seen, -1).astype(np.int64)
        self.freq = np.where(used, freq, 0).astype(np.int64)
        self.map = IdMap(self.n)
        self.map.insert(self.slot_id[used], np.flatnonzero(used))
        self.free = np.flatnonzero(~used).astype(np.int64)
        self.lru.invalidate()
        if self._store is not None:  # the store restores its own ids
            return
        self._paged = IdMap(paged_ids.size)
        self._paged.insert(paged_ids, np.zeros(paged_ids.size, dtype=np.int64))
