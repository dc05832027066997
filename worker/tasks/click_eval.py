"""Held-out metrics of the planted click tasks (synthetic, tables), computed over all ranks.

The tasks make held-out batches (`eval_batch`) whose labels were drawn from a planted logit
(`values["planted_logit"]`), so besides the model's log loss and accuracy the planted
model's own loss and AUC are known: the best any model can reach on those samples (the
plot draws them as reference lines). Sums are all-reduced and the ROC AUC is exact over
every rank's samples (mergeable summaries, worker/metrics.py), so the numbers are those of
the concatenated held-out set, whatever the world size.

`quick` (the --eval-every points during training): loss and auc only.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from worker.gather import dist_info
from worker.metrics import auc_summary, merge_auc_summaries, roc_auc_from_summary
from worker.tasks.base import Batch, HybridModel


class PlantedClickTask(Protocol):
    def eval_batch(self, index: int, rank: int, world_size: int) -> Batch | None: ...

    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor: ...


@torch.no_grad()
def planted_click_metrics(task: PlantedClickTask, model: HybridModel, batches: int,
                          quick: bool = False) -> dict[str, float]:
    """{loss, auc} (quick) or {loss, accuracy, auc, planted_loss, planted_auc} over the
    first `batches` held-out global batches (a collective: every rank calls it)."""
    emb = model.lookups
    rank, world, group = dist_info(emb)
    device = getattr(emb, "device", torch.device("cpu"))
    sums = torch.zeros(4, dtype=torch.float64)  # bce, planted bce, correct, samples
    logits, planted, labels = [], [], []
    for index in range(batches):
        batch = task.eval_batch(index, rank, world)
        if batch is None:
            break
        logit_B = task.forward(model, batch.to(device)).float().cpu()
        label_B, plant_B = batch.values["label"].float(), batch.values["planted_logit"].float()
        sums += torch.stack([
            F.binary_cross_entropy_with_logits(logit_B, label_B, reduction="sum").double(),
            F.binary_cross_entropy_with_logits(plant_B, label_B, reduction="sum").double(),
            ((logit_B > 0).float() == label_B).sum().double(),
            torch.tensor(float(label_B.numel()), dtype=torch.float64)])
        logits.append(logit_B.numpy())
        planted.append(plant_B.numpy())
        labels.append(label_B.numpy())
    if world > 1:  # on the rows' device: NCCL reduces device tensors only
        on_device = sums.to(device)
        dist.all_reduce(on_device, group=group)
        sums = on_device.cpu()
    if sums[3] == 0:
        return {}
    label = np.concatenate(labels)
    out = {"loss": float(sums[0] / sums[3]), "auc": _auc(np.concatenate(logits), label,
                                                         world, group)}
    if not quick:
        out["accuracy"] = float(sums[2] / sums[3])
        out["planted_loss"] = float(sums[1] / sums[3])
        out["planted_auc"] = _auc(np.concatenate(planted), label, world, group)
    return out


def _auc(score: np.ndarray, label: np.ndarray, world: int,
         group: dist.ProcessGroup | None) -> float:
    """Exact AUC of every rank's (score, label) together; nan when one class is missing."""
    parts: list[Any] = [auc_summary(score, label)]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, auc_summary(score, label), group=group)
    summary = merge_auc_summaries(parts)
    if summary[1].sum() == 0 or summary[2].sum() == 0:
        return float("nan")
    return roc_auc_from_summary(summary)
