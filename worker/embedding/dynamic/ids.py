"""Stage 0 of a lookup of a dynamic table: raw ids -> slots, at their owners.

    raw ids ──dedupe, owner = mix64(id) % W──► a2a ─► owner: SlotTable.translate
                                                       (admit, evict, page in/out)
            ◄──────────── a2a: a slot per id (-1: refused) ◄─┘
    then the static path on slots (input_dist -> lookup -> output_dist), and the
    refused positions read zeros (no gradient reaches any row for them).

`DynamicIds` holds this rank's `SlotTable` per dynamic table (its share of the slots,
worker/embedding/dynamic/slots.py) and moves rows when a slot changes hands: the evicted rows
(exact: the pin rule leaves no update pending for them) go to the `RowPager` with their
ids, the returning ids' rows come back from it, and new ids get their initial rows
(hybridps/dynamic.py `initial_rows`). The pager (the shard client, or the local
optimizer) moves the optimizer state of those rows itself (one call per table and step
that evicts or pages in).

A lookup without autograd (evaluation) changes nothing: ids on a slot read it, paged-out
ids read their stored row (the pager's `peek`), unknown ids read zeros.

Every rank must run the same lookups in the same order (collectives); world size 1 has
none. Shapes: `_N` ids of an entry, `_U` distinct ids, `_M` ids an owner received.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from hybridps.cli import ConfigError
from hybridps.dynamic import DynamicSpec, check_capacity, initial_rows, owner_of_ids
from hybridps.native import dynamic as _ext
from hybridps.paged_rows import PagedOut, PagedRows
from worker.embedding.comm import BlockCap, exchange, exchange_blocks
from worker.embedding.dynamic.fused import fusable, serve_fused
from worker.embedding.dynamic.prefetch import Prefetcher
from worker.embedding.dynamic.slots import PageAnswer, PageRequest, SlotTable
from worker.runtime.device_copy import sync_point, to_device

if TYPE_CHECKING:
    from hybridps.dynamic_files import DynamicRestore

PAGED = -2  # an evaluation's code for an id whose row comes from the paged store

Bag = tuple[torch.Tensor, str]
StaticLookup = Callable[[Sequence[str], Sequence[torch.Tensor], Sequence[Bag | None]],
                        list[torch.Tensor]]
Translated = tuple[list[torch.Tensor], list[torch.Tensor | None]]
Expiry = list[Callable[[], None]]  # a prefetched step's store expiry, run at its lookup


class RowPager(Protocol):
    """Where a dynamic table's evicted rows go, with their optimizer state (the shard
    client: the node's server; the local optimizer: host memory)."""

    def page(self, table: str, step: int, out: PagedOut, out_slots: torch.Tensor,
             in_ids: torch.Tensor, in_slots: torch.Tensor, expire_steps: int,
             counters: Mapping[str, int] | None = None
             ) -> tuple[torch.Tensor, PagedOut, np.ndarray]:
        """Evict rows `out` (their optimizer state taken from global slots `out_slots`,
        `out.state` is filled here), then bring `in_ids` onto global slots `in_slots`
        (their state put there). Returns (found per in id, the found entries in order, ids
        dropped from the store)."""
        ...

    def peek_paged(self, table: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(found per id, their stored rows) without moving anything."""
        ...

    def local_store(self, table: str) -> tuple[PagedRows, Mapping[str, torch.Tensor]] | None:
        """(the store, the optimizer state of the slots by name) when both are in this
        process (the step may then move rows itself: worker/embedding/dynamic/fused.py), else
        None."""
        ...


@dataclass
class DynamicTable:
    name: str
    dim: int
    spec: DynamicSpec
    slots: SlotTable
    table_index: int


class DynamicIds:
    """This rank's side of every dynamic table (module doc)."""

    def __init__(self, tables: Sequence[tuple[str, int, int, DynamicSpec, int]],
                 ranges: dict[str, tuple[int, int]], *, rank: int, world_size: int,
                 group: dist.ProcessGroup | None, device: torch.device, seed: int,
                 init_std: float, rows_of: Callable[[str], torch.Tensor],
                 whole_on: dict[str, int] | None = None) -> None:
        self.rank, self.world_size, self.group, self.device = rank, world_size, group, device
        # table-wise tables: the rank holding all their slots, every id's owner
        self.whole_on = whole_on or {}
        self.seed, self.init_std, self.rows_of = seed, init_std, rows_of
        self.tables: dict[str, DynamicTable] = {}
        for name, _capacity, dim, spec, index in tables:
            start, end = ranges[name]
            self.tables[name] = DynamicTable(name, dim, spec, SlotTable(
                name, spec, start, end - start, seed=seed, table_index=index), index)
        self.pager: RowPager | None = None
        self.fused = _ext is not None  # worker/embedding/dynamic/fused.py where it can run
        self.step = 0
        self.applied_through = -1
        # 1 once ids are prefetched: a step's translation also pins the previous step's
        # slots (worker/embedding/dynamic/prefetch.py), ahead or not
        self.pin_lag = 0
        self.prefetched: Prefetcher[tuple[Translated, Expiry]] = Prefetcher()
        self._caps: dict[tuple[str, ...], BlockCap] = {}

    def set_pager(self, pager: RowPager) -> None:
        """Where evicted rows go; a store in this process also holds the set of paged ids
        (SlotTable.share_paged: one map of them, not two)."""
        self.pager = pager
        for table in self.tables.values():
            local = pager.local_store(table.name)
            if local is not None:
                table.slots.share_paged(local[0])

    def begin_step(self, step: int, applied_through: int) -> None:
        """Before the forward of `step`: updates <= applied_through are in the rows."""
        self.step, self.applied_through = step, applied_through

    def expect_prefetch(self) -> None:
        """From now on a step's translation pins the previous step's slots too, as a
        prefetched one must (worker/embedding/dynamic/prefetch.py); `prefetch` sets it at its first
        call, a loop that prefetches from its second step on sets it before the first."""
        self.pin_lag = 1

    def prefetch(self, step: int, names: Sequence[str], ids: Sequence[torch.Tensor]) -> None:
        """Start translating, on a helper thread, the ids that the first lookup of dynamic
        tables at `step` = this step + 1 will pass (worker/embedding/dynamic/prefetch.py); call it
        after this step's last lookup. Where no helper thread can (world size > 1, rows on
        a device, the store on a server), the step translates at its lookup as before."""
        if step != self.step + 1:
            raise ValueError(f"prefetch(step={step}): the next step is {self.step + 1}")
        dyn = [e for e, n in enumerate(names) if n in self.tables]
        if not dyn:
            raise ValueError(f"prefetch: none of {list(names)} is a dynamic table")
        self.expect_prefetch()
        dyn_names = [names[e] for e in dyn]
        if self.world_size > 1 or any(self._fused_parts(self.tables[n]) is None
                                      for n in dyn_names):
            return  # (its collectives and the pager's calls belong to the training thread)
        flat = [ids[e].reshape(-1).to(torch.int64).cpu().clone() for e in dyn]
        # the slots of this step and later stay pinned: applied_through is this step's
        at = (step, self.applied_through)

        def work() -> tuple[Translated, Expiry]:
            expiry: Expiry = []
            return self._translate(dyn_names, flat, True, at, expiry), expiry

        self.prefetched.submit(step, dyn_names, flat, work)

    # -- the lookup ---------------------------------------------------------------------
    def lookup_many(self, names: Sequence[str], ids: Sequence[torch.Tensor],
                    bags: Sequence[Bag | None], static: StaticLookup) -> list[torch.Tensor]:
        """ShardedEmbedding.lookup_many with dynamic tables among `names` (module doc)."""
        train = torch.is_grad_enabled()
        dyn = [e for e, n in enumerate(names) if n in self.tables]
        with sync_point("dynamic_ids"):  # the id -> slot maps are on the host
            flat = [ids[e].reshape(-1).to(torch.int64).cpu() for e in dyn]
            dyn_names = [names[e] for e in dyn]
            ahead = None
            if train:
                ahead = self.prefetched.take(self.step, dyn_names, flat)
            else:  # an evaluation reads the maps: not while a prefetch writes them
                self.prefetched.wait()
            if ahead is not None:
                (codes, paged_rows), expiry = ahead
                for expire in expiry:
                    expire()
            else:
                codes, paged_rows = self._translate(
                    dyn_names, flat, train, (self.step, self.applied_through - self.pin_lag))
        call_ids = list(ids)
        call_bags = list(bags)
        keep: dict[int, np.ndarray] = {}
        for e, code_N in zip(dyn, codes, strict=True):
            host_N = code_N.numpy()  # on the host: its reads wait for no device
            if (host_N >= 0).all():  # the common case: exactly the static path
                call_ids[e] = to_device(code_N, self.device).view(ids[e].shape)
                continue
            kept_N = host_N >= 0
            keep[e] = kept_N
            call_ids[e] = to_device(torch.from_numpy(host_N[kept_N]), self.device)
            bag = bags[e]
            if bag is not None:  # each bag's start among the kept ids
                before_N1 = np.concatenate([np.cumsum(kept_N) - kept_N, [kept_N.sum()]])
                call_bags[e] = (to_device(torch.from_numpy(before_N1), self.device)
                                .index_select(0, bag[0].to(self.device)), "sum")
        out = static(names, call_ids, call_bags)
        for pos, e in enumerate(dyn):
            if e not in keep:
                continue
            out[e] = self._fill(out[e], codes[pos].numpy(), keep[e], ids[e], bags[e],
                                paged_rows[pos])
        return out

    def _fill(self, got: torch.Tensor, code_N: np.ndarray, kept_N: np.ndarray,
              ids: torch.Tensor, bag: Bag | None, paged_PD: torch.Tensor | None
              ) -> torch.Tensor:
        """The entry's result with zeros for refused ids (and stored rows for paged ones);
        `code_N` and `kept_N` on the host."""
        n = code_N.size
        where_K = to_device(torch.from_numpy(np.flatnonzero(kept_N)), self.device)
        paged = np.flatnonzero(code_N == PAGED)
        paged_P = to_device(torch.from_numpy(paged), self.device)
        if bag is None:
            rows_ND = got.new_zeros((n, got.shape[-1])).index_copy(
                0, where_K, got.reshape(-1, got.shape[-1]))
            if paged_PD is not None and paged.size:
                rows_ND = rows_ND.index_copy(0, paged_P, paged_PD.to(rows_ND))
            return rows_ND.view(*ids.shape, got.shape[-1])
        offsets_B, mode = bag[0].to(self.device), bag[1]
        bags_BD = got
        if paged_PD is not None and paged.size:
            bag_P = torch.searchsorted(offsets_B, paged_P, right=True) - 1
            bags_BD = bags_BD.index_add(0, bag_P, paged_PD.to(bags_BD))
        if mode == "mean":
            lengths_B = torch.diff(offsets_B, append=offsets_B.new_full((1,), n))
            bags_BD = bags_BD / lengths_B.clamp(min=1).to(bags_BD.dtype).unsqueeze(1)
        return bags_BD

    # -- ids -> slots ---------------------------------------------------------------------
    def _translate(self, names: list[str], flat: list[torch.Tensor], train: bool,
                   at: tuple[int, int], expire_later: Expiry | None = None) -> Translated:
        """Per entry: a code per id (a global slot, -1 zeros, PAGED) and, in evaluation, the
        stored rows of its PAGED ids (in order). `at`: (step, evict only slots seen at or
        before this step); `expire_later`: serve_fused's."""
        uniq, inverse = [], []
        for ids_N in flat:
            u_U, inv_N = _first_seen_unique(ids_N)
            uniq.append(u_U)
            inverse.append(inv_N)
        if self.world_size == 1:
            answers = [self._serve(n, u.numpy(), train, at, expire_later)
                       for n, u in zip(names, uniq, strict=True)]
            codes_U = [torch.from_numpy(a[0]) for a in answers]
            rows_U = [a[1] for a in answers]
        else:
            codes_U, rows_U = self._exchange(names, uniq, train, at)
        codes: list[torch.Tensor] = []
        paged: list[torch.Tensor | None] = []
        for c_U, inv_N, r in zip(codes_U, inverse, rows_U, strict=True):
            code_N = c_U.index_select(0, inv_N)
            codes.append(code_N)
            if r is None or r.numel() == 0:
                paged.append(None)
                continue
            # stored rows of the distinct paged ids, in order -> one per PAGED position
            rank_U = torch.cumsum(c_U == PAGED, 0) - 1
            paged.append(r.index_select(0, rank_U.index_select(0, inv_N)[code_N == PAGED]))
        return codes, paged

    def _serve(self, name: str, ids_U: np.ndarray, train: bool, at: tuple[int, int],
               expire_later: Expiry | None = None) -> tuple[np.ndarray, torch.Tensor | None]:
        """At the owner: the codes of distinct ids (in order) and, evaluating, the stored
        rows of the PAGED ones."""
        table = self.tables[name]
        slots = table.slots
        if train:
            step, evict_through = at
            fused = self._fused_parts(table)
            if fused is not None:
                return serve_fused(slots, *fused, ids_U, step, evict_through,
                                   seed=self.seed, table_index=table.table_index,
                                   init_std=self.init_std,
                                   expire_steps=table.spec.expire_steps,
                                   expire_later=expire_later), None
            codes, request = slots.translate(ids_U, step, evict_through,
                                             self._pager_for(table, step))
            self._fresh_rows(table, request.new_slots, request.new_ids)
            return codes, None
        local = slots.find(ids_U)
        ahead = self.prefetched.pending_step
        if ahead is not None:  # ids new at the prefetched step read zeros, as before it
            on = np.flatnonzero(local >= 0)
            fresh = on[(slots.seen[local[on]] == ahead) & (slots.freq[local[on]] == 1)]
            local[fresh] = -1
        codes = np.where(local >= 0, local + slots.start, -1)
        missing = np.flatnonzero(local < 0)
        rows = None
        if missing.size and self.pager is not None:
            paged = missing[slots.is_paged(ids_U[missing])]
            if paged.size:
                found, rows = self.pager.peek_paged(name, torch.from_numpy(ids_U[paged]))
                codes[paged[found.numpy()]] = PAGED
        return codes, rows

    def _fused_parts(self, table: DynamicTable) -> tuple[
            PagedRows, torch.Tensor, Mapping[str, torch.Tensor]] | None:
        """(store, rows, optimizer state) for worker/embedding/dynamic/fused.py's one-call step when
        the pager's store is in-process and the tensors allow it, else None."""
        if not self.fused or self.pager is None:
            return None
        local = self.pager.local_store(table.name)
        if local is None:
            return None
        store, state = local
        weight = self.rows_of(table.name).data
        return (store, weight, state) if fusable(table.slots, store, weight, state) else None

    def _pager_for(self, table: DynamicTable, step: int
                   ) -> Callable[[PageRequest], PageAnswer]:
        def page(req: PageRequest) -> PageAnswer:
            if self.pager is None:
                raise RuntimeError(f"dynamic table {table.name!r}: no pager to evict to")
            weight = self.rows_of(table.name)
            start = table.slots.start
            out_local = torch.from_numpy(req.out_slots).to(self.device)
            out = PagedOut(torch.from_numpy(req.out_ids),
                           weight.data.index_select(0, out_local).float().cpu(), {},
                           torch.from_numpy(req.out_seen), torch.from_numpy(req.out_freq))
            found, got, dropped = self.pager.page(
                table.name, step, out, torch.from_numpy(req.out_slots + start),
                torch.from_numpy(req.in_ids), torch.from_numpy(req.in_slots + start),
                table.spec.expire_steps, self.counters(table))
            found_np = found.numpy().astype(bool)
            with torch.no_grad():
                back = torch.from_numpy(req.in_slots[found_np]).to(self.device)
                weight.data.index_copy_(0, back, got.rows.to(weight.device, weight.dtype))
            self._fresh_rows(table, req.in_slots[~found_np], req.in_ids[~found_np])
            return PageAnswer(found_np, got.seen.numpy(), got.freq.numpy(), dropped)
        return page

    def _fresh_rows(self, table: DynamicTable, local: np.ndarray, ids: np.ndarray) -> None:
        if local.size == 0:
            return
        weight = self.rows_of(table.name)
        rows = initial_rows(torch.from_numpy(ids), table.dim, seed=self.seed,
                            table_index=table.table_index, init_std=self.init_std)
        with torch.no_grad():
            weight.data.index_copy_(0, torch.from_numpy(local).to(self.device),
                                    rows.to(weight.device, weight.dtype))

    def _exchange(self, names: list[str], uniq: list[torch.Tensor], train: bool,
                  at: tuple[int, int]) -> Translated:
        """World size > 1: each entry's distinct ids to their owners (one exchange of all
        entries), the codes back (and, evaluating, the stored rows of PAGED ids)."""
        world = self.world_size
        owners = [owner_of_ids(u, world, self.whole_on.get(n))
                  for n, u in zip(names, uniq, strict=True)]
        orders = [torch.sort(o, stable=True)[1] for o in owners]
        counts_EW = torch.stack([torch.bincount(o, minlength=world) for o in owners])
        sent = [u.index_select(0, order) for u, order in zip(uniq, orders, strict=True)]
        per_owner = [s.split(c.tolist()) for s, c in zip(sent, counts_EW, strict=True)]
        blocks = [torch.cat([per_owner[e][r] for e in range(len(names))]) if names
                  else torch.empty(0, dtype=torch.int64) for r in range(world)]
        cap = self._caps.setdefault(tuple(names), BlockCap())
        header, data, lengths = exchange_blocks(counts_EW.t().contiguous(), blocks, cap,
                                                self.group)
        got = data.split(lengths)
        # at the owner: per entry, the ids of every source in source order
        reply_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        rows_parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for e, name in enumerate(names):
            pieces = [got[s].split(header[s])[e] for s in range(world)]
            ids_M = torch.cat(pieces)
            u_U, inv_M = _first_seen_unique(ids_M)
            codes_U, rows = self._serve(name, u_U.numpy(), train, at)
            codes_M = torch.from_numpy(codes_U).index_select(0, inv_M)
            for s, part in enumerate(codes_M.split([p.numel() for p in pieces])):
                reply_parts[s].append(part)
                if not train:  # the stored rows of this source's PAGED ids, in order
                    rows_parts[s].append(self._rows_for(codes_U, rows, inv_M, part, pieces,
                                                        s))
        reply = [torch.cat(p) if p else torch.empty(0, dtype=torch.int64)
                 for p in reply_parts]
        back = exchange(torch.cat(reply), [b.numel() for b in blocks],
                        [r.numel() for r in reply], self.group)
        answers = back.split([b.numel() for b in blocks])
        codes_out: list[torch.Tensor] = []
        for e, (u, order) in enumerate(zip(uniq, orders, strict=True)):
            parts = [answers[r].split(counts_EW[:, r].tolist())[e] for r in range(world)]
            code_U = torch.empty_like(u)
            code_U[order] = torch.cat(parts) if parts else code_U
            codes_out.append(code_U)
        rows_out: list[torch.Tensor | None] = [None] * len(names)
        if not train:
            rows_out = self._exchange_rows(names, uniq, orders, codes_out, rows_parts)
        return codes_out, rows_out

    def _rows_for(self, codes_U: np.ndarray, rows: torch.Tensor | None, inv_M: torch.Tensor,
                  part: torch.Tensor, pieces: list[torch.Tensor], source: int
                  ) -> torch.Tensor:
        dim = 0 if rows is None else int(rows.shape[1])
        if rows is None:
            return torch.empty(0, dim)
        rank_U = torch.from_numpy(np.cumsum(codes_U == PAGED) - 1)
        lo = sum(p.numel() for p in pieces[:source])
        inv = inv_M[lo:lo + part.numel()]
        return rows.index_select(0, rank_U.index_select(0, inv[part == PAGED]))

    def _exchange_rows(self, names: list[str], uniq: list[torch.Tensor],
                       orders: list[torch.Tensor], codes: list[torch.Tensor],
                       rows_parts: list[list[torch.Tensor]]) -> list[torch.Tensor | None]:
        """Evaluation: the stored rows of PAGED ids, from their owners (one exchange)."""
        world = self.world_size
        dim = self.tables[names[0]].dim
        send = [torch.cat([r.reshape(-1, dim) for r in parts]) if parts
                else torch.empty(0, dim) for parts in rows_parts]
        owners = [owner_of_ids(u, world, self.whole_on.get(n))
                  for n, u in zip(names, uniq, strict=True)]
        expect = [int(sum(int(((o == r) & (c == PAGED)).sum())
                          for o, c in zip(owners, codes, strict=True))) for r in range(world)]
        got = exchange(torch.cat(send), expect, [s.shape[0] for s in send], self.group)
        per_owner = list(got.split(expect))
        out: list[torch.Tensor | None] = []
        for u, order, c, o in zip(uniq, orders, codes, owners, strict=True):
            rows_U = torch.zeros(u.numel(), dim)
            sorted_codes = c.index_select(0, order)
            sorted_owner = o.index_select(0, order)
            for r in range(world):
                n = int(((sorted_owner == r) & (sorted_codes == PAGED)).sum())
                take, per_owner[r] = per_owner[r][:n], per_owner[r][n:]
                where = order[(sorted_owner == r) & (sorted_codes == PAGED)]
                rows_U[where] = take
            out.append(rows_U[c == PAGED])
        return out

    def slot_state(self, name: str, since: int | None = None) -> dict[str, Any]:
        """A checkpoint's state of table `name`'s slots (`since` S: only the slots changed
        since the checkpoint of step S, SlotTable.delta_state_dict); not while a
        prefetched step's translation is pending (it has taken slots for a step not
        trained yet: the trainer prefetches no step that follows a checkpoint)."""
        pending = self.prefetched.pending_step
        if pending is not None:
            raise RuntimeError(f"dynamic table {name!r}: step {pending}'s ids are prefetched; "
                               "save a checkpoint before prefetching or after that step")
        slots = self.tables[name].slots
        return slots.state_dict() if since is None else slots.delta_state_dict(since)

    def looked_up_since(self, name: str, since: int) -> np.ndarray:
        """bool per local slot of table `name`: looked up after step `since` (so its id,
        row or optimizer state may have changed since the checkpoint of that step)."""
        return self.tables[name].slots.seen > since

    @torch.no_grad()
    def load_slot_state(self, name: str, plan: DynamicRestore) -> None:
        """Resume table `name`'s slots from a checkpoint's restore plan (any world size:
        hybridps/dynamic_files.py); the rows of the slots whose id went to another owner
        are emptied."""
        table = self.tables[name]
        table.slots.load(plan.slot_id, plan.seen, plan.freq, plan.paged.ids.numpy())
        table.slots.admission.load_state_dicts(plan.admission)
        rows = self.rows_of(name).data
        gone = torch.from_numpy(~plan.kept).nonzero().squeeze(1).to(rows.device)
        rows.index_fill_(0, gone, 0.0)

    # -- stats --------------------------------------------------------------------------
    @staticmethod
    def counters(table: DynamicTable) -> dict[str, int]:
        """What the server shows of this rank's side (shard.proto DynamicCounters)."""
        s = table.slots.stats
        return {"capacity": table.slots.n, "occupied": table.slots.occupied,
                "lookups": s.lookups, "hits": s.hits, "admissions": s.admissions,
                "refused_filter": s.refused_filter, "refused_capacity": s.refused_capacity}

    def gathered_stats(self) -> dict[str, dict[str, float]]:
        """Per table, every rank's counters summed, with the hit rate and occupancy
        (a collective when world size > 1): --results' `dynamic`."""
        mine = self.stats()
        every: list[Any] = [mine]
        if self.world_size > 1:
            every = [None] * self.world_size
            dist.all_gather_object(every, mine)
        out: dict[str, dict[str, float]] = {}
        for name in mine:
            summed = {k: float(sum(r[name][k] for r in every)) for k in mine[name]}
            summed["hit_rate"] = summed["hits"] / max(summed["lookups"], 1.0)
            summed["occupancy"] = summed["occupied"] / max(summed["capacity"], 1.0)
            out[name] = summed
        return out

    def report_counters(self) -> None:
        """Hand the pager this rank's counters now (a Page call that moves nothing), e.g.
        at the end of training, so the server's stats are current."""
        if self.pager is None:
            return
        self.prefetched.wait()
        empty = torch.empty(0, dtype=torch.int64)
        for table in self.tables.values():
            self.pager.page(table.name, self.step, PagedOut(
                empty, torch.empty(0, table.dim), {}, empty, empty), empty, empty, empty,
                0, self.counters(table))

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per table, this rank's counters (summed over ranks by the caller)."""
        self.prefetched.wait()
        out = {}
        for name, t in self.tables.items():
            s = t.slots.stats.as_dict()
            s["occupied"] = t.slots.occupied
            s["capacity"] = t.slots.n
            s["paged"] = len(t.slots.paged)
            s["host_bytes"] = t.slots.nbytes
            out[name] = s
        return out


def check_dynamic_tables(tables: Sequence[Any], world_size: int, row_dtype: str) -> None:
    """A run's dynamic tables (TableConfig) fit its world size and options: ConfigError
    (one line, exit 2) naming the value otherwise."""
    for t in tables:
        if t.dynamic is None:
            continue
        try:
            check_capacity(t.name, t.num_rows, world_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if row_dtype != "fp32":
            raise ConfigError(f"row_dtype={row_dtype!r}: dynamic table {t.name!r} keeps "
                              "fp32 rows; use --row-dtype fp32")


def _first_seen_unique(ids_N: torch.Tensor, native: bool | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct ids in the order of their first occurrence, inverse: ids_N ==
    uniq[inverse]); `native`: hybridps/native/dynamic.c's hash pass (None: where built),
    the same answer as the sort here."""
    if ids_N.numel() == 0:
        return ids_N.clone(), torch.empty(0, dtype=torch.int64)
    if (_ext is not None if native is None else native) and ids_N.is_cpu:
        assert _ext is not None
        ids_N = ids_N.contiguous()
        uniq_N = torch.empty_like(ids_N)
        inverse_N = torch.empty_like(ids_N)
        count = _ext.first_seen_unique(ids_N.data_ptr(), ids_N.numel(), uniq_N.data_ptr(),
                                       inverse_N.data_ptr())
        return uniq_N[:count].clone(), inverse_N
    sorted_U, inverse_N = torch.unique(ids_N, sorted=True, return_inverse=True)
    first_U = torch.full((sorted_U.numel(),), ids_N.numel(), dtype=torch.int64)
    first_U.scatter_reduce_(0, inverse_N, torch.arange(ids_N.numel()), reduce="amin")
    order_U = torch.argsort(first_U)
    rank_U = torch.empty_like(order_U)
    rank_U[order_U] = torch.arange(order_U.numel())
    return sorted_U.index_select(0, order_U), rank_U.index_select(0, inverse_N)
