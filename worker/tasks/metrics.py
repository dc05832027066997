"""Evaluation metrics that combine across ranks by summation.

Link prediction (filtered, shard-parallel)
    For a batch of queries ``(e, r, true)`` each rank scores the queries against the entity rows
    it owns, ``[start, end)``, and calls ``block_rank_counts``: per query, the number of
    entities in the block that score strictly higher than the true entity (``greater``) and the
    number that tie with it (``equal``), skipping filtered entities (known true answers of the
    query from train + valid + test) and the true entity itself. Summing the counts over all
    blocks (an all-reduce) gives the full filtered counts, and

        rank = 1 + greater + equal / 2        ("realistic", the default)

    i.e. the expected rank when ties are broken uniformly at random; it is the mean of the
    "optimistic" (1 + greater) and "pessimistic" (1 + greater + equal) ranks. This is PyKEEN's
    default rank type. (dicee ranks with ``argsort``, which breaks exact ties by position; with
    float scores exact ties are rare and the difference is negligible.) A NaN true score is
    ranked last among the unfiltered entities of the block.

    Head prediction is not a separate code path: with reciprocal relations the head query of
    ``(h, r, t)`` is the tail query ``(t, r + R, ?)`` with answer h (see
    ``kge_data.eval_queries``), and the metrics average over both directions.

    Caveat: take ``true_scores`` from the same kernel as the block scores where possible (for
    example gather the true column on the rank that owns it); a true score computed by another
    code path can differ in the last bits, which only matters for near-exact ties.

Binary classification (CTR)
    ``roc_auc`` is exact: the Mann-Whitney statistic with ties counted as 1/2 (equivalently the
    area under the ROC curve with ties drawn as diagonal segments), via one sort.
    For several ranks: ``auc_summary`` reduces local scores to (sorted distinct values,
    positives per value, negatives per value); summaries merge exactly
    (``merge_auc_summaries``) and ``roc_auc_from_summary`` gives the same AUC as on the
    concatenated data. The simplest correct distributed recipe is to all-gather each rank's
    summary (or its raw scores and labels) and compute on one rank.
    ``log_loss`` is the mean binary cross-entropy (from logits by default); ``log_loss_sum``
    returns (sum, count) for an all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "AucSummary",
    "auc_over_ranks",
    "auc_summary",
    "batch_roc_auc",
    "block_rank_counts",
    "log_loss",
    "log_loss_over_ranks",
    "log_loss_sum",
    "merge_auc_summaries",
    "ranking_metrics",
    "ranking_metrics_from_sums",
    "ranking_sums",
    "ranks_from_counts",
    "roc_auc",
    "roc_auc_from_parts",
    "roc_auc_from_summary",
    "summed_over_ranks",
]

TIE_POLICIES = ("realistic", "optimistic", "pessimistic")
ArrayLike = Tensor | np.ndarray | Sequence[float]
HITS_AT = (1, 3, 10)


# --------------------------------------------------------------------------- ranking


def block_rank_counts(
    block_scores: Tensor,
    true_scores: Tensor,
    *,
    block_start: int = 0,
    true_ids: Tensor | None = None,
    filter_mask: Tensor | np.ndarray | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-query (greater, equal) counts within one entity block ``[block_start, block_start+E)``.

    block_scores: [B, E] scores of each query against the block's entities.
    true_scores:  [B] score of each query's true entity (wherever it lives).
    true_ids:     [B] global id of the true entity; its column, when inside this block, is
                  never counted (so its own score cannot count against it).
    filter_mask:  [B, E] bool, True = skip this entity (filtered). May include the true entity.
    Returns two int64 [B] tensors; sum them over all blocks before ``ranks_from_counts``.
    """
    if block_scores.dim() != 2 or true_scores.shape != (block_scores.shape[0],):
        raise ValueError(
            f"need block_scores [B, E] and true_scores [B], got {tuple(block_scores.shape)} "
            f"and {tuple(true_scores.shape)}"
        )
    b, e = block_scores.shape
    keep = torch.ones(b, e, dtype=torch.bool, device=block_scores.device)
    if filter_mask is not None:
        fm = torch.as_tensor(filter_mask, device=block_scores.device)
        if fm.shape != (b, e) or fm.dtype != torch.bool:
            raise ValueError(
                f"filter_mask must be bool [{b}, {e}], got {fm.dtype} {tuple(fm.shape)}"
            )
        keep &= ~fm
    if true_ids is not None:
        local = true_ids.to(block_scores.device).long() - block_start
        inside = (local >= 0) & (local < e)
        rows = torch.nonzero(inside).squeeze(1)
        keep[rows, local[rows]] = False
    ts = true_scores.to(block_scores.dtype).unsqueeze(1)
    greater = ((block_scores > ts) & keep).sum(dim=1)
    equal = ((block_scores == ts) & keep).sum(dim=1)
    nan_true = torch.isnan(true_scores)
    if bool(nan_true.any()):
        greater = torch.where(nan_true, keep.sum(dim=1), greater)
        equal = torch.where(nan_true, torch.zeros_like(equal), equal)
    return greater.long(), equal.long()


