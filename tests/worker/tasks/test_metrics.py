from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from worker.tasks.metrics import (
    auc_summary,
    batch_roc_auc,
    block_rank_counts,
    log_loss,
    log_loss_sum,
    merge_auc_summaries,
    ranking_metrics,
    ranking_metrics_from_sums,
    ranking_sums,
    ranks_from_counts,
    roc_auc,
    roc_auc_from_parts,
    roc_auc_from_summary,
)


def _brute_rank(scores: np.ndarray, true_id: int, filtered: set[int], policy: str) -> float:
    """The obvious way: drop filtered entities (except the answer), then rank the answer."""
    s_true = scores[true_id]
    others = [e for e in range(len(scores)) if e != true_id and e not in filtered]
    greater = sum(1 for e in others if scores[e] > s_true)
    equal = sum(1 for e in others if scores[e] == s_true)
    return {
        "optimistic": 1 + greater,
        "pessimistic": 1 + greater + equal,
        "realistic": 1 + greater + equal / 2,
    }[policy]


@pytest.mark.parametrize("policy", ["realistic", "optimistic", "pessimistic"])
@pytest.mark.parametrize("bounds", [[0, 40], [0, 13, 40], [0, 7, 21, 40]])
def test_blockwise_counts_sum_to_bruteforce_filtered_rank(policy: str, bounds: list[int]) -> None:
    rng = np.random.default_rng(0)
    b, e = 60, 40
    scores = rng.integers(0, 6, size=(b, e)).astype(np.float32)  # many ties
    true_ids = rng.integers(0, e, size=b)
    filt = rng.random((b, e)) < 0.2
    filt[np.arange(b)[::2], true_ids[::2]] = True  # the filter may include the answer itself
    st = torch.from_numpy(scores)
    tid = torch.from_numpy(true_ids)
    true_scores = st[torch.arange(b), tid]
    greater = torch.zeros(b, dtype=torch.long)
    equal = torch.zeros(b, dtype=torch.long)
    for a, z in itertools.pairwise(bounds):
        g, q = block_rank_counts(
            st[:, a:z],
            true_scores,
            block_start=a,
            true_ids=tid,
            filter_mask=torch.from_numpy(filt[:, a:z]),
        )
        greater += g
        equal += q
    ranks = ranks_from_counts(greater, equal, policy)
    want = [
        _brute_rank(scores[i], int(true_ids[i]), set(np.flatnonzero(filt[i]).tolist()), policy)
        for i in range(b)
    ]
    assert ranks.tolist() == want


def test_block_counts_accept_numpy_mask_and_no_filter() -> None:
    s = torch.tensor([[3.0, 1.0, 2.0, 5.0]])
    g, e = block_rank_counts(s, torch.tensor([2.0]), true_ids=torch.tensor([2]))
    assert (g.item(), e.item()) == (2, 0)
    g, e = block_rank_counts(
        s,
        torch.tensor([2.0]),
        true_ids=torch.tensor([2]),
        filter_mask=np.array([[0, 0, 0, 1]], bool),
    )
    assert (g.item(), e.item()) == (1, 0)
    # true entity outside this block: nothing skipped; equal scores count as ties
    g, e = block_rank_counts(s, torch.tensor([3.0]), block_start=10, true_ids=torch.tensor([2]))
    assert (g.item(), e.item()) == (1, 1)
    # NaN true score: ranked behind every unfiltered entity of the block
    g, e = block_rank_counts(s, torch.tensor([math.nan]), true_ids=torch.tensor([0]))
    assert (g.item(), e.item()) == (3, 0)
    with pytest.raises(ValueError):
        block_rank_counts(s, torch.tensor([1.0]), filter_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError):
        ranks_from_counts(g, e, "average")


def test_ranking_metrics_values_and_sums() -> None:
    ranks = torch.tensor([1.0, 2.0, 3.5, 10.0, 11.0])
    m = ranking_metrics(ranks)
    assert m["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 3.5 + 1 / 10 + 1 / 11) / 5)
    assert m["hits@1"] == pytest.approx(0.2)
    assert m["hits@3"] == pytest.approx(0.4)
    assert m["hits@10"] == pytest.approx(0.8)
    assert m["mr"] == pytest.approx(27.5 / 5)
    # sums from two "ranks" add up to the same metrics
    merged = ranking_sums(ranks[:2]) + ranking_sums(ranks[2:])
    assert ranking_metrics_from_sums(merged) == pytest.approx(m)


def _brute_auc(s: np.ndarray, y: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    total = 0.0
    for p in pos:
        for n in neg:
            total += 1.0 if p > n else 0.5 if p == n else 0.0
    return total / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pairwise_bruteforce_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 300
    y = (rng.random(n) < 0.3).astype(np.int64)
    s = np.round(rng.normal(size=n) + y, 1)  # coarse values: many ties, some across classes
    want = _brute_auc(s, y)
    assert roc_auc(s, y) == pytest.approx(want, abs=1e-12)
    assert roc_auc(torch.from_numpy(s).float(), torch.from_numpy(y).float()) == pytest.approx(
        _brute_auc(s.astype(np.float32).astype(np.float64), y), abs=1e-12
    )
    parts = [(s[:100], y[:100]), (s[100:250], y[100:250]), (s[250:], y[250:])]
    assert roc_auc_from_parts(parts) == pytest.approx(want, abs=1e-12)
    summ = merge_auc_summaries(auc_summary(a, b) for a, b in parts)
    assert roc_auc_from_summary(summ) == pytest.approx(want, abs=1e-12)


def test_auc_edge_cases() -> None:
    assert roc_auc([1.0, 1.0, 1.0], [0, 1, 0]) == 0.5
    assert roc_auc([0.1, 0.9], [0, 1]) == 1.0
    assert roc_auc([0.9, 0.1], [0, 1]) == 0.0
    with pytest.raises(ValueError):
        roc_auc([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError):
        roc_auc([0.1, math.nan], [0, 1])


def test_log_loss_matches_torch_bce() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g, dtype=torch.float64) * 5
    y = (torch.rand(1000, generator=g) < 0.4).double()
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits, y).item()
    assert log_loss(logits, y) == pytest.approx(want, rel=1e-12)
    p = torch.sigmoid(logits).clamp(1e-7, 1 - 1e-7)
    want_p = torch.nn.functional.binary_cross_entropy(p, y).item()
    assert log_loss(p.numpy(), y.numpy(), from_logits=False) == pytest.approx(want_p, rel=1e-9)
    total, n = log_loss_sum(logits, y)
    assert n == 1000 and total / n == pytest.approx(want, rel=1e-12)
    # extreme logits stay finite
    assert math.isfinite(log_loss(np.array([1000.0, -1000.0]), np.array([0.0, 1.0])))


def test_batch_roc_auc_is_a_scalar_tensor_and_nan_without_both_classes() -> None:
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    value = batch_roc_auc(scores, labels)
    assert value.shape == () and value.dtype == torch.float32
    assert float(value) == pytest.approx(roc_auc(scores.numpy(), labels.numpy()))
    assert float(value) == pytest.approx(0.75)
    assert math.isnan(float(batch_roc_auc(scores, torch.ones(4))))
