"""Upper bounds that prove a push cannot overflow float32 state (transport-free): see
OverflowBound; ps/core/partition.py keeps one per table."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridps import optim_bounds
from hybridps.optim import OptimizerSpec


class OverflowBound:
    """Upper bounds on |state| (each of the optimizer's state tensors, by name) and
    |master| over every row of a table, kept per push in float64 from the push's largest
    |gradient|, so that almost every push is proven unable to overflow float32 and runs the
    kernel unchecked (no snapshot, no extra pass). Only a push the bounds cannot clear (a
    gradient near 1e19 and beyond, absurd lr/eps, state loaded with huge values) runs
    checked (apply_rows_ check_finite), after which the bounds are re-measured on the rows
    it touched.

    Each kind's bound is its record's (hybridps/optim_kinds.py `OptimizerKind.bound`;
    hybridps/optim_bounds.py says why the built-in ones hold); then
    master' = master * decay + delta. eps = 0 proves nothing (0 / 0 on a row of zeros): such
    pushes run checked.
    """

    LIMIT = 2.0**124  # float32 max is ~2^128: margin for the bounds' own slack
    ROUNDING = optim_bounds.ROUNDING

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
        state, inter, delta = spec.record.bound(spec, self.dim, step, grad_max, self.state)
        decay = (abs(1.0 - spec.lr * spec.weight_decay) if decay is None else abs(decay))
        master = (self.master * max(decay, 1.0) + delta) * self.ROUNDING
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
