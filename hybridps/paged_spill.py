"""A dynamic table's paged-out rows bounded by memory and disk (no grpc).

A paged store (hybridps/paged_rows.py) under a quota drops the ids seen longest ago once
its bytes pass the quota (`drop_over_quota`). With a disk tier its entries' rows and state
can be held in a spilled payload instead (`PagedRows.spill_payload`, a
hybridps/spilled_rows.py `SpilledRows` by pool position): each entry then keeps only its
bookkeeping in memory, so the same memory holds more rows and the quota the drops are
decided on grows by them (`paged_quota`). The drops are the same decisions, taken later.

Both holders of a store use these: the shard server's disk tier (ps/core/spill.py) and the
worker's --local-optimizer under --local-memory-budget-mb (worker/updates/local_spill.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hybridps.id_map import fixed_size_for
from hybridps.paged_rows import IDMAP_POSITION_BYTES, TOMBSTONE_BYTES, PagedRows, quota_rows
from hybridps.spilled_rows import (
    frame_bytes,
    page_rows_for,
    spilled_bookkeeping_bytes,
    spilled_rows_for_disk,
)

# a spilled payload's pages in memory: this share of the memory the store may hold
PAYLOAD_FRAME_SHARE = 8


def payload_columns(dim: int, layout: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The columns of a store's spilled payload: its rows, then its state's."""
    return [("rows", dim), *layout]


def payload_page_rows(dim: int, layout: Sequence[tuple[str, int]], page_bytes: int) -> int:
    columns = payload_columns(dim, layout)
    return page_rows_for(sum(w for _, w in columns) * 4, page_bytes)


def paged_quota(dim: int, layout: Sequence[tuple[str, int]], memory_bytes: int,
                disk_bytes: int, call_rows: int, row_bytes: int, page_bytes: int
                ) -> tuple[int, int]:
    """(the quota a dynamic table's paged rows are dropped against, the frames of its
    spilled payload; 0: it does not spill) when `memory_bytes` of memory and `disk_bytes`
    of spill file hold them, pages of about `page_bytes`. Spilled, an entry keeps its
    bookkeeping in memory (ids, steps, the id map: `row_bytes` less its row and state)
    and its row and state on disk, 1/PAYLOAD_FRAME_SHARE of the memory as page frames:
    the most rows whose bookkeeping and frames fit the memory and whose pages fit the
    disk. The quota is in the store's own units (`row_bytes` a row and its id map), so its
    drops are decided as without the tier, only later."""
    columns = payload_columns(dim, layout)
    page_rows = payload_page_rows(dim, layout, page_bytes)
    page = frame_bytes(columns, page_rows)
    frames = max(1, memory_bytes // PAYLOAD_FRAME_SHARE // max(page, 1))
    payload = 4 * sum(w for _, w in columns)
    entry = row_bytes - payload
    disk_rows = spilled_rows_for_disk(columns, page_rows, disk_bytes) - call_rows

    def memory(rows: int) -> int:
        return (IDMAP_POSITION_BYTES * fixed_size_for(rows + call_rows) + rows * entry
                + frames * page + spilled_bookkeeping_bytes(columns, rows + call_rows,
                                                            page_rows))

    lo, hi = 0, max(disk_rows, 0)
    while lo < hi:  # the most rows whose memory fits (memory() grows with rows)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if memory(mid) <= memory_bytes else (lo, mid - 1)
    if lo <= quota_rows(memory_bytes, row_bytes, call_rows):
        return memory_bytes, 0  # spilling holds no more rows than memory alone
    return lo * row_bytes + IDMAP_POSITION_BYTES * fixed_size_for(lo + call_rows), frames


def drop_over_quota(store: PagedRows, quota: int, step: int) -> np.ndarray:
    """After a page call: the ids seen longest ago dropped while the store's bytes exceed
    `quota` (0: no bound), each leaving a tombstone, and the pools fitted to what the
    quota still allows; the ids dropped."""
    excess = store.nbytes - quota if quota else 0
    dropped = np.empty(0, dtype=np.int64)
    if excess > 0:
        freed = store.row_bytes - TOMBSTONE_BYTES
        dropped = store.drop_oldest(math.ceil(excess / freed), step)
    store.fit_pools()
    return dropped
