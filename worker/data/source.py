"""One task's batches from files: the one reading path of `--task files`, `--task dlrm`
with files and a custom task (docs/custom_model.md#training-from-files).

    source = FileSource(cfg, features)   # features: the task's columns (None: --features,
                                         # else by convention), as a --features document
    source.batch(step, rank, world_size) # a Batch: ids[table], bags[table], values
                                         # "dense" [B, F] and "label" [B]
    source.data_state(next_step) / source.load_data_state(states_by_rank, next_step)
    source.heldout_batches(rank, world_size, limit)   # --valid-files

Before any step every file's metadata is read (`scan`): a missing column or one of the
wrong type is one line naming the file and the column. Each rank reads its share
(worker/data/sharding.py), in an order fixed by --seed; the position goes through a
checkpoint (worker/data/reader.py). With --data-workers N the batches are decoded in N
DataLoader processes (worker/data/loader.py); on a CUDA device the batches' host tensors
are pinned, so the trainer's non-blocking copy to the device overlaps the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from worker.config.train_config import TrainConfig
from worker.data.errors import DataError, where
from worker.data.features import FeatureSpec, check_schema, feature_spec
from worker.data.formats import format_for, list_files
from worker.data.loader import PrefetchLoader, pin_host_memory
from worker.data.reader import FileReader, ReaderConfig
from worker.data.sharding import Catalog
from worker.tasks.base import Batch

__all__ = ["FileSource", "scan"]


def scan(patterns: str, flag: str, spec: FeatureSpec | None = None,
         cfg: TrainConfig | None = None, declared: Mapping[str, Any] | None = None,
         what: str = "") -> tuple[Catalog, FeatureSpec]:
    """The files' units from their metadata, each file's schema checked against the spec
    (made from `declared`, --features or the first file's columns when not given)."""
    files = list_files(patterns, flag)
    rows: list[tuple[int, ...]] = []
    kinds: dict[str, str] = {}
    for path in files:
        fmt = format_for(path)
        schema = fmt.schema(path)
        if spec is None:
            assert cfg is not None
            spec = feature_spec(cfg, schema, path, declared, what)
        check_schema(spec, schema, path)
        for t in spec.tables:  # a table's ids are one per sample in every file, or lists
            first = kinds.setdefault(t.column, schema[t.column])
            if schema[t.column] != first:
                raise DataError(f"{where(path, None, t.column)}: type {schema[t.column]}, "
                                f"the earlier files have {first}")
        units = fmt.units(path)
        if not sum(units):
            raise DataError(f"{where(path)}: no rows")
        rows.append(tuple(units))
    assert spec is not None
    return Catalog(tuple(files), tuple(rows)), spec


class FileSource:
    """The batches of --train-files (or `train_files`) and --valid-files (module doc)."""

    def __init__(self, cfg: TrainConfig, features: Mapping[str, Any] | None = None, *,
                 train_files: str | None = None, what: str = "") -> None:
        self.cfg = cfg
        self.train, self.spec = scan(train_files or cfg.files.train_files, "--train-files",
                                     cfg=cfg, declared=features, what=what)
        self.valid: Catalog | None = None
        if cfg.files.valid_files:
            self.valid, _ = scan(cfg.files.valid_files, "--valid-files", self.spec)
        self.pin = pin_host_memory(cfg.run.device, torch.cuda.is_available())
        self._readers: dict[int, FileReader] = {}
        self._loaders: dict[tuple[int, int], PrefetchLoader] = {}
        self._resume: tuple[list[dict[str, Any] | None], int] | None = None
        self._where: tuple[int, int] | None = None  # (rank, world size) of the last batch

    def reader_config(self, world_size: int) -> ReaderConfig:
        c = self.cfg
        return ReaderConfig(self.train, self.spec, c.run.batch_size, c.run.seed,
                            c.files.shuffle_buffer, world_size)

    def reader(self, world_size: int) -> FileReader:
        if world_size not in self._readers:
            config = self.reader_config(world_size)
            if self._resume is not None:
                config = config.resumed(*self._resume)
            self._readers[world_size] = FileReader(config)
        return self._readers[world_size]

    def _rank_world(self) -> tuple[int, int]:
        if self._where is not None:
            return self._where
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _host(self, batch: Batch) -> Batch:
        return batch.pin_memory() if self.pin else batch

    def global_batch(self, step: int, world_size: int) -> Batch:
        return self.reader(world_size).global_samples(step).to_batch()

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        self._where = (rank, world_size)
        workers = self.cfg.files.data_workers
        if not workers:
            return self._host(self.reader(world_size).samples(step, rank).to_batch())
        key = (rank, world_size)
        if key not in self._loaders:
            self._loaders[key] = PrefetchLoader(self.reader(world_size).config, rank, workers)
        return self._host(self._loaders[key].get(step))

    def steps_per_epoch(self, world_size: int) -> int:
        return self.reader(world_size).steps_per_epoch

    def steps_for_epochs(self, epochs: int, world_size: int) -> int:
        """The first step of epoch `epochs` in this run's schedule (a resumed one too)."""
        return self.reader(world_size).epoch_start(epochs)

    def data_state(self, next_step: int) -> dict[str, Any]:
        rank, world = self._rank_world()
        return self.reader(world).state(next_step, rank)

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None:
        self._resume = (list(states_by_rank), next_step)
        self.close()
        self._readers.clear()
        self.reader(self._rank_world()[1])  # a position this run cannot take fails here

    def close(self) -> None:
        """Stop the DataLoader workers (they start again at the next batch)."""
        for loader in self._loaders.values():
            loader.close()
        self._loaders.clear()

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "label": self.spec.label, "dense": list(self.spec.dense),
            "pooling": {t.name: t.pooling for t in self.spec.tables},
            "id_overflow": self.spec.id_overflow,
            "train_files": len(self.train.files), "train_rows": self.train.total,
            "shuffle_buffer": self.cfg.files.shuffle_buffer}
        if self.valid is not None:
            out.update(valid_files=len(self.valid.files), valid_rows=self.valid.total)
        return out

    def heldout_batches(self, rank: int, world_size: int, limit: int | None
                        ) -> Iterator[Batch]:
        """This rank's share of --valid-files in batches of --batch-size (the last one
        shorter; every rank has as many): floor(rows / W) rows a rank, the first `limit`
        batches of them (None: all), read as they are scored; none without --valid-files."""
        if self.valid is None:
            return
        c = self.cfg
        reader = FileReader(ReaderConfig(self.valid, self.spec, c.run.batch_size, c.run.seed,
                                         0, world_size, what="--valid-files"), check=False)
        stream = reader.locate(0)[2][rank]
        rows = sum(len(s) for s in stream)
        b = c.run.batch_size
        count = math.ceil(rows / b) if limit is None else min(limit, math.ceil(rows / b))
        for i in range(count):
            yield reader.rows(stream, i * b, min((i + 1) * b, rows)).to_batch()
