"""A dynamic table's training step at its owner in one native call, when its paged store
is in-process (the local optimizer's): hybridps/native/dynamic_step.c.

It does what `SlotTable.translate` (worker/embedding/dynamic/slots.py), the row moves of
`DynamicIds` (worker/embedding/dynamic/ids.py) and `PagedRows.swap` (hybridps/paged_rows.py) do
together, by the same rules: those stay the reference, and the path for a store behind a
server, for rows on a device and where the extension is not built. What stays here is
the bookkeeping the C side cannot do: growing the arrays beforehand, the admission
filter's decisions (its sketch and hashes), the counts, and the store's expiry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from hybridps.dynamic import init_salt, initial_scale
from hybridps.id_map import MAP_SALT
from hybridps.native import dynamic as _ext
from hybridps.paged_rows import PagedRows
from worker.embedding.dynamic.slots import SlotTable

# the counts serve_step returns, in its order (dynamic_step.c)
(HITS, REFUSED_FILTER, REFUSED_CAPACITY, EVICTIONS, PAGE_INS, ADMISSIONS, TOOK_FREE,
 SLOT_REUSED, STORE_REUSED) = range(9)
N_COUNTS = 9


def fusable(slots: SlotTable, store: PagedRows, weight: torch.Tensor,
            state: Mapping[str, torch.Tensor]) -> bool:
    """Whether the fused step can run: the extension built, the store's index the slot
    table's set of paged ids (SlotTable.share_paged), the rows and the optimizer state
    fp32 contiguous on the CPU with a row per slot, the store's layout."""
    if _ext is None or not slots.shares_paged_with(store):
        return False
    arrays = (weight, *state.values())
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               and t.dim() == 2 and t.shape[0] == slots.n for t in arrays):
        return False
    return [(n, int(t.shape[1])) for n, t in state.items()] == list(store.layout) and (
        int(weight.shape[1]) == store.dim)


def serve_fused(slots: SlotTable, store: PagedRows, weight: torch.Tensor,
                state: Mapping[str, torch.Tensor], ids_U: np.ndarray, step: int,
                applied_through: int, *, seed: int, table_index: int, init_std: float,
                expire_steps: int, expire_later: list[Callable[[], None]] | None = None
                ) -> np.ndarray:
    """Codes of the distinct ids `ids_U` (a global slot, -1: refused), every move done
    (module doc; the caller checked `fusable`). The store's expiry, due after a step that
    paged, runs here or, given `expire_later`, is appended to it (a prefetched step's runs
    at its lookup, so that nothing before that step sees it:
    worker/embedding/dynamic/prefetch.py)."""
    assert _ext is not None
    u = int(ids_U.size)
    ids_U = np.ascontiguousarray(ids_U, dtype=np.int64)
    refused = _refused(slots, ids_U, step)
    slots.map.reserve(u)
    store.reserve(u)
    codes = np.empty(u, dtype=np.int64)
    counts = np.empty(N_COUNTS, dtype=np.int64)
    lru = slots.lru if slots.spec.eviction == "lru" else None
    if lru is not None:
        lru.ready(slots.seen, u)
    pairs = np.array([(weight.data_ptr(), store.rows.data_ptr(), store.dim)] + [
        (t.data_ptr(), store.state[name].data_ptr(), t.shape[1]) for name, t in state.items()],
        dtype=np.int64)
    store_n_free, head, tail = _ext.serve_step(
        ids_U, refused, codes, slots.map.table, slots.slot_id, slots.pinned,
        slots.seen, slots.freq, slots.free, slots.free.size, store.index.table, store.free,
        store.n_free, store.ids, store.seen, store.freq, pairs, slots.start, step,
        applied_through, slots.spec.eviction == "lfu", MAP_SALT,
        init_salt(seed, table_index), initial_scale(init_std), counts,
        None if lru is None else lru.records, 0 if lru is None else lru.head,
        0 if lru is None else lru.tail)
    if lru is not None:
        lru.head, lru.tail = head, tail
    _book(slots, store, counts, store_n_free)
    stats = slots.stats
    stats.lookups += u
    stats.hits += int(counts[HITS])
    stats.refused_filter += int(counts[REFUSED_FILTER])
    stats.refused_capacity += int(counts[REFUSED_CAPACITY])
    stats.evictions += int(counts[EVICTIONS])
    stats.page_ins += int(counts[PAGE_INS])
    stats.admissions += int(counts[ADMISSIONS])
    if counts[EVICTIONS] or counts[PAGE_INS]:  # a page call: the store expires
        def expire() -> None:
            stats.dropped_paged += int(store.expire(step, expire_steps).size)

        if expire_later is None:
            expire()
        else:
            expire_later.append(expire)
    return codes


def _refused(slots: SlotTable, ids_U: np.ndarray, step: int) -> np.ndarray | None:
    """A byte per id, 1 where the filter refused a new id (None: `always` admits all).
    The filter sees the new ids (neither on a slot nor paged) in order, as in
    SlotTable.translate."""
    if slots.spec.admission == "always":
        return None
    new = np.flatnonzero(slots.map.find(ids_U) < 0)
    new = new[~slots.paged.contains(ids_U[new])]
    refused = np.zeros(ids_U.size, dtype=np.uint8)
    refused[new] = ~slots.admission.admit(ids_U[new], step)
    return refused


def _book(slots: SlotTable, store: PagedRows, counts: np.ndarray, store_n_free: int) -> None:
    """The entry counts of the maps and the free lists after what serve_step moved."""
    evicted = int(counts[EVICTIONS])
    slots.note_served(int(counts[TOOK_FREE]), evicted, int(counts[SLOT_REUSED]))
    store.note_served(evicted, int(counts[PAGE_INS]), int(counts[STORE_REUSED]), store_n_free)
