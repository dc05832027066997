"""The data position's part of a checkpoint.

The manifest's `data` says where the run is (the step, the samples seen). Tasks that make
batches from (seed, step) need nothing more; a task that reads a stream keeps a position
the step does not give (`Task.data_state`): each rank's is saved in `data/r<rank>.pt`,
listed in the manifest's `parts` entry "data" with its size and crc32 like every other
file, and a resume hands every saved rank's state to `Task.load_data_state`, which may
re-split them at another world size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridps.checkpoint import FileEntry, Manifest, save_torch
from worker.checkpoint.parts import ManifestDraft
from worker.tasks.base import Task

if TYPE_CHECKING:
    from worker.checkpoint.writer import Stage, Written

DATA_FORMAT = "hybridps-data-v1"


def data_file(rank: int) -> str:
    return f"data/r{rank:05d}.pt"


class DataPart:
    """The reading position of `task` on this rank (module doc)."""

    name = "data"

    def __init__(self, task: Task, *, rank: int, world_size: int, batch_size: int) -> None:
        self.task, self.rank, self.world, self.batch_size = task, rank, world_size, batch_size

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        state = stage.hold(self.task.data_state(step + 1))  # whole in every checkpoint
        rank = self.rank

        def write() -> FileEntry | None:
            if state is None:  # batches are a function of the step
                return None
            info = save_torch(directory / data_file(rank),
                              {"format": DATA_FORMAT, "rank": rank, "next_step": step + 1,
                               "state": state})
            return FileEntry(data_file(rank), info["bytes"], info["crc32"])

        return stage.write(write)

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        draft.data = {"step": draft.step,
                      "samples_seen": (draft.step + 1) * self.batch_size * self.world}
        draft.part(self.name, [(rank, f) for rank, f in enumerate(saved_by_rank)
                               if f is not None])

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        entry = manifest.part(self.name)
        ranks = [] if entry is None else [rank for rank, _ in entry.files]
        if len(set(ranks)) != len(ranks) or not all(0 <= r < manifest.world_size
                                                    for r in ranks):
            return (f"checkpoint {directory}: the data part's files are of ranks {ranks}, "
                    f"not distinct ranks of its world size {manifest.world_size}")
        return None

    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        states: list[dict[str, Any] | None] = [None] * max(manifest.world_size, 1)
        entry = manifest.part(self.name)
        for rank, f in () if entry is None else entry.files:  # verified by resume_target
            saved = torch.load(directory / f.file, map_location="cpu", weights_only=True)
            if (not isinstance(saved, dict) or saved.get("format") != DATA_FORMAT
                    or saved.get("next_step") != step + 1 or saved.get("rank") != rank):
                raise ValueError(f"checkpoint file {directory / f.file} is not rank {rank}'s "
                                 f"data position before step {step + 1}")
            states[rank] = saved["state"]
        self.task.load_data_state(states, step + 1)
