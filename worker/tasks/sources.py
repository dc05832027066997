"""Where a built-in task's batches come from when they are not a function of the step:
the one file-reading path, worker/data/source.py's FileSource, named here (worker/data/
is a later room: loaded by name, not imported), and the interface a task calls on it."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from worker.config.train_config import TrainConfig
from worker.tasks.base import Batch

__all__ = ["FILE_SOURCE", "BatchSource", "file_source"]

FILE_SOURCE = "worker.data.source:FileSource"


class BatchSource(Protocol):
    """FileSource's interface (worker/data/source.py has what each method does)."""

    spec: Any  # worker.data.features.FeatureSpec: the columns and tables

    def batch(self, step: int, rank: int, world_size: int) -> Batch: ...

    def global_batch(self, step: int, world_size: int) -> Batch: ...

    def steps_per_epoch(self, world_size: int) -> int: ...

    def steps_for_epochs(self, epochs: int, world_size: int) -> int: ...

    def data_state(self, next_step: int) -> dict[str, Any]: ...

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None: ...

    def heldout_batches(self, rank: int, world_size: int, limit: int | None
                        ) -> Iterator[Batch]: ...

    def describe(self) -> dict[str, object]: ...


def file_source(cfg: TrainConfig, features: Mapping[str, Any] | None, *,
                train_files: str | None = None, what: str = "") -> BatchSource:
    """A FileSource of --train-files (or `train_files`) with the task's columns."""
    module, _, attr = FILE_SOURCE.partition(":")
    source: BatchSource = getattr(importlib.import_module(module), attr)(
        cfg, features, train_files=train_files, what=what)
    return source
