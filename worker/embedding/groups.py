"""Table groups: a rank's tables of one width held, gathered, pushed and updated as ONE unit.

Every table stays sharded on its own (under its scheme, worker/embedding/sharding.py: rank
r owns rows [cuts[r], cuts[r+1]) of each, possibly none), but with --group-tables (the
default) the rows a rank owns of all its tables of one width are one local block (FBGEMM's
TBE layout: each table at a row offset in it). So a step does one gather, one sparse
gradient, one coalesce, one push, one server apply, one staleness-window update and one
weight prediction per group instead of per table (DLRM: 26 tables of one width, one group).

A *unit* is what the update path sees as a table: a group, or a table of its own. A group
is a virtual table of sum(R_t) rows whose id space is rank-major: rank r's rows are [S_r,
S_r + n_r) with S_r = sum_t cuts_t[r] (the sum of the members' starts) and n_r the rows it
owns of all members, in member order (S_r + n_r = S_{r+1}, as cuts_t[r+1] ends rank r's
range and starts rank r+1's, whatever each member's scheme); member t's global row x is
unit row S_r + offset_t + (x - start_t). So a unit has a contiguous row range per rank,
like a table: the sparse optimizer, the shard server (one partition table per group; it
knows the members to write and read checkpoints per table, ps/core/table_members.py) and
the staleness window run unchanged on units.

The math is exactly that of the separate tables: the sparse optimizers are elementwise
per row, and every table of a rank is pushed every step (an empty push too), so every
member's step count equals the group's. Checkpoints keep the per-table format (files
per table and rank, global row ids): units are split into their tables when saved and
joined when loaded, so they load at any world size, grouped or not.

The rule: the tables of one width form a group when there are at least two of them (row
dtype and optimizer are the same for all tables of a run); a table alone in its width is
a unit of its own, under its own name. A group is named `group-d<dim>` (no table can be:
table names are Python identifiers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.embedding.rows import TableConfig, table_row_range
from worker.embedding.sharding import Scheme


@dataclass(frozen=True)
class Member:
    """One table of a unit on this rank: its global rows [start, end), at `offset` rows
    into the unit's block."""

    name: str
    num_rows: int
    start: int
    end: int
    offset: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Unit:
    """A group of tables of one width, or one table (`grouped` False: the table's name)."""

    name: str
    dim: int
    members: tuple[Member, ...]
    num_rows: int  # the virtual table's rows: the members' rows summed
    start: int     # this rank's unit rows [start, end)
    end: int
    grouped: bool

    @property
    def rows(self) -> int:
        return self.end - self.start

    def to_unit_ids(self, member: Member, ids_U: torch.Tensor) -> torch.Tensor:
        """Global row ids of `member` (owned by this rank) -> unit row ids."""
        shift = self.start + member.offset - member.start
        return ids_U + shift if shift else ids_U

    def to_table_ids(self, member: Member, unit_ids_U: torch.Tensor) -> torch.Tensor:
        """Unit row ids of `member`'s rows -> its global row ids."""
        shift = member.start - self.start - member.offset
        return unit_ids_U + shift if shift else unit_ids_U

    def split(self, ids_U: torch.Tensor) -> list[tuple[Member, slice]]:
        """Sorted unit row ids -> per member (in order) the slice of them that are its rows."""
        if not self.grouped:
            return [(self.members[0], slice(0, ids_U.numel()))]
        bounds = torch.tensor([self.start + m.offset for m in self.members[1:]],
                              dtype=ids_U.dtype, device=ids_U.device)
        cuts = [0, *torch.searchsorted(ids_U, bounds).tolist(), ids_U.numel()]
        return [(m, slice(cuts[i], cuts[i + 1])) for i, m in enumerate(self.members)]

    def table_config(self) -> TableConfig:
        """The unit as one table (what the shard server registers)."""
        if not self.grouped:
            return TableConfig(self.name, self.num_rows, self.dim)
        return GroupTable(self.name, self.num_rows, self.dim)


@dataclass(frozen=True)
class GroupTable(TableConfig):
    """A group as a table: its name is no identifier (it cannot clash with a table's)."""

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.dim < 1:
            raise ValueError(f"group {self.name!r}: {self.num_rows} x {self.dim}")


def group_name(dim: int) -> str:
    return f"group-d{dim}"


def plan_units(tables: Sequence[TableConfig], rank: int, world_size: int, grouped: bool,
               schemes: dict[str, Scheme] | None = None) -> dict[str, Unit]:
    """The units of `tables` on rank `rank` (module doc), in the order of their first
    table; members in table order; each table placed by its scheme (absent: row-wise)."""
    schemes = schemes or {}
    together: dict[int | str, list[TableConfig]] = {}
    for t in tables:  # a dynamic table is a unit of its own (its slots are paged per table)
        together.setdefault(t.dim if grouped and t.dynamic is None else t.name,
                            []).append(t)
    units: dict[str, Unit] = {}
    for members in together.values():
        placed, offset, unit_start = [], 0, 0
        for t in members:
            start, end = table_row_range(t, rank, world_size, schemes.get(t.name))
            placed.append(Member(t.name, t.num_rows, start, end, offset))
            offset += end - start
            unit_start += start
        alone = len(members) == 1
        name = members[0].name if alone else group_name(members[0].dim)
        units[name] = Unit(name, members[0].dim, tuple(placed),
                           sum(t.num_rows for t in members), unit_start, unit_start + offset,
                           grouped=not alone)
    return units


def join_ids(unit: Unit, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Per member, sorted global row ids it owns -> the unit's sorted row ids, and for the
    members in order how many each gave (a member absent gives none)."""
    ids, sizes = [], []
    for m in unit.members:
        part = parts.get(m.name)
        n = 0 if part is None else int(part.numel())
        sizes.append(n)
        if n:
            assert part is not None
            ids.append(unit.to_unit_ids(m, part))
    if not ids:
        return torch.empty(0, dtype=torch.int64), sizes
    return (torch.cat(ids) if len(ids) > 1 else ids[0]), sizes
