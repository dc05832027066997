"""Row-wise sharded embedding tables.

Sharding: table t has R rows of width D. Rank r of W owns the contiguous rows
    [r * R // W, (r + 1) * R // W)
(so the last rank ends exactly at R) as an `nn.Parameter` of shape
[owned rows, D] on its device. The rows are NOT under FSDP and NOT in the
dense optimizer: their gradients are popped after backward (`pop_grads`) and
handed to the sparse optimizer (shard server or --local-optimizer), whose
updates come back through `apply_update`.

A lookup of ids_N on one rank goes through visible stages:
  1. route: dedupe (unique_U + inverse_N) and bucketize unique ids by owner
     with searchsorted on the range starts; unique ids are sorted, so they are
     already grouped by owner in rank order;
  2. all_to_all the per-owner counts, then the ids themselves;
  3. the owner gathers the requested rows from its shard with
     F.embedding(local_ids_M, weight, sparse=True);
  4. all_to_all the rows back (AllToAllRows), then expand with the inverse
     (plain lookup) or pool with it (embedding_bag, sum/mean).
Backward runs the same path in reverse: AllToAllRows.backward sends row
gradients to the owners, and autograd gives each owner a sparse gradient on
its shard; `pop_grads` coalesces it (unique ids + summed rows).

World size 1: no collective at all (and no process group is needed).

Row init is deterministic and world-size independent: the global table is
generated in fixed chunks of INIT_CHUNK_ROWS rows, chunk c of table t seeded
by (seed, t, c), N(0, 1) * init_std like nn.Embedding; a rank generates only
the chunks overlapping its range, so every world size sees the same table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.comm import all_to_all_rows, exchange

INIT_CHUNK_ROWS = 65536
POOLING_MODES = ("sum", "mean")


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_rows` x `dim`, looked up by global row id."""

    name: str
    num_rows: int
    dim: int

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"table name {self.name!r} must be a Python identifier")
        if self.num_rows < 1:
            raise ValueError(f"table {self.name!r}: num_rows={self.num_rows} must be >= 1")
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim={self.dim} must be >= 1")


def row_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the rows rank `rank` owns: [r*R//W, (r+1)*R//W)."""
    return rank * num_rows // world_size, (rank + 1) * num_rows // world_size


def range_starts(num_rows: int, world_size: int, device: torch.device | None = None
                 ) -> torch.Tensor:
    """starts_W: first row of every rank's range (int64)."""
    return torch.tensor([row_range(num_rows, r, world_size)[0] for r in range(world_size)],
                        dtype=torch.int64, device=device)


def owner_of(ids_N: torch.Tensor, num_rows: int, world_size: int) -> torch.Tensor:
    """owner_N: the rank owning each id (searchsorted on the range starts)."""
    starts_W = range_starts(num_rows, world_size, ids_N.device)
    return torch.searchsorted(starts_W, ids_N, right=True) - 1


@dataclass
class Routing:
    """Where the ids of one lookup go.

    unique_U: sorted distinct ids; inverse_N: ids_N == unique_U[inverse_N];
    send_counts: how many of unique_U each rank owns (unique_U is grouped by
    owner in rank order, so chunk r of unique_U goes to rank r).
    """

    unique_U: torch.Tensor
    inverse_N: torch.Tensor
    send_counts: list[int]


def route(ids_N: torch.Tensor, num_rows: int, world_size: int, table: str = "?") -> Routing:
    """Stage 1: dedupe + bucketize by owner. ids_N: int64 global row ids, any shape."""
    flat_N = ids_N.reshape(-1).to(torch.int64)
    unique_U, inverse_N = torch.unique(flat_N, sorted=True, return_inverse=True)
    if unique_U.numel():
        lo, hi = int(unique_U[0]), int(unique_U[-1])
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"table {table!r}: row id {bad} outside [0, {num_rows})")
    owner_U = owner_of(unique_U, num_rows, world_size)
    send_counts = torch.bincount(owner_U, minlength=world_size).tolist()
    return Routing(unique_U, inverse_N, send_counts)


