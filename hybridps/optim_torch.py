"""The torch reference of every row kernel (any device and dtype): hybridps/optim.py runs
these when the native kernels do not take the tensors, and the tests hold the native
kernels (hybridps/native/) to them. No grpc in this module.

Every function updates the state rows `ids_U` of its tensors in place and returns
(delta_UD, decay): the caller applies rows[ids] = rows[ids] * decay + delta.

The float32 operations are fixed here, op for op, so that the native loops can repeat
them exactly:
- adam/adamw: those of torch.optim.SparseAdam / torch.optim.AdamW (single tensor);
- the row-wise kinds sum a row's g^2 in one fixed order (`row_mean_sq`: 8 lanes, then a
  fixed tree), which the C loop repeats with 8 accumulators;
- the new kinds take sqrt in float64 and round it to float32 (`sqrt_f32`): that is the
  correctly rounded float32 sqrt (53 >= 2*24 + 2 bits, so the double rounding is
  innocuous), the C library's sqrtf. torch's own float32 sqrt is off by an ulp now and
  then (MKL), which is why adam's deltas agree with the native ones to a few ulps only;
  the new kinds' deltas are bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridps.errors import NonFiniteUpdate
from hybridps.optim_kinds import OptimizerSpec

ROW_SUM_LANES = 8  # native: ROW_LANES in hybridps/native/row_optim.c


def all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 sqrt of float32 `x` (see the module doc)."""
    return x.double().sqrt().to(x.dtype)


def row_mean_sq(grads_UD: torch.Tensor) -> torch.Tensor:
    """[U, 1]: the mean of g^2 over each row, summed in the native kernel's order: lane k
    (of 8) adds g_j^2 for j = k, k+8, k+16, ... in turn, then
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), then / D."""
    n, dim = grads_UD.shape
    lanes = ROW_SUM_LANES
    sq = grads_UD * grads_UD
    width = -(-dim // lanes) * lanes
    if width != dim:  # +0.0 changes no lane (the squares are >= 0)
        sq = torch.cat([sq, sq.new_zeros(n, width - dim)], dim=1)
    acc = sq.new_zeros(n, lanes)
    for c in range(0, width, lanes):
        acc = acc + sq[:, c:c + lanes]
    a = acc.unbind(1)
    total = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))
    return (total / dim).unsqueeze(1)


def _check(check_finite: bool, *tensors: torch.Tensor) -> None:
    if check_finite and not all_finite(*tensors):
        raise NonFiniteUpdate("the update would make the optimizer state or the delta "
                              "non-finite")


def sparse_adam_rows_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor,
    v_RD: torch.Tensor,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float]:
    """torch.optim.SparseAdam's math, op for op, on unique local row ids. `check_finite`:
    NonFiniteUpdate, with m and v untouched, when a new m, v or delta is not finite."""
    b1, b2 = spec.beta1, spec.beta2
    old_m = m_RD.index_select(0, ids_U)
    m_upd = grads_UD.sub(old_m).mul_(1 - b1)
    old_v = v_RD.index_select(0, ids_U)
    v_upd = grads_UD.pow(2).sub_(old_v).mul_(1 - b2)
    numer = m_upd.add_(old_m)  # the new m
    v_new = v_upd.add_(old_v)
    denom = v_new.sqrt().add_(spec.eps)
    step_size = spec.lr * math.sqrt(1 - b2**step) / (1 - b1**step)
    delta = -step_size * numer.div(denom)
    if check_finite and not all_finite(numer, v_new, delta):
        raise NonFiniteUpdate("the update would make m, v or the delta non-finite")
    m_RD.index_copy_(0, ids_U, numer)
    v_RD.index_copy_(0, ids_U, v_new)
    return delta, 1.0


def adamw_rows_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor,
    v_RD: torch.Tensor,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float]:
    """torch.optim.AdamW's (single-tensor) math restricted to the given rows."""
    b1, b2 = spec.beta1, spec.beta2
    m = m_RD.index_select(0, ids_U).lerp_(grads_UD, 1 - b1)
    v = v_RD.index_select(0, ids_U).mul_(b2).addcmul_(grads_UD, grads_UD, value=1 - b2)
    step_size = spec.lr / (1 - b1**step)
    denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(spec.eps)
    delta = m.div(denom).mul_(-step_size)
    if check_finite and not all_finite(m, v, delta):
        raise NonFiniteUpdate("the update would make m, v or the delta non-finite")
    m_RD.index_copy_(0, ids_U, m)
    v_RD.index_copy_(0, ids_U, v)
    return delta, 1.0 - spec.lr * spec.weight_decay


def sgd_rows_(spec: OptimizerSpec, grads_UD: torch.Tensor) -> tuple[torch.Tensor, float]:
    return grads_UD.mul(-spec.lr), 1.0 - spec.lr * spec.weight_decay


def adagrad_rows_(spec: OptimizerSpec, sum_RD: torch.Tensor, ids_U: torch.Tensor,
                  grads_UD: torch.Tensor, check_finite: bool = False
                  ) -> tuple[torch.Tensor, float]:
    """torch.optim.Adagrad with a sparse gradient (lr_decay 0, initial accumulator 0):
    sum += g^2; delta = (g / (sqrt(sum) + eps)) * -lr."""
    new_sum = sum_RD.index_select(0, ids_U).add_(grads_UD * grads_UD)
    delta = grads_UD.div(sqrt_f32(new_sum).add_(spec.eps)).mul_(-spec.lr)
    _check(check_finite, new_sum, delta)
    sum_RD.index_copy_(0, ids_U, new_sum)
    return delta, 1.0


