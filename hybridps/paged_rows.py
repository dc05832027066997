"""The rows a dynamic table paged out of its slots, and their optimizer state (no grpc).

One store per (table, owning rank): per id its row (fp32 [dim]), the optimizer state of
that row by name (e.g. Adam's "m" and "v", [dim] each; an optimizer without per-row state
has none), its frequency and the last step it was seen. Columnar: pools grown by doubling
(in place: hybridps/growable.py), a free list, and an IdMap id -> pool position, so a
batch goes in or out with a few tensor ops. `take` removes what it returns: an id is
either on a slot or here.

Expiry: `expire(step, T)` drops the ids last seen before step - T; `drop_oldest(n)` drops
the n seen longest ago (a memory budget; ties: the lowest id). An `ordered` store (the
shard server's) finds them in O(ids dropped), not O(store), through
hybridps/paged_order.py; it must then change only through its methods. The worker's
fused step (worker/embedding/dynamic/fused.py) writes a store's columns in C, so its
stores are not ordered and scan for their drops. Every drop leaves a
tombstone (id, step) for the delta export (worker/export.py --delta-since); tombstones
are kept for the run (16 bytes each).

Under a quota (`set_quota`, the server's per-table share) the bytes the drops are decided
on (`nbytes`) are the ones it holds: the id map is sized once from the quota (the rows it
allows plus one call's, at the map's fixed load) and counted at its capacity, tombstones
included; the pools grow to those rows at most and shrink back as the drop tombstones
take more of the quota (`fit_pools`). So `held_bytes` stays within the quota plus
`held_overhead_bytes` (one call's positions twice and the drop order's slack), and every
decision still depends only on the table's own calls.

With `spill_payload` (the shard server's disk tier, ps/core/spill.py) the entries' rows and
state are held by pool position in a hybridps/spilled_rows.py holder, paged to disk, instead
of the pools; every decision is the same, only where the values live changes.

Both sides hold one: the shard server (ps/core/partition.py, the node's store) and the
worker's --local-optimizer (in-process). `state_dict`/`load_state_dict` are the
checkpoint's `paged/<table>.r<rank>.pt` payload (hybridps/dynamic_files.py's `save_paged`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridps.growable import GrowableColumn
from hybridps.id_map import FIXED_LOAD, IdMap, fixed_size_for
from hybridps.paged_order import REBUILD_SLACK, SeenOrder
from hybridps.spilled_rows import HeldRows, RowColumns

PAGED_FORMAT = "hybridps-paged-rows-v1"
# per id besides its row and state: pool id, last seen, frequency, generation and free
# stack (int64 each) and its drop-order entries (16 bytes each, at most 2 per id between
# rebuilds: hybridps/paged_order.py). Its IdMap entry is counted with the map, at the
# map's real size (`nbytes`).
ENTRY_OVERHEAD_BYTES = 5 * 8 + 2 * 16
TOMBSTONE_BYTES = 16  # a dropped id and its step, kept for the run
IDMAP_POSITION_BYTES = 16


@dataclass
class PagedOut:
    """Rows leaving slots (or found in the store): ids_N, rows_ND (fp32), the state by
    name ([N, width] fp32 each), last step seen and frequency (int64 [N])."""

    ids: torch.Tensor
    rows: torch.Tensor
    state: dict[str, torch.Tensor]
    seen: torch.Tensor
    freq: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.ids.numel())


class PagedRows:
    """Paged-out rows of one table and rank (module doc)."""

    def __init__(self, dim: int, layout: Sequence[tuple[str, int]], *,
                 ordered: bool = False) -> None:
        self.dim = dim
        self.ordered = ordered
        # positions the pools grow to at most beyond what a put needs (0: doubling
        # without bound): a store under a quota then holds its quota's rows plus one
        # call's, not up to twice them (the server sets it from the table's quota)
        self.max_entries = 0
        self.quota = 0  # set_quota: the bytes `nbytes` may reach (0: no limit)
        self.call_rows = 0
        self.layout = tuple((str(n), int(w)) for n, w in layout)
        # the entries' rows and state by pool position, when they spill to disk
        # (`spill_payload`); None: in the pools, `rows` and `state`
        self.spilled: RowColumns | None = None
        self.index = IdMap()
        self._alloc(0)
        self.tomb_ids: list[np.ndarray] = []
        self.tomb_steps: list[np.ndarray] = []
        self._tomb_count = 0
        self.expired = 0   # ids dropped by expiry, and by the memory budget
        self.dropped = 0
        self.last_expiry = -1
        # the last checkpoint's mark (`checkpoint_state`): its step, its ids (sorted) and
        # tombstone count; a delta holds what differs from them. None: the next is whole
        self._mark: tuple[int, np.ndarray, int] | None = None

    def _alloc(self, capacity: int) -> None:
        """Fresh, empty pools of `capacity` positions, all free."""
        payload = {} if self.spilled is not None else {
            "rows": GrowableColumn(np.float32, self.dim),
            **{f"state:{n}": GrowableColumn(np.float32, w) for n, w in self.layout}}
        self._columns = {**payload,
                         "ids": GrowableColumn(np.int64), "seen": GrowableColumn(np.int64),
                         "freq": GrowableColumn(np.int64), "free": GrowableColumn(np.int64),
                         "gen": GrowableColumn(np.int64)}
        self.order = SeenOrder()
        self._resize(capacity)
        self.gen[:] = 0
        # free positions, a stack: the lowest on top (the end), n_free of them
        self.free[:] = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.n_free = capacity

    def _resize(self, capacity: int) -> None:
        """Every pool at `capacity` positions, the first ones kept (in place while the
        columns' reservations last: hybridps/growable.py). A position's content is
        unwritten until a put writes it."""
        self.capacity = capacity
        if self.spilled is not None and capacity > self.spilled.rows:
            raise ValueError(f"paged rows: {capacity} positions exceed the "
                             f"{self.spilled.rows} of the spilled rows")
        col = {name: c.resize(capacity) for name, c in self._columns.items()}
        if self.spilled is None:
            self.rows = torch.from_numpy(col["rows"])
            self.state = {n: torch.from_numpy(col[f"state:{n}"]) for n, _ in self.layout}
        self.ids, self.seen, self.freq, self.free = col["ids"], col["seen"], col["freq"], col[
            "free"]
        # bumped whenever a position is written or released: the drop order's entries of
        # earlier contents no longer count (hybridps/paged_order.py)
        self.gen = col["gen"]

    def __len__(self) -> int:
        return len(self.index)

    def spill_payload(self, payload: RowColumns) -> None:
        """Hold the entries' rows and state in `payload` (by pool position: "rows" and
        the layout's names; hybridps/spilled_rows.py's SpilledRows pages them to disk)
        instead of the pools; at most `payload.rows` positions. Every decision stays the
        same: only where the values are held changes."""
        if len(self):
            raise ValueError("paged rows: the payload spills only while the store is empty")
        self.spilled = payload
        self.max_entries = min(self.max_entries or payload.rows, payload.rows)
        self._alloc(0)

    def _payload(self) -> RowColumns:
        if self.spilled is not None:
            return self.spilled
        return HeldRows({"rows": self.rows, **self.state})

    def close(self) -> None:
        """Release what the store holds outside memory (a spilled payload's file)."""
        if self.spilled is not None:
            self.spilled.close()

    @property
    def payload_row_bytes(self) -> int:
        """Bytes of one entry's row and state."""
        return 4 * (self.dim + sum(w for _, w in self.layout))

    @property
    def memory_bytes(self) -> int:
        """Host memory of the store's content: `nbytes`, with a spilled payload's frames
        in place of its entries' rows and state."""
        if self.spilled is None:
            return self.nbytes
        return (self.nbytes - len(self) * self.payload_row_bytes
                + self.spilled.memory_bytes)

    def note_served(self, evicted: int, taken: int, reused: int, n_free: int) -> None:
        """After a native step wrote the pools and the index in place: `evicted` ids put,
        `taken` paged back in (`reused` of their index entries refilled), `n_free` free."""
        self.index.note_changes(evicted - taken, taken - reused)
        self.n_free = n_free

    @property
    def row_bytes(self) -> int:
        """Host bytes one paged-out id costs."""
        return 4 * (self.dim + sum(w for _, w in self.layout)) + ENTRY_OVERHEAD_BYTES

    @property
    def nbytes(self) -> int:
        """Host bytes the drops are decided on: its entries (pools and drop order), its id
        map at its real size (capacity, with its tombstones) and the drop tombstones."""
        return (len(self) * self.row_bytes + self.index.held_bytes
                + TOMBSTONE_BYTES * self.tomb_count)

    def set_quota(self, quota: int, call_rows: int) -> int:
        """Bound the store by `quota` bytes (0: none), one call putting at most
        `call_rows` ids before its drops: the id map is sized once, for the most rows
        the quota allows plus one call's, and the pools grow to those rows at most.
        Returns the rows the quota allows (before any tombstone)."""
        self.quota, self.call_rows = quota, call_rows
        if quota <= 0:
            self.max_entries = 0
            return 0
        rows = quota_rows(quota, self.row_bytes, call_rows)
        self.max_entries = rows + call_rows
        self.index.fix_capacity(self.max_entries)
        return rows

    @property
    def held_bytes(self) -> int:
        """Host bytes the store holds for its content: every pool at its capacity, the
        id map's table, the drop order's entries and the tombstones."""
        pools = sum(c.row_bytes for c in self._columns.values()) * self.capacity
        frames = self.spilled.memory_bytes if self.spilled is not None else 0
        return (pools + frames + self.index.held_bytes + self.order.nbytes
                + TOMBSTONE_BYTES * self.tomb_count)

    @property
    def pool_row_bytes(self) -> int:
        """Bytes one pool position holds (every column)."""
        return sum(c.row_bytes for c in self._columns.values())

    @property
    def held_overhead_bytes(self) -> int:
        """What `held_bytes` may exceed `nbytes` by under a quota: the pools' positions
        for two calls' rows (one call's puts, and the slack before they shrink) and the
        drop order's entries before a rebuild."""
        return 2 * self.call_rows * self.pool_row_bytes + 16 * REBUILD_SLACK

    def fit_pools(self) -> None:
        """Under a quota, after a call's drops: shrink the pools to the rows the quota
        still allows (tombstones take more of it as drops go on) plus one call's, once
        they hold a call's rows more than that, so the bytes held stay within the quota
        plus `held_overhead_bytes`. O(store), at most once per call_rows x row bytes /
        16 drops: O(1) a drop, amortized."""
        if not self.quota:
            return
        room = self.quota - self.index.held_bytes - TOMBSTONE_BYTES * self.tomb_count
        target = max(room // self.row_bytes, len(self)) + self.call_rows
        if self.capacity > target + self.call_rows:
            self._shrink(target)

    def _shrink(self, capacity: int) -> None:
        """Move the entries beyond `capacity` onto free positions below it and cut every
        pool to `capacity` positions, their memory released."""
        live = self._live_positions()
        high = live[live >= capacity]
        if high.size:
            used = np.zeros(capacity, dtype=bool)
            used[live[live < capacity]] = True
            low = np.flatnonzero(~used)[:high.size]
            if self.spilled is not None:  # the rows and state, where they are held
                cols, at = self.spilled.view(torch.from_numpy(high), write=False)
                moved = {n: t.index_select(0, at) for n, t in cols.items()}
                cols, at = self.spilled.view(torch.from_numpy(low))
                for n, values in moved.items():
                    cols[n].index_copy_(0, at, values)
            for name, c in self._columns.items():
                if name not in ("free", "gen"):
                    col = c.resize(self.capacity)
                    col[low] = col[high]
            self.index.set_values(self.ids[low], low)
        for c in self._columns.values():
            c.shrink(capacity)
        self._resize(capacity)
        self.max_entries = min(self.max_entries, capacity) if self.max_entries else capacity
        self.gen[:] += 1  # every order entry is stale: the order is rebuilt below
        live = self._live_positions()
        used = np.zeros(capacity, dtype=bool)
        used[live] = True
        self.n_free = capacity - live.size
        self.free[:self.n_free] = np.flatnonzero(~used)[::-1]
        if self.ordered:
            self.order.rebuild(live, self.seen, self.gen)

    @property
    def tomb_count(self) -> int:
        return self._tomb_count

    def reserve(self, more: int) -> None:
        """Room for `more` new entries: free positions and the index's load."""
        self._grow(more)
        self.index.reserve(more)

    def _grow(self, need: int) -> None:
        if self.n_free >= need:
            return
        old = self.capacity
        new = max(16, old * 2)
        while new - len(self.index) < need:
            new *= 2
        if self.max_entries:
            new = min(new, max(self.max_entries, len(self.index) + need))
        free = self.free[:self.n_free].copy()
        self._resize(new)
        self.gen[old:new] = 0
        # the stack keeps room for every position (a release pushes up to `new` of them)
        self.free[:new - old] = np.arange(new - 1, old - 1, -1, dtype=np.int64)
        self.free[new - old:new - old + free.size] = free
        self.n_free = new - old + free.size

    def put(self, out: PagedOut) -> None:
        """Store rows that left their slots (ids distinct and absent here)."""
        n = out.count
        if n == 0:
            return
        self._check(out)
        self._grow(n)
        pos = self.free[self.n_free - n:self.n_free][::-1].copy()
        self.n_free -= n
        self.index.insert(out.ids.numpy(), pos, check=False)  # the caller checked
        cols, at = self._payload().view(torch.from_numpy(pos))
        cols["rows"].index_copy_(0, at, out.rows.to(torch.float32))
        for name, _ in self.layout:
            cols[name].index_copy_(0, at, out.state[name].to(torch.float32))
        self.ids[pos] = out.ids.numpy()
        self.seen[pos] = out.seen.numpy()
        self.freq[pos] = out.freq.numpy()
        self.gen[pos] += 1
        if self.ordered:
            self.order.add(pos, self.seen[pos], self.gen[pos])
            self._maybe_rebuild()

    def _maybe_rebuild(self) -> None:
        if self.ordered and self.order.needs_rebuild(len(self)):
            self.order.rebuild(self._live_positions(), self.seen, self.gen)

    def _check(self, out: PagedOut) -> None:
        n = out.count
        if tuple(out.rows.shape) != (n, self.dim):
            raise ValueError(f"paged rows: rows of shape {list(out.rows.shape)} are not "
                             f"[{n}, {self.dim}]")
        for name, width in self.layout:
            got = out.state.get(name)
            if got is None or tuple(got.shape) != (n, width):
                raise ValueError(f"paged rows: state {name!r} is "
                                 f"{None if got is None else list(got.shape)}, not "
                                 f"[{n}, {width}]")

    def _gather(self, pos: np.ndarray) -> PagedOut:
        cols, at = self._payload().view(torch.from_numpy(pos), write=False)
        return PagedOut(torch.from_numpy(self.ids[pos].copy()),
                        cols["rows"].index_select(0, at),
                        {n: cols[n].index_select(0, at) for n, _ in self.layout},
                        torch.from_numpy(self.seen[pos].copy()),
                        torch.from_numpy(self.freq[pos].copy()))

    def take(self, ids: torch.Tensor) -> tuple[torch.Tensor, PagedOut]:
        """(found_N, the found ids' entries in the order of `ids`), removed from the store."""
        pos = self.index.find(ids.numpy())
        found = pos >= 0
        got = self._gather(pos[found])
        self._release(ids.numpy()[found], pos[found])
        self._maybe_rebuild()
        return torch.from_numpy(found), got

    def swap(self, out: PagedOut, out_rows_R: torch.Tensor, in_ids: torch.Tensor,
             in_rows_R: torch.Tensor, state: Mapping[str, torch.Tensor]
             ) -> tuple[torch.Tensor, PagedOut]:
        """A page call's moves. `out` (its `state` ignored) enters the store with the
        optimizer state of rows `out_rows_R` of `state` (by name, this store's layout;
        zeroed there: the rows leave their slots); then the stored entries of `in_ids`
        leave it, their state onto rows `in_rows_R` of `state` (one per in id, used where
        found). Returns (found_N, the found entries in order, without their state: it is
        on its rows). The indices are checked before anything moves (ValueError)."""
        for what, rows_R, n in (("out", out_rows_R, out.count), ("in", in_rows_R,
                                                                 int(in_ids.numel()))):
            if rows_R.numel() != n:
                raise ValueError(f"paged rows: {rows_R.numel()} {what} rows for {n} ids")
            if n == 0:
                continue
            lo, hi = int(rows_R.min()), int(rows_R.max())
            for name, t in state.items():
                if lo < 0 or hi >= t.shape[0]:
                    raise ValueError(f"paged rows: an {what} row is outside the "
                                     f"{t.shape[0]} rows of state {name!r}")
        taken = {}
        for name, t in state.items():
            at = out_rows_R.to(t.device)
            taken[name] = t.index_select(0, at).cpu()
            t.index_fill_(0, at, 0.0)
        self.put(PagedOut(out.ids, out.rows, taken, out.seen, out.freq))
        found, got = self.take(in_ids)
        back_F = in_rows_R[found]
        for name, t in state.items():
            t.index_copy_(0, back_F.to(t.device), got.state[name].to(t.device, t.dtype))
        got.state = {}
        return found, got

    def peek(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(found_N, rows_FD) without removing anything (evaluation reads)."""
        pos = self.index.find(ids.numpy())
        found = pos >= 0
        cols, at = self._payload().view(torch.from_numpy(pos[found]), write=False)
        return torch.from_numpy(found), cols["rows"].index_select(0, at)

    def _release(self, ids: np.ndarray, pos: np.ndarray) -> None:
        """Free pool positions (their content is overwritten by the next put there)."""
        self.index.remove(ids)
        self.gen[pos] += 1
        back = np.sort(pos)[::-1]
        self.free[self.n_free:self.n_free + back.size] = back
        self.n_free += back.size

    def _drop(self, pos: np.ndarray, step: int) -> np.ndarray:
        ids = self.ids[pos].copy()
        self._release(ids, pos)
        if ids.size:
            self.tomb_ids.append(ids)
            self.tomb_steps.append(np.full(ids.size, step, dtype=np.int64))
            self._tomb_count += ids.size
        return ids

    def _live_positions(self) -> np.ndarray:
        _, pos = self.index.items()
        return np.sort(pos)

    def expire(self, step: int, expire_steps: int) -> np.ndarray:
        """Drop the ids last seen before `step - expire_steps` (0: never); returns them, by id.
        Scans the store at most every max(1, T // 8) steps: an id goes between T and
        9T/8 steps after it was last seen."""
        if expire_steps <= 0 or step < self.last_expiry + max(1, expire_steps // 8):
            return np.empty(0, dtype=np.int64)
        self.last_expiry = step
        if self.ordered:
            old = self.order.seen_before(step - expire_steps, self.ids, self.gen)  # by id
        else:
            pos = self._live_positions()
            old = pos[self.seen[pos] < step - expire_steps]
            old = old[np.argsort(self.ids[old], kind="stable")]  # by id, not pool position
        self.expired += old.size
        return self._drop(old, step)

    def drop_oldest(self, count: int, step: int) -> np.ndarray:
        """Drop the `count` ids seen longest ago (ties: the lowest id); returns them."""
        if count <= 0 or len(self) == 0:
            return np.empty(0, dtype=np.int64)
        if self.ordered:
            pos = self.order.oldest(count, self.ids, self.gen)
        else:
            live = self._live_positions()
            pos = live[np.lexsort((self.ids[live], self.seen[live]))[:count]]
        self.dropped += pos.size
        return self._drop(pos, step)

    def tombstones(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, steps) of every drop so far, in drop order."""
        if not self.tomb_ids:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(self.tomb_ids), np.concatenate(self.tomb_steps)

    # -- checkpoints -----------------------------------------------------------------
    def entries(self) -> PagedOut:
        """Every stored id, in id order (a deterministic file)."""
        pos = self._live_positions()
        pos = pos[np.argsort(self.ids[pos], kind="stable")]
        return self._gather(pos)

    def state_dict(self) -> dict[str, Any]:
        tomb_ids, tomb_steps = self.tombstones()
        e = self.entries()
        return {"format": PAGED_FORMAT, "dim": self.dim, "layout": list(self.layout),
                "ids": e.ids, "rows": e.rows, "state": e.state, "seen": e.seen,
                "freq": e.freq, "tomb_ids": torch.from_numpy(tomb_ids),
                "tomb_steps": torch.from_numpy(tomb_steps), "counters": self._counters()}

    def _counters(self) -> dict[str, int]:
        return {"expired": self.expired, "dropped": self.dropped,
                "last_expiry": self.last_expiry}

    def checkpoint_state(self, step: int, since: int | None = None) -> dict[str, Any]:
        """The checkpoint of step `step`'s payload, and the mark the next delta starts
        from. `since` S: a delta against the checkpoint of step S (`delta_state`) when
        the mark is that checkpoint's; whole otherwise (a whole payload is a chain's
        base wherever it is)."""
        ids, _ = self.index.items()
        mark = self._mark
        out = (self.state_dict() if since is None or mark is None or mark[0] != since
               else self.delta_state(since, mark[1], mark[2]))
        self._mark = (step, np.sort(ids), self.tomb_count)
        return out

    def delta_state(self, since: int, saved_ids: np.ndarray, saved_tombs: int
                    ) -> dict[str, Any]:
        """What changed since the checkpoint of step `since`, which held ids `saved_ids`
        (sorted) and `saved_tombs` tombstones: the entries put since (by id), the ids that
        left (taken onto a slot or dropped), the new tombstones. An entry does not change
        while it is stored: one put since is new to the saved ids, or was taken and
        evicted again, so last seen after `since` (a take puts its id on a slot, looked
        up at that step). `compose_paged` reads it on top of its parent."""
        ids, pos = self.index.items()
        order = np.argsort(ids, kind="stable")
        ids, pos = ids[order], pos[order]
        new = ~np.isin(ids, saved_ids, assume_unique=True) | (self.seen[pos] > since)
        e = self._gather(pos[new])
        left = saved_ids[~np.isin(saved_ids, ids, assume_unique=True)]
        tomb_ids, tomb_steps = self.tombstones()
        return {"format": PAGED_FORMAT, "dim": self.dim, "layout": list(self.layout),
                "since": since, "ids": e.ids, "rows": e.rows, "state": e.state,
                "seen": e.seen, "freq": e.freq, "deleted": torch.from_numpy(left),
                "tomb_ids": torch.from_numpy(tomb_ids[saved_tombs:].copy()),
                "tomb_steps": torch.from_numpy(tomb_steps[saved_tombs:].copy()),
                "tomb_base": saved_tombs, "count": int(ids.size),
                "counters": self._counters()}

    def load(self, entries: PagedOut, tombstones: tuple[np.ndarray, np.ndarray] = (
            np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)),
             counters: Mapping[str, int] | None = None) -> None:
        """Replace the store's content (a restore)."""
        fixed = self.index.fixed
        self.index = IdMap(entries.count)
        if fixed:
            self.index.fix_capacity(max(self.max_entries, entries.count))
        self._alloc(0)
        self.put(entries)
        self.tomb_ids, self.tomb_steps = ([tombstones[0]], [tombstones[1]]) if tombstones[
            0].size else ([], [])
        self._tomb_count = int(tombstones[0].size)
        counters = counters or {}
        self.expired = int(counters.get("expired", 0))
        self.dropped = int(counters.get("dropped", 0))
        self.last_expiry = int(counters.get("last_expiry", -1))
        self._mark = None


def quota_rows(quota: int, row_bytes: int, call_rows: int) -> int:
    """The most rows R a store of `row_bytes` per row keeps under `quota` bytes with its
    id map sized for R + `call_rows` entries (hybridps/id_map.py's fix_capacity)."""
    best = 0
    size = fixed_size_for(0)
    while IDMAP_POSITION_BYTES * size <= quota:
        by_bytes = (quota - IDMAP_POSITION_BYTES * size) // row_bytes
        by_map = int(size * FIXED_LOAD) - call_rows
        best = max(best, min(by_bytes, by_map))
        if by_bytes <= by_map:
            break
        size *= 2
    return max(best, 0)


def paged_from_dict(payload: Mapping[str, Any], what: str) -> tuple[PagedOut, tuple[
        np.ndarray, np.ndarray], dict[str, int]]:
    """A `state_dict` read back: (entries, tombstones, counters); ValueError naming `what`
    when it is not one."""
    if payload.get("format") != PAGED_FORMAT:
        raise ValueError(f"{what} is not a {PAGED_FORMAT} file")
    if "since" in payload:
        raise ValueError(f"{what} is a delta since step {payload['since']}: it is read "
                         "composed with its chain (compose_paged)")
    try:
        return _payload_parts(payload)
    except (KeyError, AttributeError, TypeError) as exc:
        raise ValueError(f"{what} is malformed ({type(exc).__name__}: {exc})") from None


def _payload_parts(payload: Mapping[str, Any]
                   ) -> tuple[PagedOut, tuple[np.ndarray, np.ndarray], dict[str, int]]:
    """(entries, tombstones, counters) of a whole file's or a delta's payload."""
    entries = PagedOut(payload["ids"].to(torch.int64), payload["rows"].float(),
                       {n: t.float() for n, t in payload["state"].items()},
                       payload["seen"].to(torch.int64), payload["freq"].to(torch.int64))
    tombs = (payload["tomb_ids"].numpy().astype(np.int64),
             payload["tomb_steps"].numpy().astype(np.int64))
    counters = {k: int(v) for k, v in dict(payload.get("counters", {})).items()}
    return entries, tombs, counters


def empty_paged(dim: int, layout: Sequence[tuple[str, int]]) -> PagedOut:
    return PagedOut(torch.empty(0, dtype=torch.int64), torch.empty(0, dim),
                    {n: torch.empty(0, w) for n, w in layout},
                    torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


def concat_paged(parts: Sequence[PagedOut], dim: int,
                 layout: Sequence[tuple[str, int]]) -> PagedOut:
    parts = [p for p in parts if p.count]
    if not parts:
        return empty_paged(dim, layout)
    return PagedOut(torch.cat([p.ids for p in parts]), torch.cat([p.rows for p in parts]),
                    {n: torch.cat([p.state[n] for p in parts]) for n, _ in layout},
                    torch.cat([p.seen for p in parts]), torch.cat([p.freq for p in parts]))


def compose_paged(payloads: Sequence[tuple[Mapping[str, Any], str]]
                  ) -> tuple[PagedOut, tuple[np.ndarray, np.ndarray], dict[str, int]]:
    """`paged_from_dict` of a chain's payloads of one store, oldest first (`what` names
    each's file): the newest whole one, then each later delta (`PagedRows.delta_state`):
    its deleted ids out, its entries in (replacing an id's older entry), its tombstones
    appended. The result is the whole payload of the newest's step: entries by id,
    tombstones in drop order, the newest's counters. ValueError naming the file whose
    delta does not fit what it composes onto."""
    bases = [i for i, (p, _) in enumerate(payloads) if "since" not in p]
    if not bases:
        raise ValueError(f"{payloads[0][1] if payloads else 'no file'}: no whole paged-rows "
                         "file under its deltas")
    entries, tombs, counters = paged_from_dict(*payloads[bases[-1]])
    tomb_parts = [tombs[0]], [tombs[1]]
    n_tombs = int(tombs[0].size)
    for payload, what in payloads[bases[-1] + 1:]:
        if payload.get("format") != PAGED_FORMAT:
            raise ValueError(f"{what} is not a {PAGED_FORMAT} file")
        try:
            delta, new_tombs, counters = _delta_parts(payload)
            base, count = int(payload["tomb_base"]), int(payload["count"])
        except (KeyError, AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"{what} is malformed ({type(exc).__name__}: {exc})") from None
        if base != n_tombs:
            raise ValueError(f"{what}: a delta on {base} tombstones; its chain has "
                             f"{n_tombs}")
        gone = torch.isin(entries.ids, torch.cat([delta.deleted, delta.entries.ids]))
        keep = (~gone).nonzero().squeeze(1)
        entries = concat_paged([_select(entries, keep), delta.entries], entries.rows.shape[1],
                               [(n, int(t.shape[1])) for n, t in entries.state.items()])
        order = torch.argsort(entries.ids, stable=True)
        entries = _select(entries, order)
        if entries.count != count or bool((entries.ids[1:] == entries.ids[:-1]).any()):
            raise ValueError(f"{what}: composed with its chain it holds {entries.count} "
                             f"paged ids, the store held {count}")
        tomb_parts[0].append(new_tombs[0])
        tomb_parts[1].append(new_tombs[1])
        n_tombs += int(new_tombs[0].size)
    return entries, (np.concatenate(tomb_parts[0]), np.concatenate(tomb_parts[1])), counters


@dataclass
class _Delta:
    entries: PagedOut
    deleted: torch.Tensor


def _delta_parts(payload: Mapping[str, Any]
                 ) -> tuple[_Delta, tuple[np.ndarray, np.ndarray], dict[str, int]]:
    entries, tombs, counters = _payload_parts(payload)
    return _Delta(entries, payload["deleted"].to(torch.int64)), tombs, counters


def _select(e: PagedOut, at: torch.Tensor) -> PagedOut:
    return PagedOut(e.ids.index_select(0, at), e.rows.index_select(0, at),
                    {n: t.index_select(0, at) for n, t in e.state.items()},
                    e.seen.index_select(0, at), e.freq.index_select(0, at))