def _chunk_seed(seed: int, table_index: int, chunk: int) -> int:
    state = np.random.SeedSequence([seed, table_index, chunk]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def init_rows(num_rows: int, dim: int, start: int, end: int, *, seed: int, table_index: int,
              init_std: float) -> torch.Tensor:
    """rows [end-start, dim] (float32, CPU) of the global table, world-size independent."""
    out_RD = torch.empty(end - start, dim)
    if end <= start:
        return out_RD
    for chunk in range(start // INIT_CHUNK_ROWS, (end - 1) // INIT_CHUNK_ROWS + 1):
        lo = chunk * INIT_CHUNK_ROWS
        hi = min(lo + INIT_CHUNK_ROWS, num_rows)
        gen = torch.Generator().manual_seed(_chunk_seed(seed, table_index, chunk))
        chunk_CD = torch.randn(hi - lo, dim, generator=gen)
        a, b = max(lo, start), min(hi, end)
        out_RD[a - start:b - start] = chunk_CD[a - lo:b - lo]
    return out_RD.mul_(init_std)


class ShardedEmbedding(nn.Module):
    """Several row-wise sharded tables; this rank holds `weights[name]` = its rows.

    Every rank must issue the same lookups in the same order (they are
    collectives when world_size > 1).
    """

    def __init__(self, tables: Sequence[TableConfig], *, rank: int = 0, world_size: int = 1,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 seed: int = 0, init_std: float = 1.0) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside world_size={world_size}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        self.tables = {t.name: t for t in tables}
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = torch.device(device)
        self.ranges = {t.name: row_range(t.num_rows, rank, world_size) for t in tables}
        self.weights = nn.ParameterDict()
        for index, table in enumerate(tables):
            start, end = self.ranges[table.name]
            rows_RD = init_rows(table.num_rows, table.dim, start, end, seed=seed,
                                table_index=index, init_std=init_std)
            self.weights[table.name] = nn.Parameter(rows_RD.to(self.device))

    # -- forward ------------------------------------------------------------
    def _fetch_unique(self, name: str, ids_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages 1-4 minus the expansion: (rows_UD of the distinct ids, inverse_N)."""
        table = self.tables[name]
        weight = self.weights[name]
        start = self.ranges[name][0]
        routing = route(ids_N.to(self.device), table.num_rows, self.world_size, name)  # 1
        send_counts = routing.send_counts
        if self.world_size == 1:
            recv_counts, recv_ids_M = send_counts, routing.unique_U
        else:
            counts_W = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
            ones = [1] * self.world_size
            recv_counts = exchange(counts_W, ones, ones, self.group).tolist()  # 2: counts
            recv_ids_M = exchange(routing.unique_U, recv_counts, send_counts, self.group)  # ids
        local_rows_MD = F.embedding(recv_ids_M - start, weight, sparse=True)  # 3
        if self.world_size == 1:
            rows_UD = local_rows_MD
        else:
            rows_UD = all_to_all_rows(local_rows_MD, send_counts, recv_counts, self.group)  # 4
        return rows_UD, routing.inverse_N

    def lookup(self, name: str, ids_N: torch.Tensor) -> torch.Tensor:
        """Plain lookup: ids of any shape S -> rows of shape S + (dim,)."""
        rows_UD, inverse_N = self._fetch_unique(name, ids_N)
        rows_ND = rows_UD.index_select(0, inverse_N)
        return rows_ND.reshape(*ids_N.shape, rows_UD.shape[-1])

    def lookup_bag(self, name: str, ids_N: torch.Tensor, offsets_B: torch.Tensor,
                   mode: str = "sum") -> torch.Tensor:
        """Pooled bags like nn.EmbeddingBag: flat ids_N, bag b = ids[offsets[b]:offsets[b+1]]."""
        if mode not in POOLING_MODES:
            raise ValueError(f"mode={mode!r} is not one of {POOLING_MODES}")
        if ids_N.dim() != 1 or offsets_B.dim() != 1:
            raise ValueError(f"bags take 1-D ids and offsets, got {tuple(ids_N.shape)} and "
                             f"{tuple(offsets_B.shape)}")
        rows_UD, inverse_N = self._fetch_unique(name, ids_N)
        return F.embedding_bag(inverse_N, rows_UD, offsets_B.to(self.device), mode=mode)

    def lookup_many(self, names: Sequence[str], ids: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
        """Plain lookups of several tables of one width in ONE exchange.

        Same rows and gradients as [lookup(n, i) for n, i in zip(names, ids)], but the
        stages 2-4 run once for all the tables (3 all_to_alls instead of 3 per table): the
        message to each owner holds its ids of table 0, then of table 1, ...; the owner
        regroups them by table for the local gathers and sends the rows back in the same
        order. For models with many small tables (DLRM: 26 lookups a step).
        """
        if len(names) != len(ids):
            raise ValueError(f"{len(names)} table names but {len(ids)} id tensors")
        if self.world_size == 1 or len(names) <= 1:
            return [self.lookup(n, i) for n, i in zip(names, ids, strict=True)]
        dims = {self.tables[n].dim for n in names}
        if len(dims) != 1:
            raise ValueError(f"lookup_many needs tables of one width, got dims {sorted(dims)}")
        world, num = self.world_size, len(names)
        routings = [route(i.to(self.device), self.tables[n].num_rows, world, n)
                    for n, i in zip(names, ids, strict=True)]
        send_TW = np.array([r.send_counts for r in routings], dtype=np.int64)
        table_start = np.concatenate([np.zeros((num, 1), np.int64), send_TW.cumsum(1)], axis=1)
        # send buffer: destination-major, table-minor; block (w, t) starts at block_WT[w, t]
        block_WT = (np.cumsum(send_TW.T.reshape(-1)) - send_TW.T.reshape(-1)).reshape(world, num)
        send_ids = torch.cat([routings[t].unique_U[table_start[t, w]:table_start[t, w + 1]]
                              for w in range(world) for t in range(num)])
        send_counts = send_TW.sum(0).tolist()
        counts_WT = torch.from_numpy(send_TW.T.reshape(-1).copy()).to(self.device)
        recv_WT = exchange(counts_WT, [num] * world, [num] * world, self.group).reshape(world, num)
        recv_counts = recv_WT.sum(1).tolist()
        recv_ids_M = exchange(send_ids, recv_counts, send_counts, self.group)
        # owner side: regroup the received ids by table (stable), gather, restore the order
        table_of_M = torch.repeat_interleave(
            torch.arange(num, device=self.device).repeat(world), recv_WT.reshape(-1))
        order_M = torch.argsort(table_of_M, stable=True)
        per_table = torch.bincount(table_of_M, minlength=num).tolist()
        grouped = recv_ids_M.index_select(0, order_M).split(per_table)
        rows = [F.embedding(g - self.ranges[n][0], self.weights[n], sparse=True)
                for n, g in zip(names, grouped, strict=True)]
        local_rows_MD = torch.cat(rows).index_select(0, torch.argsort(order_M))
        rows_UD = all_to_all_rows(local_rows_MD, send_counts, recv_counts, self.group)
        out = []
        for t, (routing, ids_N) in enumerate(zip(routings, ids, strict=True)):
            take = torch.cat([torch.arange(block_WT[w, t], block_WT[w, t] + send_TW[t, w])
                              for w in range(world)]).to(self.device)
            rows_tD = rows_UD.index_select(0, take).index_select(0, routing.inverse_N)
            out.append(rows_tD.reshape(*ids_N.shape, rows_UD.shape[-1]))
        return out

    def local_block(self, name: str) -> tuple[int, torch.Tensor]:
        """(start, rows_RD): the rows this rank owns, [start, start + R), differentiable.

        Local (no collective): for work sharded by row range, e.g. scoring every query
        against the owned entity rows (KvsAll). The gradient reaches `weights[name]` as a
        sparse gradient over the owned rows, like a lookup's, so `pop_grads` hands it to the
        sparse optimizer together with the lookups' row gradients.
        """
        start, end = self.ranges[name]
        local_R = torch.arange(end - start, device=self.device)
        return start, F.embedding(local_R, self.weights[name], sparse=True)

    # -- gradients and updates ----------------------------------------------------
    def pop_grads(self, scale: float = 1.0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Coalesced owned-row gradients, times `scale`, and clear them.

        Returns {table: (ids_U global row ids, unique and sorted; grads_UD)};
        a table whose rows got no gradient this step yields empty tensors.
        """
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, weight in self.weights.items():
            start = self.ranges[name][0]
            grad = weight.grad
            weight.grad = None
            if grad is None:
                ids_U = torch.empty(0, dtype=torch.int64, device=self.device)
                grads_UD = weight.new_empty((0, weight.shape[1]))
            elif not grad.is_sparse:
                raise TypeError(f"table {name!r}: expected a sparse gradient, got a dense one")
            else:
                grad = grad.coalesce()
                ids_U = grad.indices()[0] + start
                grads_UD = grad.values() * scale
            out[name] = (ids_U, grads_UD)
        return out

    @torch.no_grad()
    def apply_update(self, name: str, ids_U: torch.Tensor, delta_UD: torch.Tensor,
                     decay: float) -> None:
        """rows[ids] = rows[ids] * decay + delta, for global ids inside the owned range."""
        from ps.optim import apply_update_

        start, end = self.ranges[name]
        if ids_U.numel() == 0:  # decay only ever touches the updated rows
            return
        lo, hi = int(ids_U.min()), int(ids_U.max())
        if lo < start or hi >= end:
            raise IndexError(f"table {name!r}: update for rows [{lo}, {hi}] outside the owned "
                             f"range [{start}, {end}) of rank {self.rank}")
        apply_update_(self.weights[name].data, ids_U.to(torch.int64) - start, delta_UD, decay)

    # -- whole tables -------------------------------------------------------------
    def gather_full(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """Full tables (CPU) on rank `dst`, None elsewhere. A collective; for tests/dumps."""
        shards = {name: w.detach().cpu() for name, w in self.weights.items()}
        if self.world_size == 1:
            return shards
        gathered: list[dict[str, torch.Tensor]] | None = (
            [{} for _ in range(self.world_size)] if self.rank == dst else None)
        dist.gather_object(shards, gathered, dst=dst, group=self.group)
        if gathered is None:
            return None
        return {name: torch.cat([g[name] for g in gathered]) for name in self.tables}
