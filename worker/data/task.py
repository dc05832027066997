"""`--task files`: click prediction trained from files (docs/data.md).

    torchrun ... worker/main.py --task files --train-files 'data/train-*.parquet' \\
        --valid-files 'data/valid-*.parquet' --num-rows 100000 --dim 16 --epochs 2

The columns (worker/data/features.py): `label`, `dense_*`, `cat_*` (one table each; a
list<int64> column is a bag pooled by --pooling), or what --features (or a subclass's
`features()`) names. The batches come from a FileSource (worker/data/source.py: the
checks of the files, each rank's share, --epochs, the reading position in a checkpoint).
The model: each table's (pooled) rows concatenated with the dense features -> MLP
(64, 32) -> logit, BCE loss.
Evaluation on --valid-files, as the dlrm task does: exact AUC and log loss over the ranks'
shares of it (floor(rows / W) rows each, in file order; the quick one during training over
the first --eval-batches batches of each share, the final one over all of them).

A custom task reads the same path: subclass FilesTask (override `features`, `build_dense`
and `forward`), or hold a FileSource itself (docs/custom_model.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from worker.config.train_config import TrainConfig
from worker.data.source import FileSource, scan
from worker.runtime.gather import dist_info
from worker.tasks.base import Batch, HybridModel, TableConfig, Task
from worker.tasks.click import click_mlp
from worker.tasks.metrics import auc_over_ranks, log_loss_over_ranks, summed_over_ranks

__all__ = ["FilesTask", "scan"]


class FilesTask(Task):
    """Click prediction from --train-files (module doc)."""

    name = "files"

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        self.source = FileSource(cfg, self.features(), what=f"task {self.name!r}: features()")
        self.spec = self.source.spec

    def features(self) -> Mapping[str, Any] | None:
        """The columns and tables, as a --features document (worker/data/features.py);
        None: --features FILE, else by convention."""
        return None

    # -- Task interface -----------------------------------------------------------------
    def tables(self) -> list[TableConfig]:
        return [TableConfig(t.name, t.rows, t.dim, t.dynamic, t.sharding)
                for t in self.spec.tables]

    def input_width(self) -> int:
        return sum(t.dim for t in self.spec.tables) + len(self.spec.dense)

    def build_dense(self) -> nn.Module:
        return click_mlp(self.input_width())

    def global_batch(self, step: int, world_size: int) -> Batch:
        return self.source.global_batch(step, world_size)

    def batch(self, step: int, rank: int, world_size: int) -> Batch:
        return self.source.batch(step, rank, world_size)

    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.forward(model, batch),
                                                  batch.values["label"])

    def steps_per_epoch(self, world_size: int) -> int | None:
        return self.source.steps_per_epoch(world_size)

    def steps_for_epochs(self, epochs: int, world_size: int) -> int | None:
        return self.source.steps_for_epochs(epochs, world_size)

    def data_state(self, next_step: int) -> dict[str, Any] | None:
        return self.source.data_state(next_step)

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None:
        self.source.load_data_state(states_by_rank, next_step)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), **self.source.describe()}

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
        """This rank's share of --valid-files (FileSource.heldout_batches)."""
        return self.source.heldout_batches(rank, world_size, limit)

    @torch.no_grad()
    def evaluate_full(self, model: HybridModel, rank: int, world_size: int, *,
                      quick: bool = False) -> dict[str, float] | None:
        if self.source.valid is None:
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