def rowwise_adagrad_rows_(spec: OptimizerSpec, sum_R1: torch.Tensor, ids_U: torch.Tensor,
                          grads_UD: torch.Tensor, check_finite: bool = False
                          ) -> tuple[torch.Tensor, float]:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: sum += mean(g^2 over the row);
    delta = g * -(lr / (sqrt(sum) + eps)); decoupled decay 1 - lr*wd."""
    new_sum = sum_R1.index_select(0, ids_U).add_(row_mean_sq(grads_UD))
    denom = sqrt_f32(new_sum).add_(spec.eps)
    multiplier = torch.full_like(denom, spec.lr).div_(denom)
    delta = grads_UD * multiplier.neg_()
    _check(check_finite, new_sum, delta)
    sum_R1.index_copy_(0, ids_U, new_sum)
    return delta, 1.0 - spec.lr * spec.weight_decay


def partial_rowwise_adam_rows_(spec: OptimizerSpec, m_RD: torch.Tensor, v_R1: torch.Tensor,
                               ids_U: torch.Tensor, grads_UD: torch.Tensor, step: int,
                               check_finite: bool = False) -> tuple[torch.Tensor, float]:
    """FBGEMM's PARTIAL_ROWWISE_ADAM: m = m*b1 + g*(1-b1) per element, v = mean(g^2)*(1-b2)
    + v*b2 per row; delta = (m / (sqrt(v / (1-b2^t)) + eps)) * -(lr / (1-b1^t));
    decoupled decay 1 - lr*wd (FBGEMM's w -= lr * wd * w)."""
    b1, b2 = spec.beta1, spec.beta2
    m = m_RD.index_select(0, ids_U).mul_(b1).add_(grads_UD.mul(1 - b1))
    v = row_mean_sq(grads_UD).mul_(1 - b2).add_(v_R1.index_select(0, ids_U).mul_(b2))
    denom = sqrt_f32(v.div(1 - b2**step)).add_(spec.eps)
    delta = m.div(denom).mul_(-(spec.lr / (1 - b1**step)))
    _check(check_finite, m, v, delta)
    m_RD.index_copy_(0, ids_U, m)
    v_R1.index_copy_(0, ids_U, v)
    return delta, 1.0 - spec.lr * spec.weight_decay


# -- each kind's torch_step (hybridps/optim_kinds.py names them): the state tensors in layout
# order, the same signature for every kind --------------------------------------------------

def adam_step(spec: OptimizerSpec, state: Sequence[torch.Tensor], ids_U: torch.Tensor,
              grads_UD: torch.Tensor, step: int, check_finite: bool = False
              ) -> tuple[torch.Tensor, float]:
    return sparse_adam_rows_(spec, state[0], state[1], ids_U, grads_UD, step, check_finite)


def adamw_step(spec: OptimizerSpec, state: Sequence[torch.Tensor], ids_U: torch.Tensor,
               grads_UD: torch.Tensor, step: int, check_finite: bool = False
               ) -> tuple[torch.Tensor, float]:
    return adamw_rows_(spec, state[0], state[1], ids_U, grads_UD, step, check_finite)


def sgd_step(spec: OptimizerSpec, state: Sequence[torch.Tensor], ids_U: torch.Tensor,
             grads_UD: torch.Tensor, step: int, check_finite: bool = False
             ) -> tuple[torch.Tensor, float]:
    delta, decay = sgd_rows_(spec, grads_UD)
    _check(check_finite, delta)
    return delta, decay


def adagrad_step(spec: OptimizerSpec, state: Sequence[torch.Tensor], ids_U: torch.Tensor,
                 grads_UD: torch.Tensor, step: int, check_finite: bool = False
                 ) -> tuple[torch.Tensor, float]:
    return adagrad_rows_(spec, state[0], ids_U, grads_UD, check_finite)


def rowwise_adagrad_step(spec: OptimizerSpec, state: Sequence[torch.Tensor],
                         ids_U: torch.Tensor, grads_UD: torch.Tensor, step: int,
                         check_finite: bool = False) -> tuple[torch.Tensor, float]:
    return rowwise_adagrad_rows_(spec, state[0], ids_U, grads_UD, check_finite)


def partial_rowwise_adam_step(spec: OptimizerSpec, state: Sequence[torch.Tensor],
                              ids_U: torch.Tensor, grads_UD: torch.Tensor, step: int,
                              check_finite: bool = False) -> tuple[torch.Tensor, float]:
    return partial_rowwise_adam_rows_(spec, state[0], state[1], ids_U, grads_UD, step,
                                      check_finite)


def step_rows_torch_(spec: OptimizerSpec, state: Sequence[torch.Tensor | None],
                     ids_U: torch.Tensor, grads_UD: torch.Tensor, step: int,
                     check_finite: bool = False) -> tuple[torch.Tensor, float]:
    """One step of `spec` with its state tensors in layout order (spec.state_layout()):
    its kind's torch_step."""
    record = spec.record
    tensors = tuple(t for t in state[:len(record.state)] if t is not None)
    assert len(tensors) == len(record.state)  # internal invariant, not user input
    delta, decay = record.torch_kernel()(spec, tensors, ids_U, grads_UD, step, check_finite)
    return delta, decay
