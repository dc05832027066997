"""The tables of a group (Register's TableSpec.members): checked here, used by checkpoints.

A rank may register its tables of one width as ONE table, a *group* (worker
--group-tables, worker/embedding/groups.py): one block of rows with each member table at a row
offset in it, so a push, its validation and its optimizer kernel run once for all of
them. The server applies pushes to the group like to any table; it knows the members
only to write a checkpoint per member table (rows, m, v, step of each, under the
member's own name and global row range: the files of separate tables) and to read one
back into the group's block. So checkpoints re-shard across world sizes and load
whether the run that wrote them grouped its tables or not.

Transport-free (no grpc): errors are hybridps.errors, mapped to status codes in one place
(ps/edge/status.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridps.errors import InvalidArgument
from hybridps.names import describe_problem


@dataclass(frozen=True)
class MemberSpec:
    """Rows [row_start, row_end) of member table `name` (num_rows rows), at `offset` rows
    into its group's block (the group's rows [group.row_start + offset, ...))."""

    name: str
    num_rows: int
    row_start: int
    row_end: int
    offset: int

    @property
    def rows_held(self) -> int:
        return self.row_end - self.row_start


class TableSpec(Protocol):
    """ps/core/partition.py's TableSpec, as this module reads it (no import cycle)."""

    @property
    def name(self) -> str: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def row_start(self) -> int: ...
    @property
    def row_end(self) -> int: ...
    @property
    def rows_held(self) -> int: ...
    @property
    def members(self) -> tuple[MemberSpec, ...]: ...


@dataclass(frozen=True)
class Piece:
    """What a checkpoint file holds: one table's rows [row_start, row_end), which are the
    partition table's local rows [lo, lo + row_end - row_start)."""

    name: str
    num_rows: int
    row_start: int
    row_end: int
    lo: int

    @property
    def hi(self) -> int:
        return self.lo + self.row_end - self.row_start


def check_members(spec: TableSpec, max_rows: int) -> None:
    """InvalidArgument naming the first bad value of `spec.members` (none: a plain table).

    Each member: a valid name (a checkpoint file name), 0 < num_rows <= max_rows,
    0 <= row_start <= row_end <= num_rows, and its offset where the previous member's
    rows end (the first at 0); the members' rows sum to the group's rows held and their
    num_rows to its num_rows."""
    members = spec.members
    if not members:
        return
    where = f"table {spec.name!r}"
    seen: set[str] = set()
    offset = 0
    for i, m in enumerate(members):
        at = f"{where}: member {i}"
        problem = describe_problem("member name", m.name)
        if problem is not None:
            raise InvalidArgument(f"{at}: {problem}")
        if m.name in seen or m.name == spec.name:
            raise InvalidArgument(f"{at}: name {m.name!r} appears twice in the group")
        seen.add(m.name)
        if not 0 < m.num_rows <= max_rows:
            raise InvalidArgument(f"{at} ({m.name!r}): num_rows={m.num_rows} must be in "
                                  f"[1, {max_rows}]")
        if not 0 <= m.row_start <= m.row_end <= m.num_rows:
            raise InvalidArgument(f"{at} ({m.name!r}): row range [{m.row_start}, "
                                  f"{m.row_end}) must satisfy 0 <= row_start <= row_end <= "
                                  f"num_rows={m.num_rows}")
        if m.offset != offset:
            raise InvalidArgument(f"{at} ({m.name!r}): offset={m.offset}, but the members "
                                  f"before it hold {offset} rows (offsets follow the rows)")
        offset += m.rows_held
    if offset != spec.rows_held:
        raise InvalidArgument(f"{where}: its members hold {offset} rows in all, the group "
                              f"{spec.rows_held} ([{spec.row_start}, {spec.row_end}))")
    total = sum(m.num_rows for m in members)
    if total != spec.num_rows:
        raise InvalidArgument(f"{where}: its members' num_rows sum to {total}, the group "
                              f"has num_rows={spec.num_rows}")


def pieces(spec: TableSpec) -> Iterator[Piece]:
    """The tables a partition table's checkpoint files are of: its members, or itself."""
    if not spec.members:
        yield Piece(spec.name, spec.num_rows, spec.row_start, spec.row_end, 0)
        return
    for m in spec.members:
        yield Piece(m.name, m.num_rows, m.row_start, m.row_end, m.offset)


def file_names(specs: Sequence[TableSpec]) -> list[str]:
    """Every name a partition's tables answer to: tables and group members."""
    names: list[str] = []
    for spec in specs:
        names.append(spec.name)
        names.extend(m.name for m in spec.members)
    return names
