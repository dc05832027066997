"""The staleness window's part of a checkpoint: the pending updates (worker/checkpoint/
checkpointer.py's step 2) and, with --staleness-compensation predict, the weight
predictor's state (worker/updates/staleness.py).

At a checkpoint of step s the window applies what the forward of step s+1 sees (updates
<= s-K) and holds the updates of steps s-K+1..s, not applied: they are pending. Each rank
writes `pending/r<rank>.pt`: the pending updates plus the values the rows they touch have
before them. The rows files hold the rows with the pending updates applied (canonical
rows: `applied` lends them to the tables part while it writes), and the live rows are put
back exactly, so the run goes on as if no checkpoint was taken; a resume restores the same
rows, pending updates and predictions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridps.checkpoint import FileEntry, Manifest, PendingEntry, save_torch
from worker.checkpoint.parts import ManifestDraft
from worker.checkpoint.units import join_updates, split_rows, split_updates
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.source import RowUpdate, StalenessWindow

if TYPE_CHECKING:
    from worker.checkpoint.writer import Stage, Written

log = logging.getLogger("worker.checkpoint")

PENDING_FORMAT = "hybridps-pending-v1"


def pending_file(rank: int) -> str:
    return f"pending/r{rank:05d}.pt"


class WindowPart:
    """The pending updates and predictions of `window` (module doc)."""

    name = "window"

    def __init__(self, embedding: ShardedEmbedding, window: StalenessWindow,
                 row_dtype: str) -> None:
        self.emb, self.window, self.row_dtype = embedding, window, row_dtype
        # (step, pending updates, {unit: (sorted unit row ids, rows before them)})
        self._held: tuple[int, list[RowUpdate], dict[str, tuple[torch.Tensor, torch.Tensor]]
                          ] | None = None

    @torch.no_grad()
    def _pending(self, step: int) -> tuple[list[RowUpdate],
                                           dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The pending updates of a checkpoint of `step` and the rows they touch as they
        are now: only those rows are copied (memory ~ rows touched in K steps)."""
        if self._held is not None and self._held[0] == step:
            return self._held[1], self._held[2]
        emb = self.emb
        pending = self.window.pending_at(step)
        # per unit (worker/embedding/groups.py); the files per table (worker/checkpoint/units.py)
        touched: dict[str, list[torch.Tensor]] = {name: [] for name in emb.units}
        for u in pending:
            touched[u.table].append(u.ids_U.to(torch.int64))
        before: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, ids in touched.items():
            ids_P = torch.unique(torch.cat(ids)) if ids else torch.empty(0, dtype=torch.int64)
            local_P = ids_P.to(emb.device) - emb.units[name].start
            before[name] = (ids_P.cpu(), emb.weights[name].data.index_select(0, local_P))
        self._held = (step, pending, before)
        return pending, before

    @contextmanager
    def applied(self, step: int) -> Iterator[None]:
        """The rows with the pending updates of a checkpoint of `step` applied (every
        update <= step), the rows they touch put back bitwise on leaving."""
        pending, before = self._pending(step)
        emb = self.emb
        try:
            with torch.no_grad():
                for u in pending:
                    if u.rows:
                        emb.set_rows(u.table, u.ids_U, u.delta_UD)
                    else:
                        emb.apply_update(u.table, u.ids_U, u.delta_UD, u.decay)
            yield
        finally:
            with torch.no_grad():
                for name, (ids_P, rows_PD) in before.items():
                    local_P = ids_P.to(emb.device) - emb.units[name].start
                    emb.weights[name].data.index_copy_(0, local_P, rows_PD)

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        pending, before = self._pending(step)
        self._held = None
        rank = self.emb.rank
        payload = stage.hold({
            "format": PENDING_FORMAT, "rank": rank, "step": step,
            "applied_through": self.window.applied_through,
            "updates": split_updates(self.emb, pending),
            "before": split_rows(self.emb, before),
            # --staleness-compensation predict: what the next forwards' predictions need
            "prediction": (None if self.window.predictor is None
                           else self.window.predictor.state_dict()),
        })

        def write() -> tuple[FileEntry, int]:
            info = save_torch(directory / pending_file(rank), payload)
            return (FileEntry(pending_file(rank), info["bytes"], info["crc32"]),
                    payload["applied_through"])

        return stage.write(write)

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        """(the pending file, the window's applied_through at the snapshot) per rank: the
        window may be steps further when a background write records it."""
        draft.pending = PendingEntry(self.window.staleness, saved_by_rank[0][1],
                                     tuple((rank, f) for rank, (f, _) in
                                           enumerate(saved_by_rank)))

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        return None  # each pending file is checked when it is read (format, step)

    @torch.no_grad()
    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        """Put back the rows the pending updates touch and queue those updates (module doc);
        every rank reads every rank's pending file and keeps the rows of its own ranges."""
        emb, window = self.emb, self.window
        entry = manifest.pending
        if entry is not None and emb.dynamic is not None and manifest.world_size != emb.world_size:
            # a re-shard moves dynamic ids between owners and slots: the pending updates
            # (by slot) are already in the saved rows, and those are what is restored
            log.info("rank %d: re-sharding dynamic tables from world %d: the pending "
                     "updates are taken from the saved rows", emb.rank, manifest.world_size)
            window.restore_pending(step, [])
            return
        if entry is None or manifest.row_dtype != self.row_dtype:
            if entry is not None and entry.applied_through < step:
                log.info("rank %d: resuming with --row-dtype %s from %s rows: the pending "
                         "updates are already in the saved rows", emb.rank,
                         self.row_dtype, manifest.row_dtype)
            window.restore_pending(step, [])  # the rows hold every update <= step
            return  # nothing pending: nothing to predict (a predictor starts empty)
        payloads = []
        for _, f in entry.files:  # verified by resume_target
            payload = torch.load(directory / f.file, map_location="cpu", weights_only=True)
            if payload.get("format") != PENDING_FORMAT or payload.get("step") != step:
                raise ValueError(f"checkpoint file {directory / f.file} is not the pending "
                                 f"updates of step {step}")
            payloads.append(payload)
        for name in emb.tables:
            start, end = emb.ranges[name]
            for payload in payloads:
                saved = payload["before"].get(name)
                if saved is None:
                    continue
                mine = (saved["ids"] >= start) & (saved["ids"] < end)
                local_P = saved["ids"][mine].to(emb.device) - start
                weight = emb.table_rows(name)
                weight.index_copy_(0, local_P, saved["rows"][mine].to(weight.device,
                                                                      weight.dtype))
        updates = self._updates_of(payloads)
        window.restore_pending(entry.applied_through, updates)
        predictions = [p["prediction"] for p in payloads if p.get("prediction") is not None]
        if window.predictor is not None and predictions:
            window.predictor.load_state_dict(predictions)
        elif window.predictor is not None and updates:
            log.info("rank %d: checkpoint %s was saved without --staleness-compensation "
                     "predict: predictions start again once updates are applied", emb.rank,
                     directory)

    def _updates_of(self, payloads: Sequence[dict[str, Any]]) -> list[RowUpdate]:
        """Every rank's pending updates -> this rank's, per (step, unit)."""
        emb = self.emb
        merged: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for payload in payloads:  # rank order: ascending row ranges, so ids stay sorted
            for u in payload["updates"]:
                merged.setdefault((u["step"], u["table"]), []).append(u)
        per_table = {}
        for (update_step, name), parts in merged.items():
            if name not in emb.tables:
                continue
            start, end = emb.ranges[name]
            ids = torch.cat([p["ids"] for p in parts])
            delta = torch.cat([p["delta"] for p in parts])
            mine = (ids >= start) & (ids < end)
            per_table[(update_step, name)] = (ids[mine], delta[mine], float(parts[0]["decay"]),
                                              bool(parts[0]["rows"]))
        return join_updates(emb, per_table)  # per unit
