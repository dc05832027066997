"""--staleness-compensation predict: weight prediction for the updates a stale forward misses.

With --staleness K the forward of step t sees the rows with the updates of steps <= t-1-K
only. When a row gets a gradient nearly every step (KvsAll scores every entity row every
step), every forward misses that row's K latest optimizer steps; with only a few hundred
steps in a run, Adam at lr 0.1 then loses up to 0.04 test MRR (docs/workload_results.md).

Weight prediction (as in SpecTrain, Chen et al. 2018, and PipeMare, Yang et al. 2021, for
pipelined training) gives the forward an estimate of the missing steps instead: Adam's
per-step update is momentum-smoothed, so a row's next update is close to its previous
one. Before the forward of step t, every row this rank owns gets, for each step
s in t-K..t-1 whose push held the row (its update is not applied yet),

    predicted_D = the row's latest *effective* applied update (new row - old row)

added on top of the stored row. The effective update is measured when an update is
applied, so it is the same thing for adam, adamw (decay), sgd and bf16 "rows" answers.

Where the prediction lives: only in the lookup path. The owner adds it to the rows it
gathers (stage 3, `ShardedEmbedding._gather`, so `lookup`, `lookup_bag`,
`lookup_many` and `local_block` all see it, also with --pipeline whose stage 3 stays in
the step); the stored rows are never modified, the gradient reaching them is unchanged
(the prediction is a constant offset), and when the true update of step s is applied the
prediction for s disappears with it: no drift. After `drain` nothing is pending, so
evaluation, --dump-state, export and checkpoint rows files see the stored rows only.

Determinism: the prediction is a function of the pushed ids and of the applied updates,
which the staleness window fixes by step, so a run stays a deterministic function of its
config (the server and --local-optimizer give the same results). K=0 creates no predictor.

Per unit (worker/embedding/groups.py: a group of tables of one width, or a table alone): one
prediction a step for all the tables of a group. The checkpointed state is per table
with global row ids (units split and joined at that boundary), so it loads at any world
size and with or without grouping.

Memory (per table, on the rows' device): the ids pushed in the K steps not yet applied,
and one fp32 delta per row touched in the last K+1 steps (rows not touched for longer are
forgotten, and a row pushed again after such a gap gets no prediction for that step), plus
the current prediction of the rows pending: bounded by the rows touched in the last K+1
steps, never by the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridps.row_deltas import add_offsets_, pick_offsets
from worker.embedding.groups import join_ids
from worker.embedding.sharded import ShardedEmbedding
from worker.runtime.device_copy import to_device

COMPENSATIONS = ("none", "predict")  # --staleness-compensation
STATE_FORMAT = "hybridps-row-prediction-v1"

Grads = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # unit -> (ids_U, grads_UD)


def _empty_ids(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


class RowPrediction:
    """The offsets the owner adds to the rows it gathers: per unit, sorted local ids (rows
    of the unit's block) -> offset rows.

    Held by the embedding (`ShardedEmbedding.offset_rows`) while a forward may run.
    """

    def __init__(self) -> None:
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # local_P, offset_PD

    def offsets_of(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(local_P, offset_PD) of unit `name`, or None (the owner's fused kernel adds them
        to the rows it gathers as add_to would)."""
        return self.tables.get(name)

    def add_to(self, name: str, local_ids_M: torch.Tensor | None, rows_MD: torch.Tensor
               ) -> torch.Tensor:
        """rows_MD + the offsets of the rows `local_ids_M` (None: rows_MD is every owned row,
        in order: `local_block`). Out of place: a constant offset leaves the gradient that
        reaches the stored rows unchanged."""
        entry = self.tables.get(name)
        if entry is None:
            return rows_MD
        local_P, offset_PD = entry
        if local_ids_M is None:
            return rows_MD.index_add(0, local_P, offset_PD.to(rows_MD.dtype))
        if local_ids_M.numel() == 0:
            return rows_MD
        # In place where the native kernel runs: rows_MD is the caller's fresh gather, and
        # the gather's backward does not read its output.
        return add_offsets_(rows_MD, local_ids_M.contiguous(), local_P, offset_PD)


class RowPredictor:
    """Weight prediction for one rank's rows (module doc). Driven by the StalenessWindow:
    `pushed_step` after each push, `rows_before`/`applied` around each applied update,
    `refresh` before each forward, `clear` once nothing is pending."""

    def __init__(self, embedding: ShardedEmbedding, staleness: int) -> None:
        if staleness < 1:
            raise ValueError(f"staleness={staleness}: weight prediction needs K >= 1 "
                             "(at K=0 no update is ever missing)")
        self.embedding, self.staleness = embedding, staleness
        device = embedding.device
        # step -> unit -> ids_U pushed in that step (unit row ids, sorted): steps not yet
        # applied
        self.pushed: dict[int, dict[str, torch.Tensor]] = {}
        # unit -> (ids_L sorted, delta_LD fp32): the effective update of each row of the
        # newest applied update of the unit (a row it did not touch has no delta)
        self.deltas: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            name: (_empty_ids(device), torch.empty(0, u.dim, device=device))
            for name, u in embedding.units.items()}
        self.prediction = RowPrediction()
        self.refreshes = 0
        # rows with a prediction, summed over refreshes (stats; a tensor on the rows'
        # device, read once by `describe`)
        self.predicted_row_steps: torch.Tensor | int = 0

    # -- hooks ----------------------------------------------------------------------------
    def pushed_step(self, step: int, grads: Grads) -> None:
        """`grads` as pushed: per unit, the ids sorted and distinct (`pop_grads`)."""
        self.pushed[step] = {name: grads[name][0].detach().to(self.embedding.device,
                                                              torch.int64)
                             for name in self.embedding.units}

    @torch.no_grad()
    def rows_before(self, name: str, ids_U: torch.Tensor) -> torch.Tensor:
        """The stored rows an update is about to change (fp32)."""
        emb = self.embedding
        local_U = to_device(ids_U, emb.device).to(torch.int64) - emb.units[name].start
        return emb.weights[name].data.index_select(0, local_U).float()

    @torch.no_grad()
    def applied(self, name: str, ids_U: torch.Tensor, before_UD: torch.Tensor) -> None:
        """An update of unit `name` is in the rows (`before_UD`: the rows it changed, as
        they were): see `measured`."""
        self.measured(name, ids_U, self.rows_before(name, ids_U) - before_UD)

    @torch.no_grad()
    def measured(self, name: str, ids_U: torch.Tensor, delta_UD: torch.Tensor) -> None:
        """An update of unit `name` is in the rows and changed rows ids_U by delta_UD (new -
        old, fp32): these effective updates replace the unit's deltas (updates are applied
        in step order, so this is the newest step). Ids on the host (a server's answer)
        are checked for order there, ids on a CUDA device sorted there: no value of the
        device is read on the host (worker/runtime/device_copy.py)."""
        if ids_U.numel() > 1:
            if ids_U.is_cpu:
                host_N = ids_U.numpy()
                if not (host_N[1:] > host_N[:-1]).all():  # pushes are coalesced: rare
                    ids_U, order_U = torch.sort(ids_U)
                    delta_UD = delta_UD.index_select(0, to_device(order_U, delta_UD.device))
            else:
                ids_U, order_U = torch.sort(ids_U)
                delta_UD = delta_UD.index_select(0, order_U)
        self.deltas[name] = (to_device(ids_U, self.embedding.device).to(torch.int64), delta_UD)

    def refresh(self, applied_through: int) -> None:
        """Before a forward: the updates <= `applied_through` are in the rows; predict the
        rows of every pushed step after it."""
        for step in [s for s in self.pushed if s <= applied_through]:
            del self.pushed[step]
        offsets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        pending_steps = sorted(self.pushed)
        for name in self.embedding.units:
            ids_L, delta_LD = self.deltas[name]
            if not pending_steps or ids_L.numel() == 0:
                continue
            pending = [self.pushed[s][name] for s in pending_steps]
            # No compaction to the rows that have a prediction: its size would be read on
            # the host. A row without one gets an offset of exactly 0.
            if len(pending) == 1:  # K=1: each row once, sorted and distinct
                keys_P = pending[0]
                offset_PD, hits = pick_offsets(ids_L, delta_LD, keys_P)
            else:
                rows_N = torch.cat(pending)
                pos_N = torch.searchsorted(ids_L, rows_N).clamp_(max=ids_L.numel() - 1)
                hit_N = ids_L.index_select(0, pos_N) == rows_N
                # A row appears at most once per step: its prediction is (pending steps that
                # pushed it) x its delta, with no summation order to depend on.
                count_L = torch.zeros_like(ids_L).index_add_(0, pos_N, hit_N.to(torch.int64))
                keys_P, offset_PD = ids_L, delta_LD * count_L.unsqueeze(1).to(delta_LD.dtype)
                hits = hit_N.sum()
            offsets[name] = (keys_P - self.embedding.units[name].start, offset_PD)
            self.predicted_row_steps = self.predicted_row_steps + hits
        self.refreshes += 1
        self.prediction.tables = offsets
        self.embedding.offset_rows(self.prediction if offsets else None)

    def clear(self) -> None:
        """Nothing pending (drain): the forward sees the stored rows."""
        self.prediction.tables = {}
        self.embedding.offset_rows(None)

    def describe(self) -> dict[str, Any]:
        """For --results: how many of this rank's rows a forward saw predicted, on average."""
        return {"method": "predict",
                "predicted_rows_mean": int(self.predicted_row_steps) / max(self.refreshes, 1)}

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """CPU tensors, per TABLE with global row ids (units split): re-shardable by row
        range like the rows, and loadable with or without grouping."""
        pushed: dict[int, dict[str, torch.Tensor]] = {}
        for step, units in self.pushed.items():
            pushed[step] = {}
            for name, ids in units.items():
                for table, part, _ in self._split(name, ids):
                    pushed[step][table] = part.cpu()
        deltas: dict[str, dict[str, torch.Tensor]] = {}
        for name, (ids, delta) in self.deltas.items():
            for table, part, cut in self._split(name, ids):
                deltas[table] = {"ids": part.cpu(), "delta": delta[cut].cpu()}
        return {"format": STATE_FORMAT, "staleness": self.staleness, "pushed": pushed,
                "deltas": deltas}

    def load_state_dict(self, states: Sequence[dict[str, Any]] | dict[str, Any]) -> None:
        """The saved state of every rank (or one): keeps the rows this rank owns now."""
        parts = [states] if isinstance(states, dict) else list(states)
        emb, device = self.embedding, self.embedding.device
        pushed: dict[int, dict[str, list[torch.Tensor]]] = {}
        deltas: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {
            n: ([], []) for n in emb.tables}
        for part in parts:
            if part.get("format") != STATE_FORMAT:
                raise ValueError(f"not a row-prediction state: format {part.get('format')!r}")
            for step, tables in part["pushed"].items():
                for name, ids in tables.items():
                    if name in emb.tables:
                        pushed.setdefault(int(step), {n: [] for n in emb.tables})[name].append(
                            self._mine(name, ids))
            for name, entry in part["deltas"].items():
                if name in emb.tables:
                    mine = self._owned(name, entry["ids"])
                    deltas[name][0].append(entry["ids"][mine])
                    deltas[name][1].append(entry["delta"][mine])
        self.pushed = {}
        for step, tables in pushed.items():  # per table, sorted -> per unit, sorted
            sorted_ids = {n: torch.sort(torch.cat(v)).values for n, v in tables.items() if v}
            self.pushed[step] = {u: join_ids(unit, sorted_ids)[0].to(device)
                                 for u, unit in emb.units.items()}
        for u, unit in emb.units.items():
            ids_parts, delta_parts = {}, []
            for m in unit.members:
                ids, rows = deltas[m.name]
                ids_L = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)
                delta_LD = torch.cat(rows) if rows else torch.empty(0, unit.dim)
                order = torch.argsort(ids_L)
                ids_parts[m.name] = ids_L[order]
                delta_parts.append(delta_LD[order].float())
            ids_U, _ = join_ids(unit, ids_parts)
            self.deltas[u] = (ids_U.to(device), torch.cat(delta_parts).to(device))

    def _owned(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        start, end = self.embedding.ranges[name]
        return (ids >= start) & (ids < end)

    def _mine(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return ids[self._owned(name, ids)]

    def _split(self, unit: str, ids_U: torch.Tensor
               ) -> list[tuple[str, torch.Tensor, slice]]:
        """Sorted unit row ids -> per table (name, its global row ids, the slice of ids_U)."""
        u = self.embedding.units[unit]
        return [(m.name, u.to_table_ids(m, ids_U[cut]), cut) for m, cut in u.split(ids_U)]
