"""`--task files`: click prediction trained from files (docs/data.md).

    torchrun ... worker/main.py --task files --train-files 'data/train-*.parquet' \\
        --valid-files 'data/valid-*.parquet' --num-rows 100000 --dim 16 --epochs 2

The columns (worker/data/features.py): `label`, `dense_*`, `cat_*` (one table each; a
list<int64> column is a bag pooled by --pooling), or what --features names. Before any
step every file's metadata is read: a missing column or one of the wrong type is one line
naming the file and the column. Each rank reads its share (worker/data/sharding.py), in an
order fixed by --seed; --epochs counts passes; `data_state` / `load_data_state` carry the
reading position through a checkpoint (worker/data/reader.py). The model: each table's
(pooled) rows concatenated with the dense features -> MLP (64, 32) -> logit, BCE loss.
Evaluation on --valid-files, as the dlrm task does: exact AUC and log loss over the ranks'
shares of it (floor(rows / W) rows each, in file order; the quick one during training over
the first --eval-batches batches of each share, the final one over all of them).

A custom task reads the same path: subclass FilesTask (override `build_dense` and
`forward`), or build a FileReader itself (docs/custom_model.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.config.train_config import TrainConfig
from worker.data.errors import DataError, where
from worker.data.features import FeatureSpec, check_schema, feature_spec
from worker.data.formats import format_for, list_files
from worker.data.loader import PrefetchLoader
from worker.data.reader import FileReader, ReaderConfig
from worker.data.sharding import Catalog
from worker.runtime.gather import dist_info
from worker.tasks.base import Batch, HybridModel, TableConfig, Task
from worker.tasks.click import click_mlp
from worker.tasks.metrics import auc_over_ranks, log_loss_over_ranks, summed_over_ranks

__all__ = ["FilesTask", "scan"]


def scan(patterns: str, flag: str, spec: FeatureSpec | None = None,
         cfg: TrainConfig | None = None) -> tuple[Catalog, FeatureSpec]:
    """The files' units from their metadata, each file's schema checked against the spec
    (made from the first file's columns when not given)."""
    files = list_files(patterns, flag)
    rows: list[tuple[int, ...]] = []
    kinds: dict[str, str] = {}
    for path in files:
        fmt = format_for(path)
        schema = fmt.schema(path)
        if spec is None:
            assert cfg is not None
            spec = feature_spec(cfg, schema, path)
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


class FilesTask(Task):
    """Click prediction from --train-files (module doc)."""

    name = "files"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.train, self.spec = scan(cfg.files.train_files, "--train-files", cfg=cfg)
        self.valid: Catalog | None = None
        if cfg.files.valid_files:
            self.valid, _ = scan(cfg.files.valid_files, "--valid-files", self.spec)
        self._readers: dict[int, FileReader] = {}
        self._loaders: dict[tuple[int, int], PrefetchLoader] = {}
        self._resume: tuple[list[dict[str, Any] | None], int] | None = None
        self._where: tuple[int, int] | None = None  # (rank, world size) of the last batch

    # -- reading ------------------------------------------------------------------------
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

    # -- Task interface -----------------------------------------------------------------
    def tables(self) -> list[TableConfig]:
        return [TableConfig(t.name, t.rows, t.dim) for t in self.spec.tables]

    def input_width(self) -> int:
        return sum(t.dim for t in self.spec.tables) + len(self.spec.dense)

    def build_dense(self) -> nn.Module:
        return click_mlp(self.input_width())

    def global_batch(self, step: int, world_size: int) -> Batch:
        return self.reader(world_size).global_samples(step).to_batch()

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        self._where = (rank, world_size)
        workers = self.cfg.files.data_workers
        if not workers:
            return self.reader(world_size).samples(step, rank).to_batch()
        key = (rank, world_size)
        if key not in self._loaders:
            self._loaders[key] = PrefetchLoader(self.reader(world_size).config, rank, workers)
        return self._loaders[key].get(step)

    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.forward(model, batch),
                                                  batch.values["label"])

    def steps_per_epoch(self, world_size: int) -> int | None:
        return self.reader(world_size).steps_per_epoch

    def data_state(self, next_step: int) -> dict[str, Any] | None:
        rank, world = self._rank_world()
        return self.reader(world).state(next_step, rank)

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None:
        self._resume = (list(states_by_rank), next_step)
        for loader in self._loaders.values():
            loader.close()
        self._readers.clear()
        self._loaders.clear()
        self.reader(self._rank_world()[1])  # a position this run cannot take fails here

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            **super().describe(), "label": self.spec.label, "dense": list(self.spec.dense),
            "pooling": {t.name: t.pooling for t in self.spec.tables},
            "id_overflow": self.spec.id_overflow,
            "train_files": len(self.train.files), "train_rows": self.train.total,
            "shuffle_buffer": self.cfg.files.shuffle_buffer}
        if self.valid is not None:
            out.update(valid_files=len(self.valid.files), valid_rows=self.valid.total)
        return out

    # -- model --------------------------------------------------------------------------
    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        """logit_B; every table's lookup in one fused exchange (a collective)."""
        names, ids, bags = self.lookup_inputs(batch)
        rows = model.lookups.lookup_many(names, ids, bags=bags)
        out: torch.Tensor = model.dense(torch.cat([*rows, batch.values["dense"]], dim=1))
        return out.squeeze(-1)

    def lookup_inputs(self, batch: Batch) -> tuple[
            list[str], list[torch.Tensor], list[tuple[torch.Tensor, str] | None]]:
        """lookup_many's names, ids and bags: a list column is a bag pooled by its table's
        pooling, an id column a plain lookup."""
        names, ids = [], []
        bags: list[tuple[torch.Tensor, str] | None] = []
        for t in self.spec.tables:
            names.append(t.name)
            if t.name in batch.bags:
                ids_N, offsets_B = batch.bags[t.name]
                ids.append(ids_N)
                bags.append((offsets_B, t.pooling))
            else:
                ids.append(batch.ids[t.name])
                bags.append(None)
        return names, ids, bags

    # -- evaluation ---------------------------------------------------------------------
    def heldout_batches(self, rank: int, world_size: int, limit: int | None
                        ) -> Iterator[Batch]:
        """This rank's share of --valid-files in batches of --batch-size (the last one
        shorter; every rank has as many): floor(rows / W) rows a rank, the first `limit`
        batches of them (None: all), read as they are scored."""
        assert self.valid is not None
        c = self.cfg
        reader = FileReader(ReaderConfig(self.valid, self.spec, c.run.batch_size, c.run.seed,
                                         0, world_size, what="--valid-files"), check=False)
        stream = reader.locate(0)[2][rank]
        rows = sum(len(s) for s in stream)
        b = c.run.batch_size
        count = math.ceil(rows / b) if limit is None else min(limit, math.ceil(rows / b))
        for i in range(count):
            yield reader.rows(stream, i * b, min((i + 1) * b, rows)).to_batch()

    @torch.no_grad()
    def evaluate_full(self, model: HybridModel, rank: int, world_size: int, *,
                      quick: bool = False) -> dict[str, float] | None:
        if self.valid is None:
            return None
        emb = model.lookups
        _, world, group = dist_info(emb)
        device = getattr(emb, "device", torch.device("cpu"))
        scores, labels = [], []
        for b in self.heldout_batches(rank, world_size,
                                      self.cfg.output.eval_batches if quick else None):
            scores.append(self.forward(model, b.to(device)).float().cpu().numpy())
            labels.append(b.values["label"].numpy())
        if not scores:
            return {}
        score, label = np.concatenate(scores), np.concatenate(labels)
        out = {"auc": auc_over_ranks(score, label, world, group)}
        if quick:
            return out
        out["log_loss"] = log_loss_over_ranks(score, label, world, group)
        out["heldout_samples"] = summed_over_ranks(float(len(label)), world, group)
        return out



