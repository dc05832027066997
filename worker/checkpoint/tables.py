"""The embedding tables' parts of a checkpoint: the rows a rank owns (`TablesPart`) and a
dynamic table's slot map (`DynamicMapsPart`, through the DynamicIds' own state methods;
in an incremental checkpoint only its slots looked up since the parent).

Each rank writes `rows/<table>.r<rank>.pt`: its rows [row_start, row_end) with every
update <= step applied (the window part lends its pending updates while they are
written: worker/checkpoint/window.py). A resume reads the saved row ranges that overlap
the range it owns now (hybridps/checkpoint.py load_rows), so the world size may differ.
Saved bf16 rows are their fp32 master rounded: fp32 rows resume from the master itself
(in the optim files, next to m and v).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridps.checkpoint import (
    Manifest,
    ShardInfo,
    chain_of,
    load_table_rows,
    rows_file,
    save_shard,
)
from hybridps.dynamic_files import restore_plan, save_ids
from hybridps.errors import ShardError
from worker.checkpoint.parts import ManifestDraft, file_entry
from worker.embedding.sharded import ShardedEmbedding

if TYPE_CHECKING:
    from worker.checkpoint.writer import Stage, Written


def _no_pending(step: int) -> AbstractContextManager[None]:
    return nullcontext()


class TablesPart:
    """Every table's rows on this rank (module doc)."""

    name = "tables"

    def __init__(self, embedding: ShardedEmbedding, row_dtype: str,
                 canonical: Callable[[int], AbstractContextManager[None]] = _no_pending
                 ) -> None:
        # canonical(step): the rows hold every update <= step inside it (WindowPart.applied)
        self.emb, self.row_dtype, self.canonical = embedding, row_dtype, canonical

    @torch.no_grad()
    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        """`since` S: incremental, each rows file a delta shard of the rows changed since
        the checkpoint of step S (`changed_ids`); the changed marks restart with the
        snapshot (the updates after it are the next checkpoint's delta)."""
        emb = self.emb
        with self.canonical(step):  # the write runs inside when the stage holds nothing
            held: dict[str, tuple[torch.Tensor | None, torch.Tensor]] = {}
            for name in emb.tables:
                ids = None if since is None else self.changed_ids(name, since)
                held[name] = (ids, stage.hold(self.rows_of(name, ids)))

            def write() -> dict[str, ShardInfo]:
                return {name: self.write_rows(directory, name, step, ids, weight)
                        for name, (ids, weight) in held.items()}

            written = stage.write(write)
        emb.clear_changed()
        return written

    def changed_ids(self, name: str, since: int) -> torch.Tensor:
        """The global ids of table `name`'s rows (this rank's) that may differ from the
        checkpoint of step `since`: every row an update touched since (the pending ones
        of this checkpoint included: they are applied while it is written), and for a
        dynamic table every slot looked up after `since` (a slot takes its id's row,
        paged in or new, when the id is looked up)."""
        emb = self.emb
        changed = emb.changed_rows(name)
        dynamic = emb.dynamic
        if dynamic is not None and name in dynamic.tables:
            looked = torch.from_numpy(dynamic.looked_up_since(name, since))
            changed = changed | looked.to(changed.device)
        start, _ = emb.ranges[name]
        return changed.nonzero().squeeze(1).cpu() + start

    def rows_of(self, name: str, ids: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows of `name`, or only rows `ids` (global; a delta shard's)."""
        emb = self.emb
        start, _ = emb.ranges[name]
        weight = emb.table_rows(name)
        if ids is not None:
            weight = weight.index_select(0, (ids - start).to(weight.device))
        return weight

    def write_rows(self, directory: Path, name: str, step: int, ids: torch.Tensor | None,
                   weight: torch.Tensor) -> ShardInfo:
        """One rows file: `weight`, this rank's rows of `name` or only rows `ids` (a delta
        shard: `rows_of`)."""
        emb, table = self.emb, self.emb.tables[name]
        start, end = emb.ranges[name]
        return save_shard(directory, rows_file(name, emb.rank), kind="rows", table=name,
                          rank=emb.rank, num_rows=table.num_rows, dim=table.dim,
                          row_start=start, row_end=end, tensors={"weight": weight},
                          meta={"step": step}, ids=ids)

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        draft.row_dtype = self.row_dtype  # bf16: the optim files hold the fp32 masters
        for name, t in self.emb.tables.items():
            draft.table(name, t.num_rows, t.dim,
                        {} if t.dynamic is None else {"dynamic": dataclasses.asdict(t.dynamic)})
            for rank, rows in enumerate(saved_by_rank):
                info = rows[name]
                draft.shard(name, rank, info.row_start, info.row_end,
                            {"rows": file_entry(info)})

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        for name, table in self.emb.tables.items():
            entry = manifest.tables.get(name)
            if entry is None or (entry.num_rows, entry.dim) != (table.num_rows, table.dim):
                return (f"checkpoint {directory}: table {name!r} is "
                        f"{'missing' if entry is None else 'of another shape'}; "
                        f"this run has {table.num_rows}x{table.dim}")
            if ("dynamic" in entry.extra) != (table.dynamic is not None):
                return (f"checkpoint {directory}: table {name!r} is "
                        f"{'' if 'dynamic' in entry.extra else 'not '}dynamic there "
                        f"and {'' if table.dynamic is not None else 'not '}dynamic "
                        "in this run")
        return None

    @torch.no_grad()
    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        emb = self.emb
        links = chain_of(directory, manifest)
        for name, table in emb.tables.items():
            start, end = emb.ranges[name]
            shape = (table.num_rows, table.dim)  # the chain verified by resume_target
            got, _ = load_table_rows(directory, manifest, name, "rows", start, end,
                                     ["weight"], verify=False, links=links, shape=shape)
            weight = got["weight"]
            if manifest.row_dtype == "bf16" and emb.row_dtype == torch.float32:
                masters, _ = load_table_rows(directory, manifest, name, "optim", start, end,
                                             ["master"], verify=False, links=links,
                                             shape=shape)
                weight = masters["master"] if masters["master"] is not None else weight
            assert weight is not None
            emb.table_rows(name).copy_(weight)


class DynamicMapsPart:
    """A dynamic table's slot map on this rank (hybridps/dynamic_files.py: any world size)."""

    name = "dynamic"

    def __init__(self, embedding: ShardedEmbedding) -> None:
        self.emb = embedding

    def _tables(self) -> list[str]:
        dynamic = self.emb.dynamic
        return [] if dynamic is None else [n for n in self.emb.tables if n in dynamic.tables]

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        dynamic, emb = self.emb.dynamic, self.emb
        held = {}  # `since`: only the slots looked up since (a delta shard)
        for name in self._tables():
            assert dynamic is not None
            held[name] = stage.hold(dynamic.slot_state(name, since))

        def write() -> dict[str, ShardInfo]:
            out = {}
            for name, state in held.items():
                start, end = emb.ranges[name]
                out[name] = save_ids(directory, table=name, rank=emb.rank, start=start,
                                     end=end, state=state, step=step)
            return out

        return stage.write(write)

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        for rank, saved in enumerate(saved_by_rank):
            for name, info in saved.items():
                draft.shard_files(name, rank, {"ids": file_entry(info)})

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        for name in self._tables():
            try:
                manifest.shards(name, "ids")
            except ShardError as exc:
                return f"checkpoint {directory}: dynamic table {name!r}: {exc}"
        return None

    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        dynamic = self.emb.dynamic
        for name in self._tables():
            assert dynamic is not None
            start, end = self.emb.ranges[name]
            plan = restore_plan(directory, manifest, name, self.emb.tables[name].dim, (),
                                self.emb.rank, self.emb.world_size, start, end, verify=False)
            dynamic.load_slot_state(name, plan)
