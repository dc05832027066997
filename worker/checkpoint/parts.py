"""The parts of a checkpoint: each component saves and restores itself (torchtitan's
stateful checkpointing), the Checkpointer (checkpointer.py) runs them in sequence.

A part (`CheckpointPart`) is named and does four things:

- `snapshot(directory, step, stage, since)`: hold this rank's state of the checkpoint of
  `step` through `stage` (worker/checkpoint/writer.py) and hand it the write of its files
  (`stage.write(fn)`; the write may run later, in the background, from what was held);
  the write returns what this rank saved (picklable: it is gathered on every rank).
  `since` S: an incremental checkpoint whose parent is the checkpoint of step S: a part
  may hold and write only what changed since S, as delta shards (hybridps/checkpoint.py's
  chains); None: whole;
- `record(saved_by_rank, draft)`: on rank 0, add its entries (tables, shards, files,
  fields) to the manifest being drafted (`ManifestDraft`), from every rank's `save`;
- `verify(directory, manifest)`: a problem (one line naming the checkpoint) that makes
  the checkpoint unusable by this run, or None; every part is asked before any restores;
- `restore(directory, manifest, step)`: load this rank's share (any world size).

The parts of a run and their order (worker/checkpoint/run_parts.py): tables (rows),
dynamic (slot maps), window (pending updates, predictor), source (the sparse optimizer
state), dense (DCP, loss scaler), data (the reading position). Each file a part writes is
listed in the manifest with its size and crc32: in the tables' shards, `dense`, `pending`,
or the part's own `parts` entry (hybridps/checkpoint.py PartEntry).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hybridps.checkpoint import (
    FileEntry,
    Manifest,
    ManifestShard,
    ManifestTable,
    ParentEntry,
    PartEntry,
    PendingEntry,
    ShardInfo,
)

if TYPE_CHECKING:
    from worker.checkpoint.writer import Stage, Written


class CheckpointPart(Protocol):
    """One component's share of a checkpoint (module doc)."""

    name: str

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written: ...

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None: ...

    def verify(self, directory: Path, manifest: Manifest) -> str | None: ...

    def restore(self, directory: Path, manifest: Manifest, step: int) -> None: ...


def file_entry(info: ShardInfo) -> FileEntry:
    return FileEntry(info.file, info.bytes, info.crc32, info.delta)


@dataclass
class ManifestDraft:
    """The manifest of one checkpoint while the parts record their entries (rank 0);
    `build` makes the typed Manifest. A table's shard gets its row range from the part
    that saved its rows and files from any part."""

    step: int
    world_size: int
    run_id: str
    task: str
    seed: int
    mode: str = ""
    row_dtype: str = "fp32"
    optimizer: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    dense: dict[str, Any] | None = None
    pending: PendingEntry | None = None
    tables: dict[str, tuple[int, int, dict[str, Any]]] = field(default_factory=dict)
    ranges: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    files: dict[tuple[str, int], dict[str, FileEntry]] = field(default_factory=dict)
    parts: dict[str, list[tuple[int, FileEntry]]] = field(default_factory=dict)
    chain_id: str = ""
    parent: ParentEntry | None = None  # an incremental checkpoint's parent

    def table(self, name: str, num_rows: int, dim: int,
              extra: Mapping[str, Any] | None = None) -> None:
        self.tables[name] = (num_rows, dim, dict(extra or {}))

    def shard(self, table: str, rank: int, row_start: int, row_end: int,
              files: Mapping[str, FileEntry]) -> None:
        """Rank `rank` saved rows [row_start, row_end) of `table` in `files` (by kind)."""
        self.ranges[(table, rank)] = (row_start, row_end)
        self.shard_files(table, rank, files)

    def shard_files(self, table: str, rank: int, files: Mapping[str, FileEntry]) -> None:
        """More files (by kind: "optim", "ids", ...) of rank `rank`'s shard of `table`."""
        self.files.setdefault((table, rank), {}).update(files)

    def part(self, name: str, files: Sequence[tuple[int, FileEntry]] = ()) -> None:
        """Part `name` is in the checkpoint, with `files` (rank, file) only it lists."""
        self.parts.setdefault(name, []).extend(files)

    def build(self) -> Manifest:
        unranged = sorted(set(self.files) - set(self.ranges))
        if unranged:  # a part recorded files of a shard no part saved rows of
            raise ValueError(f"checkpoint of step {self.step}: files of shards {unranged} "
                             "without a row range")
        tables = {}
        for name, (num_rows, dim, extra) in self.tables.items():
            ranks = sorted(r for t, r in self.ranges if t == name)
            tables[name] = ManifestTable(num_rows, dim, tuple(
                ManifestShard(r, *self.ranges[(name, r)], self.files[(name, r)])
                for r in ranks), extra)
        return Manifest(
            step=self.step, next_step=self.step + 1, world_size=self.world_size,
            run_id=self.run_id, mode=self.mode, row_dtype=self.row_dtype,
            optimizer=self.optimizer, task=self.task, seed=self.seed, data=self.data,
            created_unix=time.time(), tables=tables, dense=self.dense, pending=self.pending,
            parts=tuple(PartEntry(n, tuple(f)) for n, f in self.parts.items()),
            chain_id=self.chain_id, parent=self.parent)
