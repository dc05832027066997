"""Row-wise optimizer kernels for the shard server (and --local-optimizer workers).

Every kernel updates the optimizer state of the rows it is given in place and
returns (delta_UD, decay) such that the caller applies
    rows[ids] = rows[ids] * decay + delta
to the embedding rows, which live on the worker's device, not here.

Semantics (see README, "Optimizer semantics"):
- adam: torch.optim.SparseAdam exactly: lazy (only touched rows change), one
  step counter per partition that advances on every push, eps added to
  sqrt(v) (not to the bias-corrected sqrt(v_hat)), and the bias correction
  folded into the step size: lr * sqrt(1 - b2^t) / (1 - b1^t).
- adamw: torch.optim.AdamW on the touched rows: decoupled decay
  w *= 1 - lr*wd, eps added to sqrt(v)/sqrt(1 - b2^t).
- sgd: w = w * (1 - lr*wd) - lr * g.
No grpc in this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ps.errors import InvalidArgument

KINDS = ("adam", "adamw", "sgd")


@dataclass(frozen=True)
class OptimizerSpec:
    kind: str = "adam"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"optimizer kind {self.kind!r} is not one of {KINDS}")
        checks = {"lr": self.lr, "eps": self.eps, "weight_decay": self.weight_decay}
        for name, value in checks.items():
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"optimizer {name}={value!r} must be finite and >= 0")
        for name, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not (0.0 <= value < 1.0):
                raise InvalidArgument(f"optimizer {name}={value!r} must be in [0, 1)")
        if self.kind == "adam" and self.weight_decay != 0.0:
            raise InvalidArgument(
                f"optimizer adam takes no weight_decay (got {self.weight_decay!r}); "
                "torch.optim.SparseAdam has none: use adamw"
            )

    @property
    def has_moments(self) -> bool:
        return self.kind in ("adam", "adamw")


def sparse_adam_rows_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor,
    v_RD: torch.Tensor,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, float]:
    """torch.optim.SparseAdam's math, op for op, on unique local row ids."""
    b1, b2 = spec.beta1, spec.beta2
    old_m = m_RD.index_select(0, ids_U)
    m_upd = grads_UD.sub(old_m).mul_(1 - b1)
    old_v = v_RD.index_select(0, ids_U)
    v_upd = grads_UD.pow(2).sub_(old_v).mul_(1 - b2)
    numer = m_upd.add_(old_m)  # the new m
    v_new = v_upd.add_(old_v)
    m_RD.index_copy_(0, ids_U, numer)
    v_RD.index_copy_(0, ids_U, v_new)
    denom = v_new.sqrt().add_(spec.eps)
    step_size = spec.lr * math.sqrt(1 - b2**step) / (1 - b1**step)
    return -step_size * numer.div_(denom), 1.0


def adamw_rows_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor,
    v_RD: torch.Tensor,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, float]:
    """torch.optim.AdamW's (single-tensor) math restricted to the given rows."""
    b1, b2 = spec.beta1, spec.beta2
    m = m_RD.index_select(0, ids_U).lerp_(grads_UD, 1 - b1)
    v = v_RD.index_select(0, ids_U).mul_(b2).addcmul_(grads_UD, grads_UD, value=1 - b2)
    m_RD.index_copy_(0, ids_U, m)
    v_RD.index_copy_(0, ids_U, v)
    step_size = spec.lr / (1 - b1**step)
    denom = (v.sqrt() / math.sqrt(1 - b2**step)).add_(spec.eps)
    return m.div_(denom).mul_(-step_size), 1.0 - spec.lr * spec.weight_decay


def sgd_rows_(spec: OptimizerSpec, grads_UD: torch.Tensor) -> tuple[torch.Tensor, float]:
    return grads_UD.mul(-spec.lr), 1.0 - spec.lr * spec.weight_decay


def apply_rows_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor | None,
    v_RD: torch.Tensor | None,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, float]:
    """One optimizer step (1-based `step`) on unique local rows `ids_U`."""
    if spec.kind == "sgd":
        return sgd_rows_(spec, grads_UD)
    assert m_RD is not None and v_RD is not None  # internal invariant, not user input
    if spec.kind == "adam":
        return sparse_adam_rows_(spec, m_RD, v_RD, ids_U, grads_UD, step)
    return adamw_rows_(spec, m_RD, v_RD, ids_U, grads_UD, step)


def apply_update_(rows_RD: torch.Tensor, ids_U: torch.Tensor, delta_UD: torch.Tensor,
                  decay: float) -> None:
    """rows[ids] = rows[ids] * decay + delta, on the rows' device and dtype."""
    delta = delta_UD.to(device=rows_RD.device, dtype=rows_RD.dtype, non_blocking=True)
    ids = ids_U.to(device=rows_RD.device, non_blocking=True)
    if decay == 1.0:
        rows_RD.index_add_(0, ids, delta)
    else:
        rows_RD.index_copy_(0, ids, rows_RD.index_select(0, ids).mul_(decay).add_(delta))
