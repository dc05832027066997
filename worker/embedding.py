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
     (an integer division, `owner_of`); unique ids are sorted, so they are
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

Row dtype (--row-dtype): fp32 rows (default), or bf16 rows (2 bytes per element
on the device). bf16 rows are the fp32 init rounded to bf16; the optimizer then
runs on an fp32 master copy elsewhere (shard server, or --local-optimizer) and
the rows are *set* to the master rounded to bf16 (`set_rows`), never
incremented in bf16. Lookups hand the dense model fp32 rows (cast on the owner,
right after the local gather, so the all_to_alls carry fp32 like in fp32 mode:
gloo has no bf16 all_to_all), and the gradients of bf16 rows arrive as bf16
sparse gradients (autograd casts to the leaf's dtype); `pop_grads` hands them
on as fp32.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridps.optim import STATE_OFFSETS, alloc_state
from worker.comm import all_to_all_rows, exchange

INIT_CHUNK_ROWS = 65536
POOLING_MODES = ("sum", "mean")
ROW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --row-dtype


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


def owner_of(ids_N: torch.Tensor, num_rows: int | torch.Tensor, world_size: int
             ) -> torch.Tensor:
    """owner_N: the rank owning each id of a table of `num_rows` rows (an int, or one per id).

    ((id + 1) * W - 1) // R is the largest r with r * R // W <= id, i.e. row_range's
    owner, with no search: r * R // W <= id  <=>  r * R < (id + 1) * W."""
    return ((ids_N + 1) * world_size - 1) // num_rows


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


ID_BITS = 40  # routing key ((owner * T + table) << ID_BITS) | id: ids below 2**40
ID_MASK = (1 << ID_BITS) - 1


@dataclass
class InputDist:
    """Stages 1-2 of one lookup of T tables (T = 1 for lookup/lookup_bag).

    It depends on the ids only, never on the rows, so it may be computed ahead of the
    step (worker/pipeline.py). inverse_N: the concatenated ids of the T tables (sizes:
    how many per table) -> index into rows_UD; send_counts: distinct ids asked of each
    rank, in rank order (rows_UD comes back so); recv_counts: ids each rank asked of this
    one; local_ids: per table, the owned rows (global - start) this rank serves, grouped
    by table; restore_M: their concatenation -> the received order (None when T = 1).
    """

    names: tuple[str, ...]
    ids: tuple[torch.Tensor, ...]  # the lookup's own id tensors: identity is the staging key
    inverse_N: torch.Tensor
    sizes: list[int]
    send_counts: list[int]
    recv_counts: list[int]
    local_ids: list[torch.Tensor]
    restore_M: torch.Tensor | None


class RowOffsets(Protocol):
    """Added to the rows the owner gathers (stage 3), not stored in them: worker/staleness.py's
    weight prediction for the updates a stale forward misses."""

    def add_to(self, name: str, local_ids_M: torch.Tensor | None, rows_MD: torch.Tensor
               ) -> torch.Tensor: ...


def _plan_key(names: Sequence[str], ids: Sequence[torch.Tensor]) -> tuple[object, ...]:
    return (*names, *(id(i) for i in ids))


def _check_bag(ids_N: torch.Tensor, offsets_B: torch.Tensor, mode: str) -> None:
    if mode not in POOLING_MODES:
        raise ValueError(f"mode={mode!r} is not one of {POOLING_MODES}")
    if ids_N.dim() != 1 or offsets_B.dim() != 1:
        raise ValueError(f"bags take 1-D ids and offsets, got {tuple(ids_N.shape)} and "
                         f"{tuple(offsets_B.shape)}")


def _chunk_seed(seed: int, table_index: int, chunk: int) -> int:
    state = np.random.SeedSequence([seed, table_index, chunk]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def init_rows(num_rows: int, dim: int, start: int, end: int, *, seed: int, table_index: int,
              init_std: float) -> torch.Tensor:
    """rows [end-start, dim] (float32, CPU) of the global table, world-size independent.

    A large block is allocated like the server's state (hybridps.optim.alloc_state: huge
    pages, 2 MiB-aligned): on a CPU rank these are the rows themselves, gathered and
    updated at random every step, and on 4 KiB pages a 25M x 16 table's gather +
    update of 4k rows took ~300 us instead of ~225 us (one thread, this 2-core VM)."""
    out_RD = alloc_state(max(end - start, 0), dim, offset=STATE_OFFSETS["rows"], zero=False)
    if end <= start:
        return out_RD
    for chunk in range(start // INIT_CHUNK_ROWS, (end - 1) // INIT_CHUNK_ROWS + 1):
        lo = chunk * INIT_CHUNK_ROWS
        hi = min(lo + INIT_CHUNK_ROWS, num_rows)
        gen = torch.Generator().manual_seed(_chunk_seed(seed, table_index, chunk))
        a, b = max(lo, start), min(hi, end)
        if (a, b) == (lo, hi):  # whole chunk: generate in place (no copy; 50M rows: -30%)
            torch.randn(hi - lo, dim, generator=gen, out=out_RD[a - start:b - start])
        else:
            chunk_CD = torch.randn(hi - lo, dim, generator=gen)
            out_RD[a - start:b - start] = chunk_CD[a - lo:b - lo]
        out_RD[a - start:b - start].mul_(init_std)  # while the chunk is in cache
    return out_RD


class ShardedEmbedding(nn.Module):
    """Several row-wise sharded tables; this rank holds `weights[name]` = its rows.

    Every rank must issue the same lookups in the same order (they are
    collectives when world_size > 1).
    """

    def __init__(self, tables: Sequence[TableConfig], *, rank: int = 0, world_size: int = 1,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 seed: int = 0, init_std: float = 1.0,
                 row_dtype: torch.dtype = torch.float32) -> None:
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
        if row_dtype not in ROW_DTYPES.values():
            raise ValueError(f"row dtype {row_dtype} is not one of {sorted(ROW_DTYPES)}")
        self.row_dtype = row_dtype
        # What the dense model gets from lookups (bf16 rows are cast on the owner).
        self.output_dtype = torch.float32
        # Kept to regenerate the fp32 init rows that seed a master copy (initial_row_blocks).
        self._init_seed, self._init_std = seed, init_std
        self.table_index = {t.name: i for i, t in enumerate(tables)}
        self._staged: dict[tuple[object, ...], InputDist] = {}  # stage(): computed ahead
        self._route_consts: dict[tuple[str, ...], tuple[list[int], torch.Tensor,
                                                        torch.Tensor]] = {}
        # worker/pipeline.py: (names, id tensors) of every lookup while not None
        self.recording: list[tuple[tuple[str, ...], tuple[torch.Tensor, ...]]] | None = None
        self.row_offsets: RowOffsets | None = None  # --staleness-compensation predict
        self.weights = nn.ParameterDict()
        for index, table in enumerate(tables):
            start, end = self.ranges[table.name]
            rows_RD = init_rows(table.num_rows, table.dim, start, end, seed=seed,
                                table_index=index, init_std=init_std)
            self.weights[table.name] = nn.Parameter(rows_RD.to(self.device, row_dtype))

    # -- forward ------------------------------------------------------------
    def _local_rows(self, name: str, local_ids_M: torch.Tensor, whole: bool = False
                    ) -> torch.Tensor:
        """Stage 3: the owner's gather (sparse gradient), in the dense model's dtype.
        `whole`: local_ids_M is every owned row in order (local_block)."""
        rows_MD = F.embedding(local_ids_M, self.weights[name], sparse=True)
        if rows_MD.dtype != self.output_dtype:
            rows_MD = rows_MD.to(self.output_dtype)
        if self.row_offsets is not None:
            rows_MD = self.row_offsets.add_to(name, None if whole else local_ids_M, rows_MD)
        return rows_MD

    def input_dist(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                   group: dist.ProcessGroup | None = None, timed: bool = True) -> InputDist:
        """Stages 1-2 of a lookup of one or more tables; depends on the ids only.

        1. route: every id gets the key ((owner * T + table) << ID_BITS) | id, and ONE
           torch.unique over the keys of all T tables dedupes and sorts them owner-major,
           then by table, then by id: chunk r of unique_U is what rank r owns;
        2. all_to_all the per-owner counts, then the keys.
        The owner regroups what it received by table for its gathers (stage 3, `fetch`).
        `group`/`timed`: worker/pipeline.py runs this for the next batch on its own process
        group from its own thread, untimed (the training thread's a2a seconds stay its own).
        """
        if len(names) != len(ids):
            raise ValueError(f"{len(names)} table names but {len(ids)} id tensors")
        world, num = self.world_size, len(names)
        flat = [i.reshape(-1).to(device=self.device, dtype=torch.int64) for i in ids]
        keys_N = self._route_keys(names, flat)
        unique_U, inverse_N = torch.unique(keys_N, sorted=True, return_inverse=True)  # 1
        if world == 1:
            send_counts = recv_counts = [int(unique_U.numel())]
            recv_keys_M = unique_U
        else:
            owner_U = (unique_U >> ID_BITS) // num
            send_counts = torch.bincount(owner_U, minlength=world).tolist()
            counts_W = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
            ones = [1] * world
            pg = group or self.group
            direction = "forward" if timed else None
            recv_counts = exchange(counts_W, ones, ones, pg, direction).tolist()  # 2: counts
            recv_keys_M = exchange(unique_U, recv_counts, send_counts, pg, direction)  # keys
        table_M = (recv_keys_M >> ID_BITS) - self.rank * num
        ids_M = recv_keys_M & ID_MASK
        if num == 1:
            local_ids, restore_M = [ids_M - self.ranges[names[0]][0]], None
        else:  # received blocks are sorted by table within each source: regroup stably
            order_M = torch.argsort(table_M, stable=True)
            per_table = torch.bincount(table_M, minlength=num).tolist()
            grouped = ids_M.index_select(0, order_M).split(per_table)
            local_ids = [g - self.ranges[n][0] for n, g in zip(names, grouped, strict=True)]
            restore_M = torch.argsort(order_M)
        return InputDist(tuple(names), tuple(ids), inverse_N, [f.numel() for f in flat],
                         send_counts, recv_counts, local_ids, restore_M)

    def _route_keys(self, names: Sequence[str], flat: Sequence[torch.Tensor]) -> torch.Tensor:
        """keys_N: ((owner * T + table) << ID_BITS) | id for the ids of T tables at once.

        A fixed handful of ops and one host sync (the range check) whatever T is: the
        owner of id in a table of R rows is ((id + 1) * W - 1) // R, the largest r with
        r * R // W <= id (`owner_of`), so no per-table searchsorted is needed."""
        world, num = self.world_size, len(names)
        num_rows_T, rows_T, tables_T = self._route_constants(tuple(names))
        ids_N = torch.cat(list(flat)) if num > 1 else flat[0]
        if num == 1:
            rows_N: torch.Tensor | int = num_rows_T[0]
            table_N: torch.Tensor | int = 0
        else:
            sizes_T = torch.tensor([f.numel() for f in flat], device=self.device)
            rows_N = torch.repeat_interleave(rows_T, sizes_T, output_size=ids_N.numel())
            table_N = torch.repeat_interleave(tables_T, sizes_T, output_size=ids_N.numel())
        if ids_N.numel() and bool(((ids_N < 0) | (ids_N >= rows_N)).any()):
            for name, num_rows, flat_N in zip(names, num_rows_T, flat, strict=True):
                lo, hi = (int(x) for x in torch.aminmax(flat_N)) if flat_N.numel() else (0, 0)
                if lo < 0 or hi >= num_rows:
                    raise IndexError(f"table {name!r}: row id {lo if lo < 0 else hi} outside "
                                     f"[0, {num_rows})")
        if world == 1:
            return ids_N | (table_N << ID_BITS) if num > 1 else ids_N
        owner_N = owner_of(ids_N, rows_N, world)
        return ((owner_N * num + table_N) << ID_BITS) | ids_N

    def _route_constants(self, names: tuple[str, ...]
                         ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(rows per table, the same as a tensor, 0..T-1) of a lookup's tables, made (and
        checked against the key's ID_BITS) once per table list."""
        consts = self._route_consts.get(names)
        if consts is None:
            num_rows_T = [self.tables[n].num_rows for n in names]
            for name, num_rows in zip(names, num_rows_T, strict=True):
                if num_rows > ID_MASK + 1:
                    raise ValueError(f"table {name!r}: {num_rows} rows do not fit the "
                                     f"{ID_BITS}-bit row ids of the routing key")
            consts = self._route_consts[names] = (
                num_rows_T, torch.tensor(num_rows_T, dtype=torch.int64, device=self.device),
                torch.arange(len(names), dtype=torch.int64, device=self.device))
        return consts

    def fetch(self, plan: InputDist) -> torch.Tensor:
        """Stages 3-4: the owner gathers its rows (after the staleness window applied the due
        updates), all_to_all sends them back: rows_UD in the order of the asker's unique ids."""
        rows = [self._local_rows(n, local_M)  # 3
                for n, local_M in zip(plan.names, plan.local_ids, strict=True)]
        local_rows_MD = rows[0]
        if plan.restore_M is not None:
            local_rows_MD = torch.cat(rows).index_select(0, plan.restore_M)
        if self.world_size == 1:
            return local_rows_MD
        return all_to_all_rows(local_rows_MD, plan.send_counts, plan.recv_counts, self.group)

    def stage(self, plans: Sequence[InputDist]) -> None:
        """Hand over input dists computed ahead (worker/pipeline.py): a lookup whose names and
        id tensors (by identity) match one uses it instead of running stages 1-2 itself."""
        self._staged = {_plan_key(p.names, p.ids): p for p in plans}

    def unstage(self) -> int:
        """Drop what the step did not use; returns how many (0 when the plan matched)."""
        left, self._staged = len(self._staged), {}
        return left

    def _plan_for(self, names: Sequence[str], ids: Sequence[torch.Tensor]) -> InputDist:
        if self.recording is not None:
            self.recording.append((tuple(names), tuple(ids)))
        plan = self._staged.pop(_plan_key(names, ids), None) if self._staged else None
        if plan is not None and all(a is b for a, b in zip(plan.ids, ids, strict=True)):
            return plan
        return self.input_dist(names, ids)

    def lookup(self, name: str, ids_N: torch.Tensor) -> torch.Tensor:
        """Plain lookup: ids of any shape S -> rows of shape S + (dim,)."""
        plan = self._plan_for((name,), (ids_N,))
        rows_UD = self.fetch(plan)
        rows_ND = rows_UD.index_select(0, plan.inverse_N)
        return rows_ND.reshape(*ids_N.shape, rows_UD.shape[-1])

    def lookup_bag(self, name: str, ids_N: torch.Tensor, offsets_B: torch.Tensor,
                   mode: str = "sum") -> torch.Tensor:
        """Pooled bags like nn.EmbeddingBag: flat ids_N, bag b = ids[offsets[b]:offsets[b+1]]."""
        _check_bag(ids_N, offsets_B, mode)
        plan = self._plan_for((name,), (ids_N,))
        rows_UD = self.fetch(plan)
        return F.embedding_bag(plan.inverse_N, rows_UD, offsets_B.to(self.device), mode=mode)

    def lookup_many(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                    bags: Sequence[tuple[torch.Tensor, str] | None] | None = None
                    ) -> list[torch.Tensor]:
        """Lookups of several tables of one width in ONE exchange (4 all_to_alls, not 4 per
        table); entry t of `bags`, when given and not None, is (offsets_B, mode): table t is
        pooled like lookup_bag. Same rows and gradients as the separate lookups. For models
        with several tables (DLRM: 26 a step; the default job: 4)."""
        if len(names) != len(ids) or (bags is not None and len(bags) != len(names)):
            raise ValueError(f"{len(names)} table names but {len(ids)} id tensors"
                             + ("" if bags is None else f" and {len(bags)} bag entries"))
        dims = {self.tables[n].dim for n in names}
        if len(dims) > 1:
            raise ValueError(f"lookup_many needs tables of one width, got dims {sorted(dims)}")
        for t, bag in enumerate(bags or ()):
            if bag is not None:
                _check_bag(ids[t], bag[0], bag[1])
        plan = self._plan_for(names, ids)
        rows_UD = self.fetch(plan)
        out = []
        for t, (inverse_N, ids_N) in enumerate(zip(plan.inverse_N.split(plan.sizes), ids,
                                                   strict=True)):
            bag = None if bags is None else bags[t]
            if bag is None:
                rows_ND = rows_UD.index_select(0, inverse_N)
                out.append(rows_ND.reshape(*ids_N.shape, rows_UD.shape[-1]))
            else:
                out.append(F.embedding_bag(inverse_N, rows_UD, bag[0].to(self.device),
                                           mode=bag[1]))
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
        return start, self._local_rows(name, local_R, whole=True)

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
                grads_UD = weight.new_empty((0, weight.shape[1]), dtype=torch.float32)
            elif not grad.is_sparse:
                raise TypeError(f"table {name!r}: expected a sparse gradient, got a dense one")
            else:
                grad = grad.coalesce()
                ids_U = grad.indices()[0] + start
                grads_UD = grad.values().to(torch.float32) * scale  # bf16 rows: bf16 grads
            out[name] = (ids_U, grads_UD)
        return out

    @torch.no_grad()
    def apply_update(self, name: str, ids_U: torch.Tensor, delta_UD: torch.Tensor,
                     decay: float) -> None:
        """rows[ids] = rows[ids] * decay + delta, for global ids inside the owned range."""
        from hybridps.optim import apply_update_

        start, end = self.ranges[name]
        if ids_U.numel() == 0:  # decay only ever touches the updated rows
            return
        lo, hi = int(ids_U.min()), int(ids_U.max())
        if lo < start or hi >= end:
            raise IndexError(f"table {name!r}: update for rows [{lo}, {hi}] outside the owned "
                             f"range [{start}, {end}) of rank {self.rank}")
        apply_update_(self.weights[name].data, ids_U.to(torch.int64) - start, delta_UD, decay)

    @torch.no_grad()
    def set_rows(self, name: str, ids_U: torch.Tensor, rows_UD: torch.Tensor) -> None:
        """rows[ids] = rows_UD (a "rows" answer: the master rows, rounded to the row dtype)."""
        start, end = self.ranges[name]
        if ids_U.numel() == 0:
            return
        lo, hi = int(ids_U.min()), int(ids_U.max())
        if lo < start or hi >= end:
            raise IndexError(f"table {name!r}: new rows [{lo}, {hi}] outside the owned "
                             f"range [{start}, {end}) of rank {self.rank}")
        weight = self.weights[name].data
        local_U = ids_U.to(device=weight.device, dtype=torch.int64) - start
        weight.index_copy_(0, local_U, rows_UD.to(device=weight.device, dtype=weight.dtype))

    def initial_row_blocks(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(global start, fp32 rows on the CPU): the owned rows as initialised, in order.

        They seed an fp32 master copy of bf16 rows. Regenerated one init chunk at a
        time (init_rows is deterministic), so no fp32 copy of the table is kept; each
        block is checked against the device rows, which must be it rounded to the row
        dtype (else something changed the rows after init and the master would not be
        the rows' master).
        """
        table = self.tables[name]
        start, end = self.ranges[name]
        weight = self.weights[name].data
        lo = start
        while lo < end:
            hi = min((lo // INIT_CHUNK_ROWS + 1) * INIT_CHUNK_ROWS, end)
            rows_RD = init_rows(table.num_rows, table.dim, lo, hi,
                                seed=self._init_seed, table_index=self.table_index[name],
                                init_std=self._init_std)
            held_RD = weight[lo - start:hi - start].to("cpu")
            if not torch.equal(rows_RD.to(weight.dtype), held_RD):
                raise RuntimeError(f"table {name!r} rank {self.rank}: rows [{lo}, {hi}) on the "
                                   "device are not the initial rows rounded to "
                                   f"{weight.dtype}; cannot seed the master copy from them")
            yield lo, rows_RD
            lo = hi

    def device_bytes(self) -> dict[str, int]:
        """Bytes of the rows this rank holds on its device, per table (the tensors' own)."""
        return {name: w.numel() * w.element_size() for name, w in self.weights.items()}

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
