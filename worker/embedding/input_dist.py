"""Stages 1-2 of a lookup (the input dist): who serves which ids, and in what layout.

A lookup of E entries (tables, each looked up plain or as bags) is served in one of two
ways per entry, each table sharded by its scheme (worker/embedding/sharding.py: rank r owns
rows [cuts[r], cuts[r+1]), possibly none; row-wise: cuts r*R//W, found by a division):

- rows: the requester dedupes its ids; the owner gathers each distinct row once per
  requester and the rows travel back (U x D); the requester expands or pools them.
  Every plain lookup, and a bag whose distinct ids move fewer bytes than its bags.
- pooled at the owner (bags only): the requester sends each owner its part of every bag
  (the ids it owns, in bag order, and how many of each bag); the owner sums them
  (`PoolAtOwner`) and the partial sums travel back (B x D from every owner), where the
  requester adds them and, for mean, divides by the bag's length. Backward is the same
  shape: each owner gets the gradient of its partial sums and scatters it to its rows.

Stage 1 (`Requests`) runs on the requester and needs no communication; stage 2 is ONE
`worker.embedding.comm.exchange_blocks` (counts and ids of all entries in one all_to_all); the
owner then lays out what it received (`OwnerWork`), and for the torch path dedupes each
pooled entry (`OwnerPool`; the owner's fused kernel, `PoolUnitAtOwner` over
hybridps/pooled_bags.py, dedupes in its own call at stage 3 instead). Both depend on the
ids and the bag offsets only, never on the rows, so they may run ahead of the step
(worker/train/pipeline.py).

Layout of the block a requester sends owner r: the distinct local row ids it asks of r
for the rows entries (sorted by entry, then id), then for each pooled entry the B bag
lengths (ids of that bag r owns) and those ids (bag order). The header row gives the
sizes: one count per rows entry, then (B, ids) per pooled entry. What comes back from
owner r: its rows for the rows entries (in the order asked), then B partial sums per
pooled entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hybridps import pooled_bags
from worker.runtime.device_copy import to_device

ID_BITS = 40  # table rows below 2**40 (the routing key packs a local id into fewer bits)
ID_MASK = (1 << ID_BITS) - 1


def owner_of(ids_N: torch.Tensor, num_rows: int | torch.Tensor, world_size: int
             ) -> torch.Tensor:
    """owner_N: the rank owning each id of a table of `num_rows` rows (an int, or one per id).

    ((id + 1) * W - 1) // R is the largest r with r * R // W <= id, i.e. row_range's
    owner, with no search: r * R // W <= id  <=>  r * R < (id + 1) * W."""
    return ((ids_N + 1) * world_size - 1) // num_rows


