"""Each optimizer kind's overflow bound (torch-free float64 arithmetic): from upper bounds on
|state| (by name) before a push and the push's largest |gradient| g, upper bounds on |state|
after it, the intermediate values that must stay finite, and |delta|. The shard server's
OverflowBound (ps/core/overflow.py) keeps them per table; each kind's record
(hybridps/optim_kinds.py `OptimizerKind.bound`) names its function here.

Why these bounds hold (D: the row width; every result is multiplied by ROUNDING per
rounding it covers):
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
- sgd: |delta| = lr |g|.
eps = 0 proves nothing (0 / 0 on a row of zeros): such pushes bound delta by inf (checked).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

ROUNDING = 1.0 + 2.0**-20

# (spec, dim, step, g, old state bounds by name) -> (new state bounds by name, intermediate
# values that must stay finite, |delta| bound); spec: an OptimizerSpec (lr, eps, betas read)
Bound = Callable[[Any, int, int, float, Mapping[str, float]],
                 tuple[dict[str, float], list[float], float]]


def sgd(spec: Any, dim: int, step: int, g: float, old: Mapping[str, float]
        ) -> tuple[dict[str, float], list[float], float]:
    return {}, [], g * abs(spec.lr) * ROUNDING


def adagrad(spec: Any, dim: int, step: int, g: float, old: Mapping[str, float]
            ) -> tuple[dict[str, float], list[float], float]:
    r, lr, eps = ROUNDING, abs(spec.lr), spec.eps
    state = {"sum": (old.get("sum", 0.0) + g * g) * r}
    return state, [], lr * r * r if eps > 0 else math.inf


def rowwise_adagrad(spec: Any, dim: int, step: int, g: float, old: Mapping[str, float]
                    ) -> tuple[dict[str, float], list[float], float]:
    r, lr, eps = ROUNDING, abs(spec.lr), spec.eps
    g2 = g * g
    state = {"sum": (old.get("sum", 0.0) + g2) * r}
    inter = [dim * g2 * r, lr / eps if eps > 0 else math.inf]
    return state, inter, lr * math.sqrt(dim) * r * r if eps > 0 else math.inf


def _moments(spec: Any, g: float, old: Mapping[str, float]) -> dict[str, float]:
    r = ROUNDING
    return {"m": max(old.get("m", 0.0), g) * r, "v": max(old.get("v", 0.0), g * g) * r}


def _adam_delta(spec: Any, state: Mapping[str, float], step_size: float) -> float:
    return state["m"] * step_size / spec.eps * ROUNDING if spec.eps > 0 else math.inf


def adam(spec: Any, dim: int, step: int, g: float, old: Mapping[str, float]
         ) -> tuple[dict[str, float], list[float], float]:
    state = _moments(spec, g, old)
    b1, b2 = spec.beta1, spec.beta2
    step_size = abs(spec.lr) * math.sqrt(1 - b2**step) / (1 - b1**step)
    return state, [], _adam_delta(spec, state, step_size)


def adamw(spec: Any, dim: int, step: int, g: float, old: Mapping[str, float]
          ) -> tuple[dict[str, float], list[float], float]:
    state = _moments(spec, g, old)
    step_size = abs(spec.lr) / (1 - spec.beta1**step)
    return state, [], _adam_delta(spec, state, step_size)


def partial_rowwise_adam(spec: Any, dim: int, step: int, g: float, old: Mapping[str, float]
                         ) -> tuple[dict[str, float], list[float], float]:
    r, g2 = ROUNDING, g * g
    state = _moments(spec, g, old)
    step_size = abs(spec.lr) / (1 - spec.beta1**step)
    inter = [dim * g2 * r, state["v"] / (1 - spec.beta2**step) * r]
    return state, inter, _adam_delta(spec, state, step_size)