def ranks_from_counts(greater: Tensor, equal: Tensor, tie_policy: str = "realistic") -> Tensor:
    """Filtered ranks (float64, 1 = best) from counts summed over all blocks."""
    g = greater.double()
    e = equal.double()
    if tie_policy == "realistic":
        return 1.0 + g + 0.5 * e
    if tie_policy == "optimistic":
        return 1.0 + g
    if tie_policy == "pessimistic":
        return 1.0 + g + e
    raise ValueError(f"tie_policy must be one of {TIE_POLICIES}, got {tie_policy!r}")


def ranking_sums(ranks: Tensor, ks: Sequence[int] = HITS_AT) -> Tensor:
    """[count, sum(1/rank), sum(rank), sum(rank <= k) for k in ks] as float64: all-reducible."""
    r = ranks.double().reshape(-1)
    parts = [
        torch.tensor(float(r.numel()), dtype=torch.float64),
        (1.0 / r).sum(),
        r.sum(),
        *[(r <= k).sum().double() for k in ks],
    ]
    return torch.stack([p.to(torch.float64).cpu() for p in parts])


def ranking_metrics_from_sums(sums: Tensor, ks: Sequence[int] = HITS_AT) -> dict[str, float]:
    n = float(sums[0])
    if n == 0:
        raise ValueError("no ranks")
    out = {"mrr": float(sums[1]) / n, "mr": float(sums[2]) / n}
    for i, k in enumerate(ks):
        out[f"hits@{k}"] = float(sums[3 + i]) / n
    return out


def ranking_metrics(ranks: Tensor | np.ndarray, ks: Sequence[int] = HITS_AT) -> dict[str, float]:
    """{"mrr", "mr", "hits@1", "hits@3", "hits@10"} (or the given ks) from ranks."""
    return ranking_metrics_from_sums(ranking_sums(torch.as_tensor(ranks), ks), ks)


# --------------------------------------------------------------------------- AUC

