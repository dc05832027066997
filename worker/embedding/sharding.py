"""Sharding schemes: which rows of a table each rank owns, who owns an id, and the cost the
planner reads. One small interface; each scheme is registered once in SCHEMES.

A scheme of a table of N rows over W ranks gives W+1 cut points: rank r owns rows
[cuts[r], cuts[r+1]) (possibly empty). The owner of an id is the last r with cuts[r] <= id
(torch.bucketize, right=True, minus 1), its local row id - cuts[owner].

- RowWise: cuts r*N//W, the contiguous equal split (worker/embedding/rows.py row_range).
- TableWise(owner): the whole table on one rank; the others own an empty range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

SHARDING_CHOICES = ("row_wise", "table_wise", "auto")


class Scheme:
    """Where one table's rows live over `world_size` ranks."""

    name: ClassVar[str] = "?"

    def cuts(self, num_rows: int, world_size: int) -> list[int]:
        """W+1 non-decreasing cut points from 0 to num_rows."""
        raise NotImplementedError

    def ranks(self, num_rows: int, world_size: int) -> list[int]:
        """The ranks owning at least one row."""
        c = self.cuts(num_rows, world_size)
        return [r for r in range(world_size) if c[r + 1] > c[r]]

    def row_range(self, num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
        c = self.cuts(num_rows, world_size)
        return c[rank], c[rank + 1]

    def owner_of(self, ids_N: torch.Tensor, num_rows: int, world_size: int) -> torch.Tensor:
        """owner_N: the rank owning each id (int64, same shape)."""
        boundaries = torch.tensor(self.cuts(num_rows, world_size)[1:-1], dtype=ids_N.dtype,
                                  device=ids_N.device)
        return torch.bucketize(ids_N, boundaries, right=True).to(torch.int64)

    def local_of(self, ids_N: torch.Tensor, owner_N: torch.Tensor, num_rows: int,
                 world_size: int) -> torch.Tensor:
        """local_N: each id's row within its owner's range."""
        starts = torch.tensor(self.cuts(num_rows, world_size)[:-1], dtype=ids_N.dtype,
                              device=ids_N.device)
        return ids_N - starts[owner_N]


@dataclass(frozen=True)
class RowWise(Scheme):
    name: ClassVar[str] = "row_wise"

    def cuts(self, num_rows: int, world_size: int) -> list[int]:
        return [r * num_rows // world_size for r in range(world_size + 1)]


@dataclass(frozen=True)
class TableWise(Scheme):
    name: ClassVar[str] = "table_wise"
    owner: int = 0

    def cuts(self, num_rows: int, world_size: int) -> list[int]:
        if not 0 <= self.owner < world_size:
            raise ValueError(f"table-wise owner {self.owner} outside world_size={world_size}")
        return [0] * (self.owner + 1) + [num_rows] * (world_size - self.owner)


SCHEMES: dict[str, type[Scheme]] = {s.name: s for s in (RowWise, TableWise)}


def check_sharding(value: str, what: str = "sharding") -> str:
    """value, or a ValueError naming it."""
    if value not in SHARDING_CHOICES:
        raise ValueError(f"{what}={value!r} is not one of {', '.join(SHARDING_CHOICES)}")
    return value


@dataclass(frozen=True)
class TableCost:
    """What the planner reads of one table."""

    name: str
    num_rows: int
    dim: int
    lookups: int = 1  # ids per sample
    sharding: str = "auto"  # row_wise | table_wise | auto


def place_tables(tables: Sequence[TableCost], world_size: int, state_floats: int = 1
                 ) -> dict[str, Scheme]:
    """A scheme per table. A table asking for `auto` goes whole onto one rank when it is at
    most half a rank's fair share both in bytes (rows * dim * 4 * (1 + state_floats)) and in
    lookups; those go largest first onto the least-loaded rank (ties: lowest rank); the rest
    are row-wise. Deterministic: depends only on the tables, in their order."""
    for t in tables:
        check_sharding(t.sharding, f"table {t.name!r}: sharding")
    nbytes = {t.name: t.num_rows * t.dim * 4 * (1 + state_floats) for t in tables}
    fair_bytes = sum(nbytes.values()) / world_size
    fair_lookups = sum(t.lookups for t in tables) / world_size
    whole = [t for t in tables if t.sharding == "table_wise" or (
        t.sharding == "auto" and world_size > 1 and nbytes[t.name] <= fair_bytes / 2
        and t.lookups <= fair_lookups / 2)]
    whole_names = {t.name for t in whole}
    # row-wise tables load every rank evenly: they do not change which rank is least loaded
    load = [0.0] * world_size
    placed: dict[str, Scheme] = {}
    order = sorted(whole, key=lambda t: (-nbytes[t.name] / max(fair_bytes, 1)
                                         - t.lookups / max(fair_lookups, 1), t.name))
    for t in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += nbytes[t.name] / max(fair_bytes, 1) + t.lookups / max(fair_lookups, 1)
        placed[t.name] = TableWise(rank)
    return {t.name: placed[t.name] if t.name in whole_names else RowWise() for t in tables}
