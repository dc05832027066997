"""Scoring a global batch of queries against the entity rows one rank owns, fused with the loss.

KvsAll and 1vsAll score every query vector q (of the global batch, all-gathered) against every
owned entity row: S = q @ block^T + bias, a [Q, E_r] matrix. A plain autograd graph of
``scores -> BCE(scores, dense multi-hot target)`` builds the dense [Q, E_r] target in numpy,
converts it, keeps the scores, the target and the loss's own temporaries for backward, and
runs several elementwise passes over Q x E_r. Here one autograd Function per loss does it in
about the cost of the two matmuls:

    forward   S = addmm(bias, q, block^T)       (kept for backward, the only [Q, E_r] buffer)
              BCE: sum softplus(S) - sum t * S   (t known from the sparse positives alone)
              CE:  row max and sum exp over S, all-reduced over ranks (the only collective)
    backward  G = sigmoid(S) or exp(S - lse), in place in S; G[positives] -= their targets;
              grad q = G @ block, grad block = G^T @ q, grad bias = row sums of G

Targets are sparse: ``rows``/``cols`` (int64 [P]) are the (query, owned column) positions of
the positive entities inside this block, ``weights`` [P] their target mass.

Losses (what the value is; both are sums scaled by ``scale``, see below):
    bce  sum over all (q, e) cells of BCE-with-logits(S, t), t = (1 - ls) * y + ls / num_entities
         (label smoothing as in ConvE/TuckER; ls = 0: plain multi-hot).
    ce   sum over queries of  lse_q - sum_{positives p of q} w_p * S_p, where lse_q is the
         log-sum-exp of q's scores over ALL entities (every rank's block): softmax
         cross-entropy (1vsAll: one positive, w = 1; KvsAll + CE: w = 1 / #positives).

Sharding. Each rank returns ``scale * (its local part)``, where the lse term is split evenly
(lse / world on every rank) so the values sum over ranks to the whole loss. Backward assumes
what the training loop guarantees: every rank's loss is scaled the same way and gets the same
upstream gradient, so the gradient of the summed loss w.r.t. this rank's scores is
``g * scale * (softmax - targets)``: the softmax over all entities needs no collective in
backward (lse is kept from forward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["block_loss", "block_scores"]

LOSSES = ("bce", "ce")


def block_scores(q_QD: torch.Tensor, bias_Q: torch.Tensor | None,
                 block_ED: torch.Tensor) -> torch.Tensor:
    """[Q, E] = q @ block^T (+ bias per query): one matmul (addmm)."""
    if bias_Q is None:
        return q_QD @ block_ED.t()
    return torch.addmm(bias_Q.unsqueeze(1), q_QD, block_ED.t())


class _BlockBCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_QD: torch.Tensor, bias_Q: torch.Tensor, block_ED: torch.Tensor,
                rows_P: torch.Tensor, cols_P: torch.Tensor, smoothing: float,
                num_entities: int, scale: float) -> torch.Tensor:
        s_QE = block_scores(q_QD, bias_Q, block_ED)
        positive = s_QE[rows_P, cols_P].sum()
        # sum softplus(S) = sum S - sum logsigmoid(S): one cheaper elementwise pass
        total = s_QE.sum()
        value = total - F.logsigmoid(s_QE).sum() - (1.0 - smoothing) * positive
        if smoothing:
            value = value - (smoothing / num_entities) * total
        ctx.save_for_backward(q_QD, block_ED, s_QE, rows_P, cols_P)
        ctx.smoothing, ctx.num_entities, ctx.scale = smoothing, num_entities, scale
        return value * scale

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q_QD, block_ED, s_QE, rows_P, cols_P = ctx.saved_tensors
        g_QE = s_QE.sigmoid_()  # S is not needed any more: the gradient takes its memory
        g_QE.index_put_((rows_P, cols_P), g_QE.new_full(rows_P.shape, ctx.smoothing - 1.0),
                        accumulate=True)
        if ctx.smoothing:
            g_QE.sub_(ctx.smoothing / ctx.num_entities)
        g_QE.mul_(grads[0] * ctx.scale)
        return _linear_grads(ctx, q_QD, block_ED, g_QE) + (None,) * 5


class _BlockCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_QD: torch.Tensor, bias_Q: torch.Tensor, block_ED: torch.Tensor,
                rows_P: torch.Tensor, cols_P: torch.Tensor, weights_P: torch.Tensor,
                world_size: int, group: dist.ProcessGroup | None, scale: float
                ) -> torch.Tensor:
        s_QE = block_scores(q_QD, bias_Q, block_ED)
        if s_QE.shape[1]:
            max_Q = s_QE.amax(dim=1)
        else:  # a rank that owns no row: neutral for the max (sum exp adds 0)
            max_Q = s_QE.new_full((s_QE.shape[0],), float("-inf"))
        if world_size > 1:
            dist.all_reduce(max_Q, op=dist.ReduceOp.MAX, group=group)
        sumexp_Q = (s_QE - max_Q.unsqueeze(1)).exp_().sum(dim=1)
        if world_size > 1:
            dist.all_reduce(sumexp_Q, group=group)
        lse_Q = max_Q + sumexp_Q.log()
        positive = (s_QE[rows_P, cols_P] * weights_P).sum()
        ctx.save_for_backward(q_QD, block_ED, s_QE, lse_Q, rows_P, cols_P, weights_P)
        ctx.scale = scale
        return (lse_Q.sum() / world_size - positive) * scale

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q_QD, block_ED, s_QE, lse_Q, rows_P, cols_P, weights_P = ctx.saved_tensors
        g_QE = s_QE.sub_(lse_Q.unsqueeze(1)).exp_()  # softmax over all entities, in place
        g_QE.index_put_((rows_P, cols_P), -weights_P, accumulate=True)
        g_QE.mul_(grads[0] * ctx.scale)
        return _linear_grads(ctx, q_QD, block_ED, g_QE) + (None,) * 6


def _linear_grads(ctx: Any, q_QD: torch.Tensor, block_ED: torch.Tensor, g_QE: torch.Tensor
                  ) -> tuple[torch.Tensor | None, ...]:
    need_q, need_bias, need_block = ctx.needs_input_grad[:3]
    grad_q = g_QE @ block_ED if need_q else None
    grad_bias = g_QE.sum(dim=1) if need_bias else None
    grad_block = g_QE.t() @ q_QD if need_block else None
    return grad_q, grad_bias, grad_block


def block_loss(loss: str, q_QD: torch.Tensor, bias_Q: torch.Tensor | None,
               block_ED: torch.Tensor, rows_P: torch.Tensor, cols_P: torch.Tensor, *,
               scale: float, num_entities: int, weights_P: torch.Tensor | None = None,
               label_smoothing: float = 0.0, world_size: int = 1,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's share of the loss of queries `q` against its owned rows (module doc)."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not one of {LOSSES}")
    if bias_Q is None:
        bias_Q = q_QD.new_zeros(q_QD.shape[0])
    if loss == "bce":
        out = _BlockBCE.apply(q_QD, bias_Q, block_ED, rows_P, cols_P, float(label_smoothing),
                              int(num_entities), float(scale))
    else:
        if weights_P is None:
            weights_P = q_QD.new_ones(rows_P.shape)
        out = _BlockCE.apply(q_QD, bias_Q, block_ED, rows_P, cols_P,
                             weights_P.to(q_QD.dtype), int(world_size), group, float(scale))
    assert isinstance(out, torch.Tensor)
    return out
