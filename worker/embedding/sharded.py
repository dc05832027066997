"""Sharded embedding tables.

Sharding: table t has R rows of width D. Rank r of W owns the contiguous rows
[cuts[r], cuts[r+1]) of its scheme (worker/embedding/sharding.py; --sharding): row-wise,
    [r * R // W, (r + 1) * R // W)
(so the last rank ends exactly at R), or the whole table on one rank, as an
`nn.Parameter` of shape [owned rows, D] on its device. The rows are NOT under FSDP and NOT in the
dense optimizer: their gradients are popped after backward (`pop_grads`) and
handed to the sparse optimizer (shard server or --local-optimizer), whose
updates come back through `apply_update`.

A lookup of one or more tables (`lookup_many`; `lookup` and `lookup_bag` are
its one-table cases) goes through visible stages:
  1-2. input dist (`input_dist`, worker/embedding/input_dist.py): route every id to its
     owner (by its table's cuts, `owner_local`) and exchange what each owner must
     serve, all tables in ONE all_to_all (`exchange_blocks`). A plain lookup is
     served as rows (the requester dedupes its ids); a bag (pooled lookup) is
     served either as rows or pooled at the owner, per table, whichever moves
     fewer bytes (`--pool-at`, `_pooled_entries`);
  3. lookup (`fetch`): the owner gathers the requested rows from its shard
     (F.embedding, sparse gradient) or sums its part of each bag: one native call
     per unit for its dedupe, gather with the weight prediction and bag sums, and one
     in backward for the row gradients (`PoolUnitAtOwner`, hybridps/pooled_bags.py),
     or the torch path, the reference and fallback (`OwnerPool` made at stage 2,
     `PoolAtOwner`);
  4. output dist (`fetch`): ONE all_to_all (AllToAllRows) sends the rows and the
     partial sums back; the requester expands the rows with its inverse (plain
     lookup) or pools them (embedding_bag), and adds the owners' partial sums
     (and divides by the bag length for mean).
Backward runs the same path in reverse: AllToAllRows.backward sends row and
partial-sum gradients to the owners, and autograd gives each owner a sparse
gradient on its shard; `pop_grads` coalesces it (unique ids + summed rows).

World size 1: no collective at all (and no process group is needed): the
lookups read the rows in place, F.embedding / F.embedding_bag on the shard,
like a plain single-process model.

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

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridps import pooled_bags
from hybridps.dynamic import check_capacity
from hybridps.pooled_bags import BagsAtOwner
from hybridps.state_alloc import STATE_OFFSETS, alloc_state
from worker.embedding.comm import BlockCap, all_to_all_rows, exchange, exchange_blocks
from worker.embedding.dynamic.ids import DynamicIds, RowPager
from worker.embedding.groups import Member, Unit, plan_units
from worker.embedding.input_dist import (
    ID_BITS,
    ID_MASK,
    InputDist,
    OwnerWork,
    PoolAtOwner,
    PoolUnitAtOwner,
    make_requests,
    owner_of,
    owner_work,
)
from worker.embedding.rows import (
    INIT_CHUNK_ROWS,
    Routing,
    TableConfig,
    init_rows,
    place,
    route,
    row_range,
    table_row_range,
)
from worker.embedding.sharding import RowWise, TableWise
from worker.embedding.unit_rows import UnitRows
from worker.runtime.device_copy import sync_point, to_device

__all__ = ["ID_BITS", "ID_MASK", "INIT_CHUNK_ROWS", "POOLING_MODES", "POOL_AT", "ROW_DTYPES",
           "InputDist", "Routing", "ShardedEmbedding", "TableConfig", "init_rows", "owner_of",
           "route", "row_range"]

POOLING_MODES = ("sum", "mean")
ROW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --row-dtype
POOL_AT = ("auto", "owner", "requester")  # --pool-at
Bag = tuple[torch.Tensor, str]  # (offsets_B, mode) of a pooled lookup
Lookup = tuple[tuple[str, ...], tuple[torch.Tensor, ...], tuple[Bag | None, ...]]  # recorded


class RowOffsets(Protocol):
    """Added to the rows the owner gathers (stage 3), not stored in them:
    worker/updates/staleness.py's weight prediction for the updates a stale forward misses."""

    def add_to(self, name: str, local_ids_M: torch.Tensor | None, rows_MD: torch.Tensor
               ) -> torch.Tensor: ...

    def offsets_of(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(local_P sorted distinct rows of unit `name`'s block, offset_PD float32): what
        add_to adds, for the owner's fused kernel to add itself; None: nothing."""
        ...


def _plan_key(names: Sequence[str], ids: Sequence[torch.Tensor],
              offsets: Sequence[torch.Tensor | None]) -> tuple[object, ...]:
    return (*names, *(id(i) for i in ids), *(id(o) for o in offsets))


def _check_bag(ids_N: torch.Tensor, offsets_B: torch.Tensor, mode: str) -> None:
    if mode not in POOLING_MODES:
        raise ValueError(f"mode={mode!r} is not one of {POOLING_MODES}")
    if ids_N.dim() != 1 or offsets_B.dim() != 1:
        raise ValueError(f"bags take 1-D ids and offsets, got {tuple(ids_N.shape)} and "
                         f"{tuple(offsets_B.shape)}")


class ShardedEmbedding(UnitRows, nn.Module):
    """Several row-wise sharded tables; this rank holds `weights[unit]` = the rows of each
    unit (worker/embedding/groups.py: a group of tables of one width, or a table alone; the rows,
    gradients and updates per unit are in worker/embedding/unit_rows.py).

    Every rank must issue the same lookups in the same order (they are
    collectives when world_size > 1).
    """

    def __init__(self, tables: Sequence[TableConfig], *, rank: int = 0, world_size: int = 1,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu",
                 seed: int = 0, init_std: float = 1.0,
                 row_dtype: torch.dtype = torch.float32, pool_at: str = "auto",
                 group_tables: bool = False, sharding: str = "row_wise") -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside world_size={world_size}")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        self.tables = {t.name: t for t in tables}
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = torch.device(device)
        # each table's scheme (a table's own choice, else `sharding`: --sharding)
        self.schemes = place(tables, world_size, sharding)
        self.ranges = {t.name: table_row_range(t, rank, world_size, self.schemes[t.name])
                       for t in tables}
        if row_dtype not in ROW_DTYPES.values():
            raise ValueError(f"row dtype {row_dtype} is not one of {sorted(ROW_DTYPES)}")
        self.row_dtype = row_dtype
        if pool_at not in POOL_AT:
            raise ValueError(f"pool_at={pool_at!r} is not one of {', '.join(POOL_AT)}")
        self.pool_at = pool_at
        # (names, which entries are bags) -> which bags are pooled at the owner (auto)
        self._pool_choice: dict[tuple[tuple[str, ...], tuple[bool, ...]], tuple[bool, ...]] = {}
        # (process group, names, pooled entries) -> exchange_blocks' agreed block size
        self._caps: dict[tuple[int, tuple[str, ...], tuple[bool, ...]], BlockCap] = {}
        # What the dense model gets from lookups (bf16 rows are cast on the owner).
        self.output_dtype = torch.float32
        # Kept to regenerate the fp32 init rows that seed a master copy (initial_row_blocks).
        self._init_seed, self._init_std = seed, init_std
        self.table_index = {t.name: i for i, t in enumerate(tables)}
        self._staged: dict[tuple[object, ...], InputDist] = {}  # stage(): computed ahead
        self._route_consts: dict[tuple[str, ...], tuple[list[int], torch.Tensor]] = {}
        # worker/train/pipeline.py: (names, id tensors, bags) of every lookup while not None
        self.recording: list[Lookup] | None = None
        self.row_offsets: RowOffsets | None = None  # --staleness-compensation predict
        dynamic = [t for t in tables if t.dynamic is not None]
        for t in dynamic:
            check_capacity(t.name, t.num_rows, world_size)
            if row_dtype != torch.float32:
                raise ValueError(f"table {t.name!r}: dynamic tables keep fp32 rows; "
                                 f"--row-dtype {row_dtype} is not supported with them")
        self.native_pool_calls = 0  # PoolUnitAtOwner calls (the owner's fused kernel)
        self.units = plan_units(tables, rank, world_size, group_tables, self.schemes)
        self.unit_of: dict[str, tuple[Unit, Member]] = {
            m.name: (u, m) for u in self.units.values() for m in u.members}
        self.weights = nn.ParameterDict()
        for unit in self.units.values():
            block_RD = (alloc_state(unit.rows, unit.dim, offset=STATE_OFFSETS["rows"],
                                    zero=False) if unit.grouped else None)
            for m in unit.members:
                if self.tables[m.name].dynamic is not None:  # slots get rows when taken
                    rows_RD = torch.zeros(m.rows, unit.dim)
                    continue
                rows_RD = init_rows(m.num_rows, unit.dim, m.start, m.end, seed=seed,
                                    table_index=self.table_index[m.name], init_std=init_std,
                                    out=None if block_RD is None
                                    else block_RD[m.offset:m.offset + m.rows])
            self.weights[unit.name] = nn.Parameter(
                (rows_RD if block_RD is None else block_RD).to(self.device, row_dtype))
        # per unit, the rows an update changed since the last checkpoint (unit_rows.py)
        self.changed = {name: torch.zeros(u.rows, dtype=torch.bool, device=self.device)
                        for name, u in self.units.items()}
        # raw ids -> slots at their owners (worker/embedding/dynamic/ids.py), None without any
        self.dynamic: DynamicIds | None = None
        if dynamic:
            self.dynamic = DynamicIds(
                [(t.name, t.num_rows, t.dim, t.dynamic, self.table_index[t.name])
                 for t in dynamic if t.dynamic is not None],
                self.ranges, rank=rank, world_size=world_size, group=group,
                device=self.device, seed=seed, init_std=init_std,
                rows_of=lambda name: self.weights[name],
                whole_on={t.name: s.owner for t in dynamic
                          if isinstance(s := self.schemes[t.name], TableWise)})

    # -- forward ------------------------------------------------------------
    def _gather(self, unit: str, local_ids_M: torch.Tensor, whole: bool = False
                ) -> torch.Tensor:
        """Stage 3: the owner's gather of rows of a unit's block (sparse gradient), in the
        dense model's dtype. `whole`: local_ids_M is every row of the block in order."""
        rows_MD = F.embedding(local_ids_M, self.weights[unit], sparse=True)
        return self._as_seen(unit, None if whole else local_ids_M, rows_MD)

    def _gather_tables(self, names: Sequence[str], local_ids: Sequence[torch.Tensor]
                       ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Rows of several tables' owned (table-local) ids: ONE gather per unit. Returns
        each entry's rows and, when one gather served every entry in order, its result
        (the entries' rows side by side: nothing to concatenate)."""
        by_unit: dict[str, list[int]] = {}
        for e, name in enumerate(names):
            by_unit.setdefault(self.unit_of[name][0].name, []).append(e)
        out: list[torch.Tensor] = list(local_ids)
        joined = None
        for unit, entries in by_unit.items():
            offsets = [self.unit_of[names[e]][1].offset for e in entries]
            if len(entries) == 1:
                local_M = local_ids[entries[0]]
                out[entries[0]] = joined = self._gather(
                    unit, local_M + offsets[0] if offsets[0] else local_M)
                continue
            sizes = [int(local_ids[e].numel()) for e in entries]
            # each table's ids + its offset in the block: a scalar add, no host list copied
            # to the device (a blocking copy on a GPU: worker/runtime/device_copy.py)
            local_M = torch.cat([local_ids[e] + offset if offset else local_ids[e]
                                 for e, offset in zip(entries, offsets, strict=True)])
            joined = self._gather(unit, local_M)
            for e, rows_MD in zip(entries, joined.split(sizes), strict=True):
                out[e] = rows_MD
        return out, joined if len(by_unit) == 1 else None  # entries in order within a unit

    def _as_seen(self, name: str, local_ids_M: torch.Tensor | None, rows_MD: torch.Tensor
                 ) -> torch.Tensor:
        """Rows as the dense model sees them: its dtype, plus any staleness prediction."""
        if rows_MD.dtype != self.output_dtype:
            rows_MD = rows_MD.to(self.output_dtype)
        if self.row_offsets is not None:
            rows_MD = self.row_offsets.add_to(name, local_ids_M, rows_MD)
        return rows_MD

    def _local_bags(self, name: str, ids_M: torch.Tensor, offsets_B: torch.Tensor, mode: str
                    ) -> torch.Tensor:
        """World size 1: pool the rows in place, as nn.EmbeddingBag(sparse=True) does."""
        unit, member = self.unit_of[name]
        weight = self.weights[unit.name]
        if member.offset:
            ids_M = ids_M + member.offset
        if weight.dtype == self.output_dtype and self.row_offsets is None:
            return F.embedding_bag(ids_M, weight, offsets_B, mode=mode, sparse=True)
        rows_MD = self._gather(unit.name, ids_M)
        local_M = torch.arange(ids_M.numel(), device=self.device)
        return F.embedding_bag(local_M, rows_MD, offsets_B, mode=mode)

    def input_dist(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                   group: dist.ProcessGroup | None = None, timed: bool = True,
                   bags: Sequence[Bag | None] | None = None) -> InputDist:
        """Stages 1-2 of a lookup of one or more tables; depends on the ids (and the bags'
        offsets) only, never on the rows (worker/embedding/input_dist.py).

        `group`/`timed`: worker/train/pipeline.py runs this for the next batch on its own process
        group from its own thread, untimed (the training thread's a2a seconds stay its own).
        """
        if len(names) != len(ids) or (bags is not None and len(bags) != len(names)):
            raise ValueError(f"{len(names)} table names but {len(ids)} id tensors"
                             + ("" if bags is None else f" and {len(bags)} bag entries"))
        entries = list(bags) if bags is not None else [None] * len(names)
        flat = [i.reshape(-1).to(device=self.device, dtype=torch.int64) for i in ids]
        rows_E, rows_tensor_E = self._route_constants(tuple(names))
        with sync_point("check_ids"):
            self._check_ids(names, flat, rows_E, rows_tensor_E)
        offsets = tuple(None if b is None else b[0] for b in entries)
        modes = tuple(None if b is None else b[1] for b in entries)
        plan = InputDist(tuple(names), tuple(ids), offsets, modes, (False,) * len(names), flat)
        if self.world_size == 1:
            return plan
        pg = group or self.group
        direction = "forward" if timed else None
        on_device = [None if o is None else o.to(self.device) for o in offsets]
        with sync_point("input_dist"):  # what each rank asks of each: sizes from the ids
            plan.pooled = self._pooled_entries(plan, on_device, pg, direction)
            requests = make_requests(flat, rows_E, rows_tensor_E, plan.pooled, on_device,
                                     self.world_size, self._cuts(plan.names))
        cap = self._caps.setdefault((id(pg), plan.names, plan.pooled), BlockCap())
        header, data, _ = exchange_blocks(requests.header_WH, requests.blocks, cap, pg,
                                          direction)
        plan.requests = requests
        owned = [self.ranges[n][1] - self.ranges[n][0]
                 for n, pooled in zip(plan.names, plan.pooled, strict=True) if pooled]
        fused = all(pooled_bags.fused_for(self.weights[self.unit_of[n][0].name])
                    for n, pooled in zip(plan.names, plan.pooled, strict=True) if pooled)
        plan.work = owner_work(header, data, plan.pooled.count(False), owned, dedupe=not fused)
        for e, pooled in enumerate(plan.pooled):
            offsets_B = on_device[e]
            if pooled and modes[e] == "mean" and offsets_B is not None:
                lengths_B = torch.diff(offsets_B, append=offsets_B.new_full((1,), flat[e].numel()))
                plan.divisors.append(lengths_B.clamp(min=1).to(self.output_dtype).unsqueeze(1))
            elif pooled:
                plan.divisors.append(None)
        return plan

    def _check_ids(self, names: Sequence[str], flat: Sequence[torch.Tensor],
                   rows_E: Sequence[int], rows_tensor_E: torch.Tensor) -> None:
        """Every id inside its table, with one host sync and a fixed handful of ops for all
        tables (DLRM: 26); the error names the table and the id."""
        if len(flat) > 2:
            ids_N = torch.cat(list(flat))
            rows_N = torch.repeat_interleave(
                rows_tensor_E, torch.tensor([f.numel() for f in flat], device=self.device),
                output_size=ids_N.numel())
            if not bool(((ids_N < 0) | (ids_N >= rows_N)).any()):
                return
        present = [(n, r, f) for n, r, f in zip(names, rows_E, flat, strict=True) if f.numel()]
        if not present:
            return
        bounds = torch.stack([torch.stack(torch.aminmax(f)) for _, _, f in present]).tolist()
        for (name, num_rows, _), (lo, hi) in zip(present, bounds, strict=True):
            if lo < 0 or hi >= num_rows:
                raise IndexError(f"table {name!r}: row id {lo if lo < 0 else hi} outside "
                                 f"[0, {num_rows})")

    def _route_constants(self, names: tuple[str, ...]) -> tuple[list[int], torch.Tensor]:
        """(rows per table, the same as a tensor) of a lookup's tables, made (and checked
        against the routing key's ID_BITS) once per table list."""
        consts = self._route_consts.get(names)
        if consts is None:
            num_rows_E = [self.tables[n].num_rows for n in names]
            for name, num_rows in zip(names, num_rows_E, strict=True):
                if num_rows > ID_MASK + 1:
                    raise ValueError(f"table {name!r}: {num_rows} rows do not fit the "
                                     f"{ID_BITS}-bit row ids of the routing key")
            consts = self._route_consts[names] = (
                num_rows_E, to_device(torch.tensor(num_rows_E, dtype=torch.int64), self.device))
        return consts

    def _cuts(self, names: Sequence[str]) -> list[list[int]] | None:
        """Each table's cut points (worker/embedding/sharding.py), or None when every table
        is row-wise (make_requests then divides instead of searching the cuts)."""
        if all(isinstance(self.schemes[n], RowWise) for n in names):
            return None
        return [self.schemes[n].cuts(self.tables[n].num_rows, self.world_size) for n in names]

    def _pooled_entries(self, plan: InputDist, offsets: Sequence[torch.Tensor | None],
                        group: dist.ProcessGroup | None, direction: str | None
                        ) -> tuple[bool, ...]:
        """Which bags are pooled at their owner (--pool-at; auto: per entry, the way that
        moves fewer bytes, measured on the first batch of this lookup and summed over the
        ranks, so every rank decides the same; kept for the run).

        Bytes a step, both directions (ids + lengths out, rows or partial sums back, their
        gradients out again): rows, U x (8 + 8 D) for U distinct ids; pooled at the owner,
        8 (N + W B) + 8 W B D for N ids in B bags (every owner sends a partial sum per
        bag). So bags of a few ids, or of the same few hot ids, stay rows; long bags over
        many rows are pooled at the owner."""
        bag_e = [e for e, o in enumerate(offsets) if o is not None]
        if not bag_e or self.pool_at == "requester":
            return (False,) * len(offsets)
        if self.pool_at == "owner":
            return tuple(o is not None for o in offsets)
        key = (plan.names, tuple(o is not None for o in offsets))
        decided = self._pool_choice.get(key)
        if decided is None:
            world = self.world_size
            cost = []
            for e in bag_e:
                offsets_B = offsets[e]
                assert offsets_B is not None
                dim, ids_N = self.tables[plan.names[e]].dim, plan.flat[e]
                distinct = torch.unique(ids_N).numel()
                bags = offsets_B.numel()
                cost += [distinct * (8 + 8 * dim),
                         8 * (ids_N.numel() + world * bags) + 8 * world * bags * dim]
            mine = torch.tensor(cost, dtype=torch.float64, device=self.device)
            every = exchange(mine.repeat(world), [len(cost)] * world, [len(cost)] * world,
                             group, direction).view(world, len(bag_e), 2).sum(0).tolist()
            pooled = dict(zip(bag_e, (p < r for r, p in every), strict=True))
            decided = self._pool_choice[key] = tuple(pooled.get(e, False)
                                                     for e in range(len(offsets)))
        return decided

    def fetch(self, plan: InputDist) -> list[torch.Tensor]:
        """Stages 3-4 (after the staleness window applied the due updates): each entry's
        result, flat: rows_ND for a plain lookup, bags_BD for a bag."""
        if plan.requests is None or plan.work is None:  # world size 1: in place
            return self._fetch_local(plan)
        req, work = plan.requests, plan.work
        rows_e = [e for e, p in enumerate(plan.pooled) if not p]
        pool_e = [e for e, p in enumerate(plan.pooled) if p]
        served: list[torch.Tensor] = []
        joined = None
        if rows_e:  # 3: the rows asked of this rank, one gather per unit
            served, joined = self._gather_tables([plan.names[e] for e in rows_e],
                                                 work.local_ids)
        if pool_e:  # 3: its part of every bag
            served += self._pool_at_owner(plan.names, pool_e, work)
        local_MD = (joined if joined is not None and not pool_e else
                    torch.cat(served) if len(served) > 1 else served[0])
        if work.restore is not None:
            local_MD = local_MD.index_select(0, work.restore)
        answer = all_to_all_rows(local_MD, req.rows_from, work.rows_to, self.group)  # 4
        # owner r's answer: the rows asked of it (unique_U's order), then B partial sums
        # per pooled entry
        per_owner = answer.split(req.rows_from) if pool_e else [answer]
        rows_UD = answer
        if pool_e:
            rows_UD = torch.cat([a[:n] for a, n in zip(per_owner, req.asked, strict=True)])
        out: list[torch.Tensor] = [answer] * len(plan.names)
        plain = [(e, inverse_N) for e, inverse_N in zip(rows_e, req.inverse, strict=True)
                 if plan.offsets[e] is None]
        if plain:
            # One gather for every plain entry: its backward is one scatter into a gradient
            # of rows_UD, where a gather per entry made (and summed) one full-size gradient
            # per entry. Bitwise the same: each entry's rows are its own (make_requests
            # dedupes per entry), so no row sums gradients of two entries.
            both_ND = rows_UD.index_select(0, torch.cat([inv for _, inv in plain]))
            for (e, _), part in zip(plain, both_ND.split([inv.numel() for _, inv in plain]),
                                    strict=True):
                out[e] = part
        for e, inverse_N in zip(rows_e, req.inverse, strict=True):
            offsets_B, mode = plan.offsets[e], plan.modes[e]
            if offsets_B is not None:
                out[e] = F.embedding_bag(inverse_N, rows_UD, offsets_B.to(self.device),
                                         mode=str(mode))
        at = list(req.asked)
        for e, bags, divisor in zip(pool_e, req.pooled_bags, plan.divisors, strict=True):
            partial = [a[lo:lo + bags] for a, lo in zip(per_owner, at, strict=True)]
            at = [lo + bags for lo in at]
            bags_BD = partial[0]
            for more_BD in partial[1:]:  # the owners' sums, in rank order
                bags_BD = bags_BD + more_BD
            out[e] = bags_BD if divisor is None else bags_BD / divisor
        return out

    def _pool_at_owner(self, names: Sequence[str], pool_e: Sequence[int], work: OwnerWork
                       ) -> list[torch.Tensor]:
        """Stage 3 of the entries pooled at their owner: this rank's part of every bag, per
        entry. ONE native call per unit (PoolUnitAtOwner: dedupe, gather with the weight
        prediction, bag sums; hybridps/pooled_bags.py) where the kernel takes the unit's
        rows, else the torch path per entry (OwnerPool + PoolAtOwner), the reference."""
        by_unit: dict[str, list[int]] = {}  # unit -> its pooled entries (index into pool_e)
        for i, e in enumerate(pool_e):
            by_unit.setdefault(self.unit_of[names[e]][0].name, []).append(i)
        parts: dict[int, torch.Tensor] = {}
        for unit, idx in by_unit.items():
            weight = self.weights[unit]
            members = [self.unit_of[names[pool_e[i]]][1] for i in idx]
            if not pooled_bags.fused_for(weight):
                for i, member in zip(idx, members, strict=True):
                    pool = work.pool(i, member.rows)
                    rows_U = pool.uniq_U + member.offset if member.offset else pool.uniq_U
                    with torch.no_grad():
                        rows_UD = self._as_seen(unit, rows_U, weight.index_select(0, rows_U))
                    parts[i] = PoolAtOwner.apply(weight, rows_UD, pool, rows_U)
                continue
            prediction = None if self.row_offsets is None else self.row_offsets.offsets_of(unit)
            entries = [BagsAtOwner(*work.bags[i], m.offset, m.rows)
                       for i, m in zip(idx, members, strict=True)]
            # A table twice in one lookup: a call per entry, as the torch path sums each
            # entry's row gradients apart (autograd then adds the entries' sums).
            together = len({m.name for m in members}) == len(members)
            for call in [list(range(len(idx)))] if together else [[j] for j in range(len(idx))]:
                partial = PoolUnitAtOwner.apply(weight, [entries[j] for j in call], prediction)
                assert isinstance(partial, torch.Tensor)
                self.native_pool_calls += 1
                sizes = [entries[j].lengths_B.numel() for j in call]
                for j, part in zip(call, partial.split(sizes) if len(call) > 1 else [partial],
                                   strict=True):
                    parts[idx[j]] = part
        return [parts[i] for i in range(len(pool_e))]

    def _fetch_local(self, plan: InputDist) -> list[torch.Tensor]:
        """World size 1: every entry from the rows in place, one gather per unit."""
        local = list(plan.flat)
        plain_e = [e for e, o in enumerate(plan.offsets) if o is None]
        if plain_e:
            rows, _ = self._gather_tables([plan.names[e] for e in plain_e],
                                          [plan.flat[e] for e in plain_e])
            for e, rows_ND in zip(plain_e, rows, strict=True):
                local[e] = rows_ND
        for e, (offsets_B, mode) in enumerate(zip(plan.offsets, plan.modes, strict=True)):
            if offsets_B is not None:
                local[e] = self._local_bags(plan.names[e], plan.flat[e],
                                            offsets_B.to(self.device), str(mode))
        return local

    def stage(self, plans: Sequence[InputDist]) -> None:
        """Hand over input dists computed ahead (worker/train/pipeline.py): a lookup whose names, id
        tensors and bag offsets (by identity) match one uses it instead of running stages
        1-2 itself."""
        self._staged = {_plan_key(p.names, p.ids, p.offsets): p for p in plans}

    def unstage(self) -> int:
        """Drop what the step did not use; returns how many (0 when the plan matched)."""
        left, self._staged = len(self._staged), {}
        return left

    def _plan_for(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                  bags: Sequence[Bag | None]) -> InputDist:
        offsets = tuple(None if b is None else b[0] for b in bags)
        plan = (self._staged.pop(_plan_key(names, ids, offsets), None) if self._staged
                else None)
        if (plan is not None and all(a is b for a, b in zip(plan.ids, ids, strict=True))
                and all(a is b for a, b in zip(plan.offsets, offsets, strict=True))
                and plan.modes == tuple(None if b is None else b[1] for b in bags)):
            return plan
        return self.input_dist(names, ids, bags=bags)

    def lookup(self, name: str, ids_N: torch.Tensor) -> torch.Tensor:
        """Plain lookup: ids of any shape S -> rows of shape S + (dim,)."""
        return self.lookup_many([name], [ids_N])[0]

    def lookup_bag(self, name: str, ids_N: torch.Tensor, offsets_B: torch.Tensor,
                   mode: str = "sum") -> torch.Tensor:
        """Pooled bags like nn.EmbeddingBag: flat ids_N, bag b = ids[offsets[b]:offsets[b+1]]."""
        return self.lookup_many([name], [ids_N], [(offsets_B, mode)])[0]

    def lookup_many(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                    bags: Sequence[Bag | None] | None = None) -> list[torch.Tensor]:
        """Lookups of several tables of one width in ONE exchange per stage (like a KJT
        carries many features); entry t of `bags`, when given and not None, is (offsets_B,
        mode): table t is pooled like lookup_bag. Same rows and gradients as the separate
        lookups. For models with several tables (DLRM: 26 a step; the default job: 4)."""
        if len(names) != len(ids) or (bags is not None and len(bags) != len(names)):
            raise ValueError(f"{len(names)} table names but {len(ids)} id tensors"
                             + ("" if bags is None else f" and {len(bags)} bag entries"))
        dims = {self.tables[n].dim for n in names}
        if len(dims) > 1:
            raise ValueError(f"lookup_many needs tables of one width, got dims {sorted(dims)}")
        entries = list(bags) if bags is not None else [None] * len(names)
        for t, bag in enumerate(entries):
            if bag is not None:
                _check_bag(ids[t], bag[0], bag[1])
        if self.recording is not None:  # worker/train/pipeline.py (a dynamic table: its raw ids)
            self.recording.append((tuple(names), tuple(ids), tuple(entries)))
        if self.dynamic is not None and any(n in self.dynamic.tables for n in names):
            # stage 0: raw ids -> slots; the slots then go the static way
            return self.dynamic.lookup_many(names, ids, entries, self._lookup_static)
        return self._lookup_static(names, ids, entries)

    def _lookup_static(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                       entries: Sequence[Bag | None]) -> list[torch.Tensor]:
        plan = self._plan_for(names, ids, entries)
        out = self.fetch(plan)
        return [rows if bag is not None else rows.reshape(*ids_N.shape, rows.shape[-1])
                for rows, ids_N, bag in zip(out, ids, entries, strict=True)]

    def prefetch(self, step: int, names: Sequence[str], ids: Sequence[torch.Tensor]) -> None:
        """Hand over the ids that the first lookup of dynamic tables at `step` (the next
        one) will pass, after this step's last lookup: their translation to slots runs
        while this step finishes (worker/embedding/dynamic/prefetch.py). Tables that are not dynamic
        need none."""
        if self.dynamic is None:
            raise ValueError(f"prefetch: no dynamic table among {list(names)}")
        self.dynamic.prefetch(step, names, ids)

    def begin_step(self, step: int, applied_through: int) -> None:
        """Before the forward of `step` (the staleness window): the updates of steps <=
        applied_through are in the rows (dynamic tables evict only such rows)."""
        if self.dynamic is not None:
            self.dynamic.begin_step(step, applied_through)

    def set_pager(self, pager: RowPager) -> None:
        """Where dynamic tables page their evicted rows out to (the update source)."""
        if self.dynamic is not None:
            self.dynamic.set_pager(pager)

    def offset_rows(self, offsets: RowOffsets | None) -> None:
        """What every forward from now on adds to the rows it gathers (None: the stored rows
        as they are): worker/updates/staleness.py's prediction of the missing updates."""
        self.row_offsets = offsets

    def record_lookups(self) -> None:
        """Keep (names, id tensors, bags) of every lookup from now on, until
        `take_recording` (worker/train/pipeline.py learns its input-dist plan so)."""
        self.recording = []

    def take_recording(self) -> list[Lookup] | None:
        """The lookups recorded since `record_lookups` (None: none was asked for); the
        recording stops."""
        recording, self.recording = self.recording, None
        return recording

    def local_block(self, name: str) -> tuple[int, torch.Tensor]:
        """(start, rows_RD): the rows this rank owns, [start, start + R), differentiable.

        Local (no collective): for work sharded by row range, e.g. scoring every query
        against the owned entity rows (KvsAll). The gradient reaches `weights[name]` as a
        sparse gradient over the owned rows, like a lookup's, so `pop_grads` hands it to the
        sparse optimizer together with the lookups' row gradients.
        """
        unit, member = self.unit_of[name]
        local_R = torch.arange(member.offset, member.offset + member.rows, device=self.device)
        return member.start, self._gather(unit.name, local_R, whole=not unit.grouped)

    def owner_pool(self) -> dict[str, object]:
        """The kernel of bags pooled at their owner (hybridps/pooled_bags.py) and how many
        native calls it made, for --results."""
        return {"kernel": pooled_bags.pool_kernel_name(), "native_calls": self.native_pool_calls}

    def describe(self) -> dict[str, object]:
        """--pool-at, the bags it pooled at their owner (table names) and each table's
        scheme and the ranks owning its rows, for --results."""
        owner = sorted({n for (names, _), pooled in self._pool_choice.items()
                        for n, p in zip(names, pooled, strict=True) if p}
                       | {n for (_, names, pooled) in self._caps
                          for n, p in zip(names, pooled, strict=True) if p})
        sharding = {}
        for t in self.tables.values():
            scheme = self.schemes[t.name]
            sharding[t.name] = {"scheme": scheme.name,
                                "ranks": scheme.ranks(t.num_rows, self.world_size)}
        return {"pool_at": self.pool_at, "pooled_at_owner": owner, "sharding": sharding}
