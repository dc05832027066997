"""The update source's part of a checkpoint: the sparse optimizer state, which the source
saves and restores itself (`UpdateSource.snapshot_to` / `restore_from`; this part never reads
a source's fields). The shard client asks ITS shard server to save its own partition in
two steps: in the snapshot, Checkpoint(deferred, ranks=[rank]) returns once the server has
applied the pushes <= step and copied the optimizer state, step count, last_step; the
write (in the checkpoint's job: in the background with --checkpoint-async) is
CheckpointDone, which returns the files once the server made them durable. The server
loads them when the client registers with `restore`; --local-optimizer writes the same files itself
(worker/updates/local_state.py). The manifest records the source's kind (`mode`, from
worker/sync/update_sources.py) and the optimizer the state belongs to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridps.checkpoint import Manifest
from hybridps.errors import ShardError
from worker.checkpoint.parts import ManifestDraft, file_entry

if TYPE_CHECKING:
    from hybridps.optim import OptimizerSpec
    from worker.checkpoint.writer import Stage, Written
    from worker.config.update_kinds import UpdateKind
    from worker.updates.source import UpdateSource


class SourcePart:
    """The sparse optimizer state of `source` (module doc)."""

    name = "source"

    def __init__(self, source: UpdateSource, kind: UpdateKind,
                 spec: OptimizerSpec) -> None:
        self.source, self.kind, self.spec = source, kind, spec

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        return stage.write(self.source.snapshot_to(directory, step, stage.hold, since))

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        draft.mode = self.kind.mode
        draft.optimizer = dataclasses.asdict(self.spec)
        for rank, saved in enumerate(saved_by_rank):
            for table, files in saved.items():
                draft.shard_files(table, rank, {k: file_entry(f) for k, f in files.items()})

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        for name in manifest.tables:
            try:
                manifest.shards(name, "optim")
            except ShardError as exc:
                return f"checkpoint {directory}: {exc}"
        return None

    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        self.source.restore_from(directory, step)
