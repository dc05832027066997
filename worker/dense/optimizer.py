"""The run's optimizers as its config section says: the dense part's torch.optim optimizer
and the embedding rows' OptimizerSpec. Both read the sparse kind's record
(hybridps/optim_kinds.py): --dense-optimizer auto is its `dense` counterpart, and
DENSE_OPTIMIZERS says which torch.optim class each --dense-optimizer is."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hybridps.optim_kinds import DENSE_OPTIMIZERS, OptimizerSpec
from worker.config.train_config import OptimConfig


def sparse_optimizer_spec(optim_cfg: OptimConfig) -> OptimizerSpec:
    """The embedding rows' optimizer (SparseAdam's defaults for betas/eps)."""
    o = optim_cfg
    return OptimizerSpec(kind=o.optimizer, lr=o.lr, weight_decay=o.weight_decay)


def make_dense_optimizer(optim_cfg: OptimConfig, params: Iterable[nn.Parameter]
                         ) -> torch.optim.Optimizer:
    """--dense-optimizer (auto: the sparse kind's dense counterpart, e.g. adam -> Adam,
    the Adagrad kinds -> Adagrad, partial_rowwise_adam -> Adam), at --dense-lr (shared with
    the reference).

    foreach: one dispatch per op for all parameters instead of one per parameter; torch
    picks it by itself only on CUDA, and on the CPU the per-parameter loop over FSDP's
    DTensors is a visible part of a small model's step (docs/performance-log.md)."""
    o = optim_cfg
    dense = DENSE_OPTIMIZERS[o.dense_kind]
    kwargs: dict[str, Any] = {"lr": o.dense_lr, "weight_decay": o.weight_decay}
    if dense.foreach:
        kwargs["foreach"] = True
    optimizer: torch.optim.Optimizer = getattr(torch.optim, dense.torch_class)(list(params),
                                                                               **kwargs)
    return optimizer
