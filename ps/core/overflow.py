"""Upper bounds that prove a push cannot overflow float32 state (transport-free): see
OverflowBound; ps/core/partition.py keeps one per table."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from hybridps.optim import OptimizerSpec


class OverflowBound:
    """Upper bounds on |state| (each of the optimizer's state tensors, by name) and
    |master| over every row of a table, kept per push in float64 from the push's largest
    |gradient|, so that almost every push is proven unable to overflow float32 and runs the
    kernel unchecked (no snapshot, no extra pass). Only a push the bounds cannot clear (a
    gradient near 1e19 and beyond, absurd lr/eps, state loaded with huge values) runs
    checked (apply_rows_ check_finite), after which the bounds are re-measured on the rows
    it touched.

    Why these bounds hold (g: the largest |gradient|, D: the row width):
    - adam, adamw, partial_rowwise_adam: the new m and v are convex combinations of the
      old value and g (resp. g^2 or the row's mean of g^2), so |m'| <= max(|m|, g) and
      v' <= max(v, g^2), up to a few float32 roundings: ROUNDING per push covers them (it
      compounds: 2^60 headroom takes ~10^9 pushes to use). |delta| <= |m'| * step_size /
      eps (the denominator is at least eps); partial_rowwise_adam also divides v by
      1 - b2^t before its sqrt.
    - adagrad, rowwise_adagrad: the sum only grows, by at most g^2 a push. adagrad's
      |delta| = lr |g| / (sqrt(sum') + eps) <= lr (sum' >= g^2 of that element);
      rowwise_adagrad's <= lr * sqrt(D) (sum' >= mean(g^2) >= g_j^2 / D), and its
      multiplier lr / (sqrt(sum') + eps) <= lr / eps must be finite too.
    - the row-wise kinds sum D squares of a row first: at most D * g^2.
    - sgd: |delta| = lr |g|. master' = master * decay + delta.
    eps = 0 proves nothing (0 / 0 on a row of zeros): such pushes run checked.
    """

    LIMIT = 2.0**124  # float32 max is ~2^128: margin for the bounds' own slack
    ROUNDING = 1.0 + 2.0**-20

    def __init__(self, dim: int = 1) -> None:
        self.dim = dim
        self.state: dict[str, float] = {}
        self.master = 0.0

    @property
    def m(self) -> float:
        return self.state.get("m", 0.0)

    @property
    def v(self) -> float:
        return self.state.get("v", 0.0)

    def _next(self, spec: OptimizerSpec, step: int, grad_max: float, decay: float | None
              ) -> tuple[dict[str, float], list[float], float]:
        """(the new state bounds, intermediate values that must stay finite, master)."""
        r = self.ROUNDING
        kind, lr, eps = spec.kind, abs(spec.lr), spec.eps
        g, g2 = grad_max, grad_max * grad_max
        old = self.state
        state: dict[str, float] = {}
        inter: list[float] = []
        if kind == "sgd":
            delta = g * lr * r
        elif kind in ("adagrad", "rowwise_adagrad"):
            state["sum"] = (old.get("sum", 0.0) + g2) * r
            if kind == "adagrad":
                delta = lr * r * r if eps > 0 else math.inf
            else:
                inter += [self.dim * g2 * r, lr / eps if eps > 0 else math.inf]
                delta = lr * math.sqrt(self.dim) * r * r if eps > 0 else math.inf
        else:
            state["m"] = max(old.get("m", 0.0), g) * r
            state["v"] = max(old.get("v", 0.0), g2) * r
            b1, b2 = spec.beta1, spec.beta2
            if kind == "adam":
                step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step)
            else:
                step_size = lr / (1 - b1**step)
            if kind == "partial_rowwise_adam":
                inter += [self.dim * g2 * r, state["v"] / (1 - b2**step) * r]
            delta = state["m"] * step_size / eps * r if eps > 0 else math.inf
        decay = (abs(1.0 - spec.lr * spec.weight_decay) if decay is None else abs(decay))
        master = (self.master * max(decay, 1.0) + delta) * r
        return state, [*inter, delta], master

    def safe(self, spec: OptimizerSpec, step: int, grad_max: float) -> bool:
        try:
            state, inter, master = self._next(spec, step, grad_max, None)
            return all(x < self.LIMIT for x in (*state.values(), *inter, master))
        except (OverflowError, ZeroDivisionError):
            return False

    def advance(self, spec: OptimizerSpec, step: int, grad_max: float, decay: float) -> None:
        state, _, master = self._next(spec, step, grad_max, decay)
        self.state = state
        self.master = master

    def observe(self, state: Mapping[str, torch.Tensor | None],
                master: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        """Widen the bounds to cover the values now held in `rows` (all: None) of the
        state tensors (by name) and the master rows."""
        def top(t: torch.Tensor | None) -> float:
            if t is None or t.numel() == 0:
                return 0.0
            part = t if rows is None else t.index_select(0, rows)
            if not part.numel():
                return 0.0
            low, high = torch.aminmax(part)  # two scalars: no |t| copy of a whole table
            return max(-float(low), float(high))

        for name, t in state.items():
            self.state[name] = max(self.state.get(name, 0.0), top(t))
        self.master = max(self.master, top(master))
