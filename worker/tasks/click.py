"""What the generated click-prediction tasks (synthetic, tables) share.

Both make the GLOBAL batch of a step from (seed, stream, index) alone (`generate`; train
batches are stream TRAIN_STREAM, held-out ones EVAL_STREAM) and feed the tables' rows,
concatenated with NUM-dense features, to the same small MLP that gives a click logit
(`forward`), trained with BCE.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from worker.tasks.base import Batch, HybridModel, Task

TRAIN_STREAM, EVAL_STREAM = 0, 1


def click_mlp(width: int) -> nn.Sequential:
    """width -> 64 -> 32 -> 1 with ReLUs: the click model's dense part."""
    return nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, 1))


def click_mlp_parameters(width: int) -> int:
    """Parameters of click_mlp(width) (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in click_mlp(width).parameters())


class ClickTask(Task):
    """A generated click-prediction task: subclasses say the dense input width, how a
    batch is generated and how the model reads it."""

    @abstractmethod
    def input_width(self) -> int:
        """Features the MLP reads per sample (the rows' widths + dense features)."""

    @abstractmethod
    def generate(self, stream: int, index: int, size: int) -> Batch:
        """`size` samples of batch `index` of `stream`, a pure function of (seed, both)."""

    @abstractmethod
    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        """logit_B of the model for a batch (the lookup order is fixed: collectives)."""

    def build_dense(self) -> nn.Module:
        return click_mlp(self.input_width())

    def global_batch(self, step: int, world_size: int) -> Batch:
        return self.generate(TRAIN_STREAM, step, world_size * self.cfg.run.batch_size)

    def eval_batch(self, index: int, rank: int, world_size: int) -> Batch | None:
        b = self.cfg.run.batch_size
        return self.generate(EVAL_STREAM, index, world_size * b).slice(rank * b, (rank + 1) * b)

    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.forward(model, batch),
                                                  batch.values["label"])
