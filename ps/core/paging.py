"""A dynamic table's Page calls on the server (transport-free: no grpc here).

A dynamic table (docs/dynamic_ids.md) is registered like a static table of its slots; its
partition table also keeps the rows paged out of those slots (hybridps/paged_rows.py)
with their optimizer state. A Page call (PageRequest in shard.proto):

1. takes the optimizer state of `out_slots` (zeroed there) and stores it with
   `out_rows` under `out_ids`;
2. moves the stored state of `in_ids` onto `in_slots` (both in one `PagedRows.swap`) and
   answers their rows, frequencies and last steps seen (`found` says which it held);
3. drops the ids unseen for `expire_steps` steps, and, when the table's paged bytes
   exceed its own quota (its partition's share of the budget, ps/core/limits.py), the ids
   seen longest ago: their ids are answered (`dropped`), so the rank's set of paged-out
   ids stays this one. Each decision depends only on this table's calls, never on other
   ranks' or runs' timing; finding the ids costs O(ids dropped) (hybridps/paged_order.py).

The rank evicts only slots with no update pending (the pin rule), so no push in flight
touches the rows a call moves; the partition lock orders calls with pushes.

Exactly once: `seq` numbers a (rank, table)'s calls from 1; the next one is applied, a
repeat of the last is answered from `last` (the rank retries a call whose answer it
did not get), anything else is refused. Every value is checked before anything
changes (InvalidArgument / RowOutOfRange naming it): a refused call changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from hybridps.errors import (
    Conflict,
    InvalidArgument,
    NonFiniteGradient,
    OutOfOrder,
    RowOutOfRange,
)
from hybridps.paged_rows import TOMBSTONE_BYTES, PagedOut, PagedRows
from hybridps.push_checks import mark_rows_


class SlotRange(Protocol):
    @property
    def row_start(self) -> int: ...

    @property
    def row_end(self) -> int: ...

    @property
    def dim(self) -> int: ...


class TableState(Protocol):
    """What a Page call needs of ps/core/partition.py's TableState."""

    @property
    def spec(self) -> SlotRange: ...

    @property
    def where(self) -> str: ...

    def state_view(self, local: torch.Tensor, write: bool = True
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor]:
        """(the optimizer state by name, its master rows, the positions of rows `local` in
        them): ps/core/partition.py's TableState.state_view."""
        ...

    @property
    def changed(self) -> torch.Tensor | None:
        """bool [rows]: the rows whose state changed since its last checkpoint (None:
        none saved yet)."""
        ...


@dataclass
class PageCall:
    """A decoded PageRequest (ps/edge/sync_codec.py)."""

    step: int
    seq: int
    expire_steps: int
    out: PagedOut          # state filled here
    out_slots: torch.Tensor
    in_ids: torch.Tensor
    in_slots: torch.Tensor
    peek: bool = False
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class PageResult:
    found: torch.Tensor    # int64 0/1 per in id
    got: PagedOut          # the found ids' entries, in order (state stays here)
    dropped: np.ndarray


def _distinct(t: torch.Tensor) -> bool:
    return int(torch.unique(t).numel()) == int(t.numel())


class PagedTable:
    """The paged-out rows of one dynamic partition table and its Page bookkeeping."""

    def __init__(self, dim: int, layout: Sequence[tuple[str, int]]) -> None:
        """`layout`: the optimizer's state of one row, (name, floats) each
        (OptimizerSpec.state_widths)."""
        self.dim = dim
        self.store = PagedRows(dim, layout, ordered=True)  # drops in O(ids dropped)
        self.seq = 0
        self.last: PageResult | None = None
        self.page_ins = 0
        self.page_outs = 0
        self.counters: dict[str, int] = {}  # the rank's own (DynamicCounters)

    def check(self, state: TableState, call: PageCall, what: str) -> None:
        """Every value of a call, before anything changes."""
        spec = state.spec
        n_out, n_in = int(call.out.ids.numel()), int(call.in_ids.numel())
        shapes = {"out_slots": (call.out_slots, (n_out,)), "out_rows": (call.out.rows,
                  (n_out, spec.dim)), "out_seen": (call.out.seen, (n_out,)),
                  "out_freq": (call.out.freq, (n_out,)), "in_slots": (call.in_slots, (n_in,))}
        for name, (t, shape) in shapes.items():
            if tuple(t.shape) != shape:
                raise InvalidArgument(f"{what}: {name} of shape {list(t.shape)} is not "
                                      f"{list(shape)}")
        for name, t in (("out_ids", call.out.ids), ("in_ids", call.in_ids),
                        ("out_slots", call.out_slots), ("in_slots", call.in_slots)):
            if t.dtype != torch.int64 or not _distinct(t):
                raise InvalidArgument(f"{what}: {name} must be distinct int64 values")
        for name, t in (("out_slots", call.out_slots), ("in_slots", call.in_slots)):
            bad = (t < spec.row_start) | (t >= spec.row_end)
            if bool(bad.any()):
                raise RowOutOfRange(f"{what}: {name} holds slot {int(t[bad][0])}, outside "
                                    f"the slots [{spec.row_start}, {spec.row_end}) of "
                                    f"{state.where}")
        if n_out and not bool(torch.isfinite(call.out.rows).all()):
            raise NonFiniteGradient(f"{what}: out_rows hold non-finite values")
        if n_out and bool(self.store.index.contains(call.out.ids.numpy()).any()):
            raise Conflict(f"{what}: an id of out_ids is paged out already")
        if call.expire_steps < 0:
            raise InvalidArgument(f"{what}: expire_steps={call.expire_steps} must be >= 0")

    def page(self, state: TableState, call: PageCall, what: str,
             over_budget: Callable[[], int]) -> tuple[PageResult, bool]:
        """Apply a call (module doc); (its result, whether it repeats the last one).
        `over_budget()`: the bytes this table's paged rows hold beyond its quota (<= 0:
        none)."""
        if call.peek:
            found, rows = self.store.peek(call.in_ids)
            n = int(found.sum())
            return PageResult(found.to(torch.int64), PagedOut(
                call.in_ids[found], rows, {}, torch.zeros(n, dtype=torch.int64),
                torch.zeros(n, dtype=torch.int64)), np.empty(0, dtype=np.int64)), False
        if call.seq == self.seq and self.last is not None:
            return self.last, True
        if call.seq != self.seq + 1:
            raise OutOfOrder(f"{what}: page call {call.seq} is not the next one "
                             f"({self.seq + 1}; last applied {self.seq})")
        self.check(state, call, what)
        start = state.spec.row_start
        n_out = int(call.out_slots.numel())
        # the slots' state where it is held (in memory, or paged in from a spill file)
        by_name, _, at = state.state_view(torch.cat([call.out_slots, call.in_slots]) - start)
        found, got = self.store.swap(call.out, at[:n_out], call.in_ids, at[n_out:], by_name)
        changed = state.changed
        if changed is not None:  # their state moved: the next checkpoint writes it
            mark_rows_(changed, call.out_slots - start)
            mark_rows_(changed, call.in_slots - start)
        dropped = [self.store.expire(call.step, call.expire_steps)]
        excess = over_budget()
        if excess > 0:  # the quota: the ids seen longest ago go, each leaving a tombstone
            freed = self.store.row_bytes - TOMBSTONE_BYTES
            dropped.append(self.store.drop_oldest(math.ceil(excess / freed), call.step))
        self.store.fit_pools()
        self.page_outs += int(call.out.ids.numel())
        self.page_ins += int(found.sum())
        result = PageResult(found.to(torch.int64), got, np.concatenate(dropped))
        self.seq, self.last = call.seq, result
        return result, False