AucSummary = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(distinct scores ascending [float64], positives per score [int64], negatives per score)."""


def _np(x: ArrayLike) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def auc_summary(scores: ArrayLike, labels: ArrayLike) -> AucSummary:
    """Exact, mergeable reduction of (scores, binary labels) for AUC."""
    s = _np(scores).astype(np.float64).reshape(-1)
    y = _np(labels).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in size: {s.shape} vs {y.shape}")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    pos = y > 0.5
    values, inv = np.unique(s, return_inverse=True)
    npos = np.bincount(inv, weights=pos, minlength=len(values)).astype(np.int64)
    nneg = np.bincount(inv, weights=~pos, minlength=len(values)).astype(np.int64)
    return values, npos, nneg


def merge_auc_summaries(parts: Iterable[AucSummary]) -> AucSummary:
    parts = list(parts)
    if not parts:
        return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64)
    v = np.concatenate([p[0] for p in parts])
    values, inv = np.unique(v, return_inverse=True)
    npos = np.bincount(inv, weights=np.concatenate([p[1] for p in parts]), minlength=len(values))
    nneg = np.bincount(inv, weights=np.concatenate([p[2] for p in parts]), minlength=len(values))
    return values, npos.astype(np.int64), nneg.astype(np.int64)


def roc_auc_from_summary(summary: AucSummary) -> float:
    """P(score_pos > score_neg) + 0.5 P(equal), over all positive/negative pairs."""
    _, npos, nneg = summary
    p = npos.astype(np.float64)
    n = nneg.astype(np.float64)
    tot_p, tot_n = p.sum(), n.sum()
    if tot_p == 0 or tot_n == 0:
        raise ValueError("ROC AUC needs at least one positive and one negative label")
    neg_below = np.cumsum(n) - n
    return float((p * (neg_below + 0.5 * n)).sum() / (tot_p * tot_n))


def roc_auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """Exact ROC AUC (Mann-Whitney U / (n_pos n_neg), ties count 1/2). Labels: 1 = positive."""
    return roc_auc_from_summary(auc_summary(scores, labels))


def batch_roc_auc(scores_B: Tensor, labels_B: Tensor) -> Tensor:
    """roc_auc of one batch as a float32 scalar on the scores' device (a task's per-batch
    `evaluate` metric, averaged over batches by the trainer); nan without both classes."""
    try:
        value = roc_auc(scores_B.detach().float().cpu(), labels_B.detach().cpu())
    except ValueError:
        value = float("nan")
    return torch.tensor(value, dtype=torch.float32, device=scores_B.device)


def roc_auc_from_parts(
    parts: Iterable[tuple[ArrayLike, ArrayLike]],
) -> float:
    """AUC of the union of several ranks' (scores, labels), e.g. after an all-gather."""
    return roc_auc_from_summary(merge_auc_summaries(auc_summary(s, y) for s, y in parts))


# --------------------------------------------------------------------------- log loss


def log_loss_sum(
    scores: ArrayLike,
    labels: ArrayLike,
    *,
    from_logits: bool = True,
    eps: float = 1e-7,
) -> tuple[float, int]:
    """(sum of binary cross-entropies, count), float64.

    ``from_logits``: scores are logits (numerically stable form, like BCEWithLogitsLoss);
    otherwise probabilities, clipped to [eps, 1 - eps].
    """
    s = _np(scores).astype(np.float64).reshape(-1)
    y = _np(labels).astype(np.float64).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in size: {s.shape} vs {y.shape}")
    if from_logits:
        losses = np.maximum(s, 0.0) - s * y + np.log1p(np.exp(-np.abs(s)))
    else:
        pr = np.clip(s, eps, 1.0 - eps)
        losses = -(y * np.log(pr) + (1.0 - y) * np.log1p(-pr))
    return float(losses.sum()), int(s.size)


def log_loss(
    scores: ArrayLike,
    labels: ArrayLike,
    *,
    from_logits: bool = True,
    eps: float = 1e-7,
) -> float:
    """Mean binary cross-entropy."""
    total, n = log_loss_sum(scores, labels, from_logits=from_logits, eps=eps)
    if n == 0:
        raise ValueError("log_loss of no samples")
    return total / n


def summed_over_ranks(value: float, world: int, group: dist.ProcessGroup | None) -> float:
    """`value` summed over the `world` ranks of `group` (float64; world 1: itself)."""
    t = torch.tensor([value], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, group=group)
    return float(t)


def auc_over_ranks(score: np.ndarray, label: np.ndarray, world: int,
                   group: dist.ProcessGroup | None) -> float:
    """ROC AUC of every rank's (score, label) together: each rank's summary all-gathered
    and merged, so it equals the AUC of the concatenated samples."""
    summary = auc_summary(score, label)
    parts: list[AucSummary | None] = [summary]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, summary, group=group)
    return roc_auc_from_summary(merge_auc_summaries(p for p in parts if p is not None))


def log_loss_over_ranks(score: np.ndarray, label: np.ndarray, world: int,
                        group: dist.ProcessGroup | None) -> float:
    """Mean log loss of every rank's samples together, from all-reduced sums."""
    total, n = log_loss_sum(score, label)
    return (summed_over_ranks(total, world, group)
            / summed_over_ranks(float(n), world, group))
