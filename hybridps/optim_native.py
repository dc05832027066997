"""Each built-in optimizer kind's entry to the fused C loops of hybridps/native/
(row_optim.c, fused_adam.c): the arguments its loop takes, derived from the spec and the
step. A kind's record (hybridps/optim_kinds.py `OptimizerKind.native_step`) names its
function here; hybridps/optim.py checks the tensors (CPU float32 contiguous, the state's
widths, no overlap) and calls it. No grpc in this module.

Each function runs its loop and returns the decay the caller applies with the delta; it
raises NonFiniteUpdate when `call.check_finite` and the loop undid the step (the state as
it was).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from hybridps.errors import NonFiniteUpdate
from hybridps.optim_kinds import OptimizerSpec
from hybridps.optim_torch import all_finite

UNDONE = "the update would make the optimizer state or the delta non-finite"


@dataclass(frozen=True, slots=True)
class NativeCall:
    """What one native step is given: the extension, the data pointers and sizes."""

    ext: ModuleType
    state: tuple[int, ...]  # the state tensors' data pointers, in layout order
    rows: int  # rows of the state tensors
    dim: int
    ids: int  # int64 [n] local row ids (0 for a kind without state: not read)
    n: int
    grads: torch.Tensor  # [n, dim] float32
    delta: torch.Tensor  # [n, dim] float32, written
    step: int  # 1-based
    threads: int
    snapshots: tuple[int, ...]  # check_finite: a buffer of n * width floats a state tensor
    check_finite: bool

    @property
    def common(self) -> tuple[int, int, int, int, int, int]:
        """The arguments every row loop takes after the state pointers."""
        return (self.rows, self.dim, self.ids, self.n, self.grads.data_ptr(),
                self.delta.data_ptr())


def _done(undone: int) -> None:
    if undone:
        raise NonFiniteUpdate(UNDONE)


def adam(spec: OptimizerSpec, c: NativeCall) -> float:
    b1, b2 = spec.beta1, spec.beta2
    step_size = spec.lr * math.sqrt(1 - b2**c.step) / (1 - b1**c.step)
    _done(c.ext.adam(*c.state, *c.common, 1 - b1, 1 - b2, spec.eps, -step_size, c.threads,
                     *c.snapshots))
    return 1.0


def adamw(spec: OptimizerSpec, c: NativeCall) -> float:
    b1, b2 = spec.beta1, spec.beta2
    step_size = spec.lr / (1 - b1**c.step)
    _done(c.ext.adamw(*c.state, *c.common, 1 - b1, b2, 1 - b2, math.sqrt(1 - b2**c.step),
                      spec.eps, -step_size, c.threads, *c.snapshots))
    return 1.0 - spec.lr * spec.weight_decay


def sgd(spec: OptimizerSpec, c: NativeCall) -> float:
    c.ext.scale(c.grads.data_ptr(), c.delta.data_ptr(), c.n * c.dim, -spec.lr, c.threads)
    if c.check_finite and not all_finite(c.delta):
        raise NonFiniteUpdate("the update would make the delta non-finite")
    return 1.0 - spec.lr * spec.weight_decay


def adagrad(spec: OptimizerSpec, c: NativeCall) -> float:
    _done(c.ext.adagrad(*c.state, *c.common, -spec.lr, spec.eps, c.threads, *c.snapshots))
    return 1.0


def rowwise_adagrad(spec: OptimizerSpec, c: NativeCall) -> float:
    _done(c.ext.rowwise_adagrad(*c.state, *c.common, spec.lr, spec.eps, c.threads,
                                *c.snapshots))
    return 1.0 - spec.lr * spec.weight_decay


def partial_rowwise_adam(spec: OptimizerSpec, c: NativeCall) -> float:
    b1, b2 = spec.beta1, spec.beta2
    _done(c.ext.partial_rowwise_adam(*c.state, *c.common, b1, 1 - b1, b2, 1 - b2,
                                     1 - b2**c.step, spec.eps, -(spec.lr / (1 - b1**c.step)),
                                     c.threads, *c.snapshots))
    return 1.0 - spec.lr * spec.weight_decay
