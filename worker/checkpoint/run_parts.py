"""The parts of a training run's checkpoint, in the order they save and restore: the rows
(with the pending updates lent while they are written), the dynamic slot maps (after the
rows: a restore empties the rows of slots whose id moved), the staleness window (its
saved rows overwrite the canonical ones on a resume), the update source, the dense part,
the data position."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.checkpoint.data import DataPart
from worker.checkpoint.dense import DensePart
from worker.checkpoint.parts import CheckpointPart
from worker.checkpoint.source import SourcePart
from worker.checkpoint.tables import DynamicMapsPart, TablesPart
from worker.checkpoint.window import WindowPart

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hybridps.optim import OptimizerSpec
    from worker.config.train_config import TrainConfig
    from worker.config.update_kinds import UpdateKind
    from worker.embedding.sharded import ShardedEmbedding
    from worker.tasks.base import Task
    from worker.updates.source import StalenessWindow, UpdateSource


def run_parts(cfg: TrainConfig, *, rank: int, world_size: int, embedding: ShardedEmbedding,
              window: StalenessWindow, source: UpdateSource, source_kind: UpdateKind,
              sparse_spec: OptimizerSpec, dense: nn.Module, dense_opt: torch.optim.Optimizer,
              scaler: Any, task: Task) -> list[CheckpointPart]:
    pending = WindowPart(embedding, window, cfg.optim.row_dtype)
    return [TablesPart(embedding, cfg.optim.row_dtype, pending.applied),
            DynamicMapsPart(embedding),
            pending,
            SourcePart(source, source_kind, sparse_spec),
            DensePart(dense, dense_opt, scaler, rank=rank, optim=cfg.optim,
                      loss_scale_init=cfg.dense.loss_scale_init),
            DataPart(task, rank=rank, world_size=world_size, batch_size=cfg.run.batch_size)]
