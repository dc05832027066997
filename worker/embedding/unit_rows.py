"""The rows a ShardedEmbedding holds, per unit (worker/embedding/groups.py): gradients out, updates
in, whole tables for checkpoints and dumps.

The update path names units: `pop_grads` hands out one coalesced gradient per unit (unit
row ids), and `apply_update` / `set_rows` / `initial_row_blocks` take them back. A table
of its own is its own unit (its unit row ids are its global row ids). Everything per
table (`table_rows`, `device_bytes`, `gather_full`) reads a table's part of its unit's
block.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from worker.embedding.groups import Member, Unit
from worker.embedding.rows import TableConfig, coalesce_grads, initial_blocks
from worker.runtime.device_copy import sync_point, to_device


class UnitRows:
    """Mixin of worker/embedding/sharded.py's ShardedEmbedding: its rows, by unit."""

    tables: dict[str, TableConfig]
    units: dict[str, Unit]
    unit_of: dict[str, tuple[Unit, Member]]
    weights: nn.ParameterDict
    device: torch.device
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    table_index: dict[str, int]
    changed: dict[str, torch.Tensor]  # per unit, bool [rows]: updated since the last checkpoint
    _init_seed: int
    _init_std: float

    def pop_grads(self, scale: float = 1.0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Coalesced owned-row gradients, times `scale`, and clear them.

        Returns {unit: (ids_U unit row ids, unique and sorted; grads_UD)}; a unit whose
        rows got no gradient this step yields empty tensors.
        """
        with sync_point("pop_grads"):  # a push's row count depends on the ids
            return self._pop_grads(scale)

    def _pop_grads(self, scale: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        together: dict[tuple[int, torch.dtype], list[str]] = {}  # coalesced together
        for name, weight in self.weights.items():
            if weight.grad is None:
                out[name] = (torch.empty(0, dtype=torch.int64, device=self.device),
                             weight.new_empty((0, weight.shape[1]), dtype=torch.float32))
            elif not weight.grad.is_sparse:
                raise TypeError(f"table {name!r}: expected a sparse gradient, got a dense one")
            else:
                together.setdefault((weight.shape[1], weight.grad.dtype), []).append(name)
        for names in together.values():
            grads = []
            for name in names:
                grad = self.weights[name].grad
                assert grad is not None
                grads.append((grad._indices()[0], grad._values(),
                              self.weights[name].shape[0]))
            for name, (local_U, values_UD) in zip(names, coalesce_grads(grads), strict=True):
                out[name] = (local_U + self.units[name].start,
                             values_UD.to(torch.float32) * scale)  # bf16 rows: bf16 grads
        for weight in self.weights.values():
            weight.grad = None
        return {name: out[name] for name in self.weights}

    def _local(self, name: str, ids_U: torch.Tensor, what: str) -> torch.Tensor:
        """Unit row ids of unit `name` -> rows of its block; IndexError outside its range."""
        unit = self.units[name]
        with sync_point("update_ids"):  # host ids (the server's answers) read no device
            lo, hi = int(ids_U.min()), int(ids_U.max())
        if lo < unit.start or hi >= unit.end:
            raise IndexError(f"table {name!r}: {what} [{lo}, {hi}] outside the owned "
                             f"range [{unit.start}, {unit.end}) of rank {self.rank}")
        return to_device(ids_U, self.device).to(torch.int64) - unit.start

    @torch.no_grad()
    def apply_update(self, name: str, ids_U: torch.Tensor, delta_UD: torch.Tensor,
                     decay: float, measure: bool = False) -> torch.Tensor | None:
        """rows[ids] = rows[ids] * decay + delta, for unit row ids inside the owned range.
        `measure`: return what it changed, new rows - old rows (fp32, U x D; the weight
        prediction's effective update, hybridps/row_deltas.py), else None."""
        from hybridps.optim import apply_update_
        from hybridps.row_deltas import apply_update_measured_

        if ids_U.numel() == 0:  # decay only ever touches the updated rows
            return (torch.empty(0, self.weights[name].shape[1], device=self.device)
                    if measure else None)
        local_U = self._local(name, ids_U, "update for rows")
        self.changed[name].index_fill_(0, local_U, True)
        delta_UD = to_device(delta_UD, self.device)  # pinned, non-blocking (device_copy.py)
        if measure:
            return apply_update_measured_(self.weights[name].data, local_U, delta_UD, decay)
        apply_update_(self.weights[name].data, local_U, delta_UD, decay)
        return None

    @torch.no_grad()
    def set_rows(self, name: str, ids_U: torch.Tensor, rows_UD: torch.Tensor) -> None:
        """rows[ids] = rows_UD (a "rows" answer: the master rows, rounded to the row dtype)."""
        if ids_U.numel() == 0:
            return
        local_U = self._local(name, ids_U, "new rows")
        self.changed[name].index_fill_(0, local_U, True)
        weight = self.weights[name].data
        weight.index_copy_(0, local_U, to_device(rows_UD, weight.device).to(weight.dtype))

    def changed_rows(self, name: str) -> torch.Tensor:
        """The rows of table `name` an update changed since the last `clear_changed`
        (bool [rows it owns]; a view of its unit's flags): an incremental checkpoint's."""
        unit, member = self.unit_of[name]
        flags = self.changed[unit.name]
        return flags[member.offset:member.offset + member.rows] if unit.grouped else flags

    def clear_changed(self) -> None:
        """A checkpoint holds every row as it is now: the next one starts from here."""
        for flags in self.changed.values():
            flags.zero_()

    def table_rows(self, name: str) -> torch.Tensor:
        """The rows this rank owns of table `name`: its part of its unit's block (a view)."""
        unit, member = self.unit_of[name]
        data = self.weights[unit.name].data
        return data[member.offset:member.offset + member.rows] if unit.grouped else data

    def initial_row_blocks(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(unit row id, fp32 rows on the CPU): unit `name`'s owned rows as initialised, in
        order, checked against the rows held (worker/embedding/rows.py initial_blocks)."""
        unit = self.units[name]
        for m in unit.members:
            for lo, rows_RD in initial_blocks(
                    self.tables[m.name], m.start, m.end, self.table_rows(m.name),
                    seed=self._init_seed, table_index=self.table_index[m.name],
                    init_std=self._init_std, rank=self.rank):
                yield unit.start + m.offset + lo - m.start, rows_RD

    def groups(self) -> dict[str, list[str]]:
        """The table groups (--group-tables): group -> its tables, for --results."""
        return {name: [m.name for m in u.members] for name, u in self.units.items()
                if u.grouped}

    def device_bytes(self) -> dict[str, int]:
        """Bytes of the rows this rank holds on its device, per table."""
        return {name: self.table_rows(name).numel() * self.table_rows(name).element_size()
                for name in self.tables}

    def owned_tables(self) -> dict[str, torch.Tensor]:
        """Every table's owned rows, detached on the CPU, each a tensor of its own (a view of
        a group's block would be saved or sent with the whole block)."""
        out = {}
        for name in self.tables:
            rows_RD = self.table_rows(name).detach().cpu()
            out[name] = rows_RD.clone() if self.unit_of[name][0].grouped else rows_RD
        return out

    def gather_full(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """Full tables (CPU) on rank `dst`, None elsewhere. A collective; for tests/dumps."""
        shards = self.owned_tables()
        if self.world_size == 1:
            return shards
        gathered: list[dict[str, torch.Tensor]] | None = (
            [{} for _ in range(self.world_size)] if self.rank == dst else None)
        dist.gather_object(shards, gathered, dst=dst, group=self.group)
        if gathered is None:
            return None
        return {name: torch.cat([g[name] for g in gathered]) for name in self.tables}
