"""The fused block losses (worker/tasks/kge/scoring.py) against plain autograd formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.tasks.kge.scoring import block_loss


def _case(seed: int = 0, q: int = 7, e: int = 11, d: int = 5):
    g = torch.Generator().manual_seed(seed)
    q_QD = torch.randn(q, d, generator=g, dtype=torch.float64, requires_grad=True)
    bias_Q = torch.randn(q, generator=g, dtype=torch.float64, requires_grad=True)
    block_ED = torch.randn(e, d, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.rand(q, e, generator=g) < 0.2
    target[0, 3] = True
    rows, cols = target.nonzero(as_tuple=True)
    return q_QD, bias_Q, block_ED, target, rows, cols


def _grads(loss: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, xs))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_bce_equals_autograd_bce_over_the_dense_target(smoothing: float) -> None:
    q_QD, bias_Q, block_ED, target, rows, cols = _case()
    num_entities = 40  # the block is part of a larger table: smoothing spreads over all
    scale = 0.37
    fused = block_loss("bce", q_QD, bias_Q, block_ED, rows, cols, scale=scale,
                       num_entities=num_entities, label_smoothing=smoothing)
    t = target.double() * (1 - smoothing) + smoothing / num_entities
    plain = F.binary_cross_entropy_with_logits(q_QD @ block_ED.t() + bias_Q[:, None], t,
                                               reduction="sum") * scale
    torch.testing.assert_close(fused, plain)
    for a, b in zip(_grads(fused, q_QD, bias_Q, block_ED), _grads(plain, q_QD, bias_Q, block_ED),
                    strict=True):
        torch.testing.assert_close(a, b)


def test_ce_equals_autograd_softmax_cross_entropy_with_weights() -> None:
    q_QD, bias_Q, block_ED, target, rows, cols = _case(1)
    counts = target.sum(1).clamp(min=1).double()
    weights = 1.0 / counts[rows]  # KvsAll + CE: the target distribution is uniform on positives
    scale = 1.7
    fused = block_loss("ce", q_QD, bias_Q, block_ED, rows, cols, weights_P=weights, scale=scale,
                       num_entities=11)
    s = q_QD @ block_ED.t() + bias_Q[:, None]
    dist = target.double() / counts[:, None]
    plain = (torch.logsumexp(s, 1).sum() - (dist * s).sum()) * scale
    torch.testing.assert_close(fused, plain)
    for a, b in zip(_grads(fused, q_QD, bias_Q, block_ED), _grads(plain, q_QD, bias_Q, block_ED),
                    strict=True):
        torch.testing.assert_close(a, b)


def test_ce_one_positive_is_cross_entropy() -> None:
    q_QD, bias_Q, block_ED, _, _, _ = _case(2)
    true = torch.tensor([0, 3, 10, 2, 2, 5, 7])
    fused = block_loss("ce", q_QD, bias_Q, block_ED, torch.arange(7), true, scale=1 / 7,
                       num_entities=11)
    plain = F.cross_entropy(q_QD @ block_ED.t() + bias_Q[:, None], true)
    torch.testing.assert_close(fused, plain)
    for a, b in zip(_grads(fused, q_QD, block_ED), _grads(plain, q_QD, block_ED), strict=True):
        torch.testing.assert_close(a, b)
