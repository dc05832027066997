"""Upper bounds that prove a push cannot overflow float32 state (transport-free): see
OverflowBound; ps/partition.py keeps one per table."""

from __future__ import annotations

import math

import torch

from hybridps.optim import OptimizerSpec


class OverflowBound:
    """Upper bounds on |m|, v and |master| over every row of a table, kept per push in
    float64 from the push's largest |gradient|, so that almost every push is proven
    unable to overflow float32 and runs the kernel unchecked (no snapshot, no extra
    pass). Only a push the bounds cannot clear (a gradient near 1e19 and beyond, absurd
    lr/eps, state loaded with huge values) runs checked (apply_rows_ check_finite), after
    which the bounds are re-measured on the rows it touched.

    Why these bounds hold: adam's and adamw's new m and v are convex combinations of the
    old value and g (resp. g^2), so |m'| <= max(|m|, |g|) and v' <= max(v, g^2), up to a
    few float32 roundings: ROUNDING per push covers them (it compounds: 2^60 headroom
    takes ~10^9 pushes to use). |delta| <= |m'| * step_size / eps (the denominator is at
    least eps), sgd's |delta| = lr |g|; master' = master * decay + delta.
    """

    LIMIT = 2.0**124  # float32 max is ~2^128: margin for the bounds' own slack
    ROUNDING = 1.0 + 2.0**-20

    def __init__(self) -> None:
        self.m = self.v = self.master = 0.0

    def _next(self, spec: OptimizerSpec, step: int, grad_max: float,
              decay: float | None) -> tuple[float, float, float, float]:
        r = self.ROUNDING
        if spec.kind == "sgd":
            m = v = 0.0
            delta = grad_max * abs(spec.lr) * r
            decay = abs(1.0 - spec.lr * spec.weight_decay) if decay is None else abs(decay)
        else:
            m = max(self.m, grad_max) * r
            v = max(self.v, grad_max * grad_max) * r
            b1, b2 = spec.beta1, spec.beta2
            if spec.kind == "adam":
                step_size = spec.lr * math.sqrt(1 - b2**step) / (1 - b1**step)
            else:
                step_size = spec.lr / (1 - b1**step)
            delta = m * abs(step_size) / spec.eps * r if spec.eps > 0 else math.inf
            decay = (abs(1.0 - spec.lr * spec.weight_decay) if decay is None else abs(decay))
        master = (self.master * max(decay, 1.0) + delta) * r
        return m, v, delta, master

    def safe(self, spec: OptimizerSpec, step: int, grad_max: float) -> bool:
        try:
            return all(x < self.LIMIT for x in self._next(spec, step, grad_max, None))
        except (OverflowError, ZeroDivisionError):
            return False

    def advance(self, spec: OptimizerSpec, step: int, grad_max: float, decay: float) -> None:
        m, v, _, master = self._next(spec, step, grad_max, decay)
        self.m, self.v = m, v
        self.master = master

    def observe(self, m: torch.Tensor | None, v: torch.Tensor | None,
                master: torch.Tensor | None, rows: torch.Tensor | None = None) -> None:
        """Widen the bounds to cover the values now held in `rows` (all: None)."""
        def top(t: torch.Tensor | None) -> float:
            if t is None or t.numel() == 0:
                return 0.0
            part = t if rows is None else t.index_select(0, rows)
            if not part.numel():
                return 0.0
            low, high = torch.aminmax(part)  # two scalars: no |t| copy of a whole table
            return max(-float(low), float(high))

        self.m, self.v = max(self.m, top(m)), max(self.v, top(v))
        self.master = max(self.master, top(master))