def owner_local(ids_N: torch.Tensor, sizes: Sequence[int], cuts: Sequence[Sequence[int]],
                world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner_N, local_N) of the ids of entries side by side (`sizes` ids each), entry e's
    table cut at cuts[e] (W + 1 points): the owner is the last r with cuts[r] <= id, the
    local id id - cuts[owner].

    Where every table is row-wise (cuts r*R//W: owner_of's division) or whole on one rank
    (its local ids are its ids), arithmetic on the ids: a division, a select. Otherwise ONE
    bucketize for all entries: entry e's ids are shifted by the rows of the tables before
    it (base_e) and so are its cuts, every cut of an earlier table is then <= the shifted
    id and none of a later one, so the bucket is e W + owner."""
    device, num = ids_N.device, ids_N.numel()
    rows = [c[-1] for c in cuts]
    whole = [_whole_on(c) for c in cuts]
    if all(w is not None or list(c) == [r * n // world for r in range(world + 1)]
           for c, n, w in zip(cuts, rows, whole, strict=True)):
        sizes_T = to_device(torch.tensor(list(sizes)), device)
        if len(set(rows)) == 1:
            rows_N: torch.Tensor | int = rows[0]
        else:
            rows_N = torch.repeat_interleave(to_device(torch.tensor(rows), device), sizes_T,
                                             output_size=num)
        owner_N = owner_of(ids_N, rows_N, world)
        local_N = ids_N - owner_N * rows_N // world
        if any(w is not None for w in whole):
            fixed_N = torch.repeat_interleave(
                to_device(torch.tensor([-1 if w is None else w for w in whole]), device),
                sizes_T, output_size=num)
            is_whole_N = fixed_N >= 0
            owner_N = torch.where(is_whole_N, fixed_N, owner_N)
            local_N = torch.where(is_whole_N, ids_N, local_N)
        return owner_N, local_N
    bases = [0]
    for n in rows[:-1]:
        bases.append(bases[-1] + n)
    shifted = to_device(torch.tensor([[b + x for x in c] for b, c in zip(bases, cuts,
                                                                          strict=True)],
                                     dtype=torch.int64), device)  # E x (W + 1)
    base_N = torch.repeat_interleave(to_device(torch.tensor(bases, dtype=torch.int64), device),
                                     to_device(torch.tensor(list(sizes)), device),
                                     output_size=num)
    global_N = ids_N + base_N
    bucket_N = torch.bucketize(global_N, shifted[:, 1:].reshape(-1), right=True)
    return bucket_N % world, global_N - shifted[:, :-1].reshape(-1).index_select(0, bucket_N)


def _whole_on(cuts: Sequence[int]) -> int | None:
    """The rank owning every row of a table cut at `cuts` (its rows then start at 0)."""
    owners = [r for r in range(len(cuts) - 1) if cuts[r + 1] > cuts[r]]
    return owners[0] if len(owners) == 1 else None


def transpose_blocks(counts_AB: torch.Tensor, total: int) -> torch.Tensor:
    """index with out = x.index_select(0, index): x holds blocks (a, b) a-major (block (a, b)
    has counts_AB[a, b] elements, `total` in all: known on the host, so none is read from
    the device), out holds the same blocks b-major."""
    flat = counts_AB.reshape(-1)
    start_AB = (torch.cumsum(flat, 0) - flat).view(counts_AB.shape)
    counts_BA = counts_AB.t().reshape(-1)
    start_BA = torch.cumsum(counts_BA, 0) - counts_BA
    shift = start_AB.t().reshape(-1) - start_BA
    return (torch.arange(total, device=counts_AB.device)
            + torch.repeat_interleave(shift, counts_BA, output_size=total))


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


NUMPY_SORT_MIN = 4096  # fewer values: torch's one call costs less than numpy's few
SMALL_BOUND = 1 << 15  # values below it sort as int16 (numpy: a radix sort)


def _numpy_sort(values_N: torch.Tensor, bound: int) -> int:
    """Position bits for sort_stable's packed keys, or 0: take torch's sort."""
    num = values_N.numel()
    bits = max(num - 1, 1).bit_length()
    if (num < NUMPY_SORT_MIN or values_N.device.type != "cpu"
            or max(bound - 1, 1).bit_length() + bits > 63):
        return 0
    return bits


def sort_stable(values_N: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_N, order_N): values_N[order_N] == sorted_N, equal values in position order.

    values_N: int64 in [0, bound). On the CPU, from NUMPY_SORT_MIN values on, one numpy
    sort of the packed keys (value << bits(N)) | position: numpy's int64 sort (vectorized)
    took 0.15-0.2 ms for 20k ids on this project's 2-core test VM where torch.sort took
    0.7-4 ms (docs/performance-log.md); otherwise torch.sort(stable=True)."""
    bits = _numpy_sort(values_N, bound)
    if not bits:
        return torch.sort(values_N, stable=True)
    if bound <= SMALL_BOUND:  # e.g. owners: numpy's stable sort of int16 is a radix sort
        order = np.argsort(values_N.numpy().astype(np.int16), kind="stable")
        return values_N[torch.from_numpy(order)], torch.from_numpy(order)
    keys = np.sort((values_N.numpy() << bits) | np.arange(values_N.numel(), dtype=np.int64))
    return torch.from_numpy(keys >> bits), torch.from_numpy(keys & ((1 << bits) - 1))


def unique_inverse(values_N: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.unique(values_N, sorted=True, return_inverse=True), with sort_stable's sort."""
    if not _numpy_sort(values_N, bound):
        return torch.unique(values_N, sorted=True, return_inverse=True)
    uniq_U, inverse_N, _, _ = unique_runs(values_N, bound)
    return uniq_U, inverse_N


def unique_runs(values_N: torch.Tensor, bound: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uniq_U, inverse_N, order_N, runs_U): uniq_U sorted distinct values, values_N ==
    uniq_U[inverse_N] (torch.unique(sorted=True, return_inverse=True)), order_N the stable
    sorting order and runs_U how many of each value (return_counts)."""
    sorted_N, order_N = sort_stable(values_N, bound)
    if _numpy_sort(values_N, bound):  # numpy's small ops cost a fraction of torch's here
        s, o = sorted_N.numpy(), order_N.numpy()
        first = np.empty(s.size, dtype=bool)
        first[0] = True
        np.not_equal(s[1:], s[:-1], out=first[1:])
        inverse = np.empty(s.size, dtype=np.int64)
        inverse[o] = np.cumsum(first) - 1
        runs = np.diff(np.flatnonzero(first), append=s.size)
        return (torch.from_numpy(s[first]), torch.from_numpy(inverse), order_N,
                torch.from_numpy(runs))
    first_N = torch.ones_like(sorted_N, dtype=torch.bool)
    torch.ne(sorted_N[1:], sorted_N[:-1], out=first_N[1:])
    uniq_U = sorted_N[first_N]
    rank_N = torch.cumsum(first_N, 0) - 1
    inverse_N = torch.empty_like(values_N).index_copy_(0, order_N, rank_N)
    runs_U = torch.diff(torch.nonzero(first_N).flatten(),
                        append=sorted_N.new_full((1,), sorted_N.numel()))
    return uniq_U, inverse_N, order_N, runs_U


@dataclass
class OwnerPool:
    """A pooled entry at its owner: the ids every requester sent (requester order), deduped,
    and the bag structure both ways.

    Forward pools rows_U (the distinct rows) with inverse_M into bags (offsets_B); backward
    sums each distinct row's bag gradients in one gather-sum (bags_by_row_M: the bag of
    every received id, grouped by row; row_starts_U: where each row's group starts), so
    the owner's gradient is coalesced when made, not sorted after backward."""

    uniq_U: torch.Tensor
    inverse_M: torch.Tensor
    offsets_B: torch.Tensor
    bags_by_row_M: torch.Tensor
    row_starts_U: torch.Tensor

    @classmethod
    def build(cls, ids_M: torch.Tensor, lengths_B: torch.Tensor, bound: int) -> OwnerPool:
        """ids_M: the local rows received, in [0, bound); lengths_B: the bags' lengths."""
        uniq_U, inverse_M, order_M, runs_U = unique_runs(ids_M, bound)
        num, device = ids_M.numel(), ids_M.device
        bag_M = torch.repeat_interleave(torch.arange(lengths_B.numel(), device=device),
                                        lengths_B, output_size=num)
        return cls(uniq_U, inverse_M, _exclusive_cumsum(lengths_B),
                   bag_M.index_select(0, order_M), _exclusive_cumsum(runs_U))

    def tensors(self) -> list[torch.Tensor]:
        return [self.uniq_U, self.inverse_M, self.offsets_B, self.bags_by_row_M,
                self.row_starts_U]


class PoolAtOwner(torch.autograd.Function):
    """Sum-pool an owner's rows into the bags it was sent; the gradient of `weight` is a
    coalesced sparse tensor over the distinct rows.

    rows_UD: the rows of pool.uniq_U as the dense model sees them (cast from the row dtype,
    plus any staleness prediction: worker/updates/staleness.py), computed without autograd: they
    are `weight`'s rows plus constants, so their gradient is the weight rows' gradient.
    rows_U: where those rows are in `weight` (None: pool.uniq_U; a table of a group's
    block: pool.uniq_U + the table's offset, worker/embedding/groups.py)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, rows_UD: torch.Tensor, pool: OwnerPool,
                rows_U: torch.Tensor | None = None) -> torch.Tensor:
        ctx.pool, ctx.shape, ctx.dtype = pool, weight.shape, weight.dtype
        ctx.rows_U = pool.uniq_U if rows_U is None else rows_U
        return F.embedding_bag(pool.inverse_M, rows_UD, pool.offsets_B, mode="sum")

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        pool: OwnerPool = ctx.pool
        grad_UD = F.embedding_bag(pool.bags_by_row_M, grads[0].contiguous(),
                                  pool.row_starts_U, mode="sum")
        grad = torch.sparse_coo_tensor(ctx.rows_U.unsqueeze(0), grad_UD.to(ctx.dtype),
                                       ctx.shape, is_coalesced=True, check_invariants=False)
        return grad, None, None, None


class PoolUnitAtOwner(torch.autograd.Function):
    """PoolAtOwner for every pooled entry of one unit (worker/embedding/groups.py) in ONE native
    call each way (hybridps/pooled_bags.py): forward dedupes the ids received, gathers each
    distinct row with its weight prediction and sums the bags (entry after entry);
    backward sums each distinct row's bag gradients into a coalesced sparse gradient of
    `weight`. Bitwise OwnerPool.build + PoolAtOwner of each entry, the entries' tables
    being distinct (their rows do not overlap in the block).

    prediction: (keys_P, offset_PD) of the unit, worker/updates/staleness.py, or None."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, entries: Sequence[pooled_bags.BagsAtOwner],
                prediction: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        bags_BD, ctx.layout = pooled_bags.forward(weight, entries, prediction)
        ctx.shape, ctx.dtype = weight.shape, weight.dtype
        return bags_BD

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layout: pooled_bags.PoolLayout = ctx.layout
        grad_UD = pooled_bags.backward(layout, grads[0])
        grad = torch.sparse_coo_tensor(layout.uniq_U.unsqueeze(0), grad_UD.to(ctx.dtype),
                                       ctx.shape, is_coalesced=True, check_invariants=False)
        return grad, None, None


@dataclass
class Requests:
    """Stage 1 on the requester: the blocks to send and how to read what comes back."""

    header_WH: torch.Tensor     # per owner: count per rows entry, (B, ids) per pooled entry
    blocks: list[torch.Tensor]  # per owner: the block laid out as the module doc says
    inverse: list[torch.Tensor]  # per rows entry: its ids -> index into the distinct rows
    rows_from: list[int]         # rows + partial sums each owner sends back
    asked: list[int]             # per owner: distinct rows asked of it (rows entries)
    pooled_bags: list[int]       # per pooled entry: its bags (B partial sums per owner)


def make_requests(flat: Sequence[torch.Tensor], rows_E: Sequence[int],
                  rows_tensor_E: torch.Tensor, pooled: Sequence[bool],
                  offsets: Sequence[torch.Tensor | None], world: int,
                  cuts_E: Sequence[Sequence[int]] | None = None) -> Requests:
    """flat: each entry's ids (1-D int64, checked in range); rows_E: its table's rows;
    offsets: each pooled entry's bag offsets (into its ids); cuts_E: each entry's table's
    cut points (worker/embedding/sharding.py), None: every table row-wise."""
    device = rows_tensor_E.device
    sizes = [f.numel() for f in flat]
    rows_e = [e for e, p in enumerate(pooled) if not p]
    pool_e = [e for e, p in enumerate(pooled) if p]
    # a pooled entry's request in one native call where the kernel takes it
    native = {e: got for e in pool_e if (got := pooled_bags.requests(
        flat[e], offsets[e], rows_E[e], world,
        None if cuts_E is None else cuts_E[e])) is not None}
    torch_e = [e for e in range(len(flat)) if e not in native]  # owners computed here
    owner_N = local_N = flat[0].new_empty(0)
    owners: dict[int, torch.Tensor] = {}
    locals_: dict[int, torch.Tensor] = {}
    if torch_e:
        ids_N = torch.cat([flat[e] for e in torch_e]) if len(torch_e) > 1 else flat[torch_e[0]]
        split = [sizes[e] for e in torch_e]
        if cuts_E is not None:
            owner_N, local_N = owner_local(ids_N, split, [cuts_E[e] for e in torch_e], world)
        else:  # every table row-wise: a division, no search
            if len({rows_E[e] for e in torch_e}) == 1:
                rows_N: torch.Tensor | int = rows_E[torch_e[0]]
            else:
                rows_N = torch.repeat_interleave(
                    rows_tensor_E if len(torch_e) == len(flat) else rows_tensor_E[torch_e],
                    to_device(torch.tensor(split), device), output_size=ids_N.numel())
            owner_N = owner_of(ids_N, rows_N, world)
            local_N = ids_N - owner_N * rows_N // world
        owners = dict(zip(torch_e, owner_N.split(split), strict=True))
        locals_ = dict(zip(torch_e, local_N.split(split), strict=True))
    columns: list[torch.Tensor] = []  # header columns, W x 1 each
    inverse: list[torch.Tensor] = []
    rows_ids_U = owner_N.new_empty(0)
    if rows_e:
        num = len(rows_e)
        if rows_e == torch_e:
            owner_R, local_R = owner_N, local_N
        else:
            owner_R = torch.cat([owners[e] for e in rows_e])
            local_R = torch.cat([locals_[e] for e in rows_e])
        # key: (owner, entry, local id) in as few bits as the tables need, so the sort
        # packs its position next to it (sort_stable)
        shift = max((-(-rows_E[e] // world) if cuts_E is None else
                     max(b - a for a, b in itertools.pairwise(cuts_E[e])))
                    for e in rows_e).bit_length()
        keys_R = owner_R * num
        if num > 1:
            sizes_T = to_device(torch.tensor([sizes[e] for e in rows_e]), device)
            keys_R = keys_R + torch.repeat_interleave(
                torch.arange(num, device=device), sizes_T, output_size=owner_R.numel())
        unique_U, inverse_R = unique_inverse((keys_R << shift) | local_R,
                                             (world * num) << shift)
        counts_WT = torch.bincount(unique_U >> shift, minlength=world * num).view(world, num)
        columns.append(counts_WT)
        inverse = list(inverse_R.split([sizes[e] for e in rows_e]))
        rows_ids_U = unique_U & ((1 << shift) - 1)
    pooled_parts: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for e in pool_e:
        offsets_B = offsets[e]
        assert offsets_B is not None
        bags = offsets_B.numel()
        if e in native:
            local_sorted_M, lengths_WB, per_owner = native[e]
        else:
            owner_M, local_M = owners[e], locals_[e]
            lengths_B = torch.diff(offsets_B, append=offsets_B.new_full((1,), sizes[e]))
            bag_M = torch.repeat_interleave(torch.arange(bags, device=device), lengths_B,
                                            output_size=sizes[e])
            order_M = sort_stable(owner_M, world)[1]
            per_owner = torch.bincount(owner_M, minlength=world)
            lengths_WB = torch.bincount(owner_M * bags + bag_M, minlength=world * bags)
            local_sorted_M = local_M.index_select(0, order_M)
        pooled_parts.append((lengths_WB.view(world, bags), local_sorted_M, bags))
        columns += [per_owner.new_full((world, 1), bags), per_owner.view(world, 1)]
    header_WH = torch.cat(columns, dim=1) if columns else owner_N.new_zeros((world, 0))
    header = header_WH.tolist()  # inside the caller's sync point "input_dist"
    num_rows = len(rows_e)
    asked = [sum(h[:num_rows]) for h in header]
    rows_parts = rows_ids_U.split(asked)
    pool_splits = [part[1].split([h[num_rows + 2 * i + 1] for h in header])
                   for i, part in enumerate(pooled_parts)]
    blocks = []
    for r in range(world):
        pieces = [rows_parts[r]]
        for (lengths_WB, _, _), split in zip(pooled_parts, pool_splits, strict=True):
            pieces += [lengths_WB[r], split[r]]
        blocks.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    bags_P = [b for _, _, b in pooled_parts]
    return Requests(header_WH, blocks, inverse, [n + sum(bags_P) for n in asked], asked, bags_P)


@dataclass
class OwnerWork:
    """What an owner serves, laid out from the blocks it received (stage 2's end)."""

    local_ids: list[torch.Tensor]  # per rows entry: the local rows asked (requester order)
    # per pooled entry: the ids received (requester order) and every requester's bag lengths
    bags: list[tuple[torch.Tensor, torch.Tensor]]
    # per pooled entry, the torch path's dedupe, made here (ahead), or None where the
    # owner's fused kernel (PoolUnitAtOwner) dedupes in its own call
    pools: list[OwnerPool | None]
    rows_to: list[int]             # rows + partial sums each requester gets back
    restore: torch.Tensor | None   # entry-major results -> requester-major

    def pool(self, i: int, bound: int) -> OwnerPool:
        """Pooled entry i's dedupe for the torch path (made now if not made ahead)."""
        pool = self.pools[i]
        if pool is None:
            pool = self.pools[i] = OwnerPool.build(*self.bags[i], bound)
        return pool


def owner_work(header: list[list[int]], data: torch.Tensor, num_rows: int,
               pooled_rows: Sequence[int], dedupe: bool = True) -> OwnerWork:
    """header: per requester its header row; data: the blocks received, requester order;
    pooled_rows: per pooled entry, the rows this rank owns of its table; dedupe: make the
    torch path's OwnerPool of every pooled entry now."""
    num_pooled = len(pooled_rows)
    device = data.device
    inp = [h[:num_rows] + [h[num_rows + i] for i in range(2 * num_pooled)] for h in header]
    out = [h[:num_rows] + [h[num_rows + 2 * i] for i in range(num_pooled)] for h in header]
    columns = num_rows + 2 * num_pooled
    if columns > 1:  # requester-major -> entry-major, one gather
        data = data.index_select(0, transpose_blocks(to_device(torch.tensor(inp), device),
                                                     sum(map(sum, inp))))
    parts = data.split([sum(col) for col in zip(*inp, strict=True)]) if columns else []
    bags = [(parts[num_rows + 2 * i + 1], parts[num_rows + 2 * i]) for i in range(num_pooled)]
    pools: list[OwnerPool | None] = [
        OwnerPool.build(ids_M, lengths_B, owned) if dedupe else None
        for (ids_M, lengths_B), owned in zip(bags, pooled_rows, strict=True)]
    restore = None
    if num_rows + num_pooled > 1:
        restore = transpose_blocks(to_device(torch.tensor(out), device).t().contiguous(),
                                   sum(map(sum, out)))
    return OwnerWork(list(parts[:num_rows]), bags, pools, [sum(o) for o in out], restore)


@dataclass
class InputDist:
    """Stages 1-2 of one lookup of E entries (E = 1 for lookup/lookup_bag).

    names, ids, offsets: the lookup's own tables, id tensors and bag offsets (identity is
    the staging key); modes: each entry's pooling (None: plain); pooled: served pooled at
    the owner. World size 1 (`direct`): the ids are only checked, the lookup reads the
    rows in place. Otherwise `requests` reads the answer and `work` is this rank's share
    as an owner."""

    names: tuple[str, ...]
    ids: tuple[torch.Tensor, ...]
    offsets: tuple[torch.Tensor | None, ...]
    modes: tuple[str | None, ...]
    pooled: tuple[bool, ...]
    flat: list[torch.Tensor]            # each entry's ids, 1-D int64 on the device
    divisors: list[torch.Tensor | None] = field(default_factory=list)  # pooled mean entries
    requests: Requests | None = None
    work: OwnerWork | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the plan holds (for CUDA stream bookkeeping)."""
        out = [*self.flat, *(d for d in self.divisors if d is not None)]
        if self.requests is not None:
            out += [*self.requests.inverse]
        if self.work is not None:
            out += [*self.work.local_ids, *(t for b in self.work.bags for t in b),
                    *(t for p in self.work.pools if p is not None for t in p.tensors())]
            out += [] if self.work.restore is None else [self.work.restore]
        return out
