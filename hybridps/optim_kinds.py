"""The sparse optimizers by name and the per-row state each keeps (torch-free: the worker's
flag parsing and `--plan` read it without importing torch).

A state layout is a tuple of (name, width): width PER_ELEMENT ("D") is one float32 per
element of the row, 1 is one float32 per row. The shard server (ps/core/partition.py), the
in-process `--local-optimizer` (worker/updates/source.py), checkpoints (hybridps/checkpoint.py)
and every byte count (`--max-state-bytes`, stats, `--plan`) hold and count state by these
names, so an optimizer is added here and in hybridps/optim.py, nowhere else. The names
are the names of the tensors in checkpoint files: adam's m and v are those of
checkpoints written before there were other optimizers.

What each computes (hybridps/optim.py has the exact float32 operations):
- adam: torch.optim.SparseAdam (m, v per element);
- adamw: torch.optim.AdamW on the touched rows (m, v per element, decoupled decay);
- sgd: w = w * (1 - lr*wd) - lr*g (no state);
- adagrad: torch.optim.Adagrad with sparse gradients (sum of g^2 per element);
- rowwise_adagrad: FBGEMM's EXACT_ROWWISE_ADAGRAD (one sum per row of mean(g^2) over the
  row; step lr / (sqrt(sum) + eps) for the whole row; weight_decay decoupled);
- partial_rowwise_adam: FBGEMM's PARTIAL_ROWWISE_ADAM (m per element, v per row = EMA of
  mean(g^2) over the row; weight_decay decoupled, w *= 1 - lr*wd).
LAMB is not offered: its trust ratio ||w|| / ||update|| needs the row's weights, which
the shard server does not hold for fp32 rows (it answers deltas; docs/usage.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridps.errors import InvalidArgument

PER_ELEMENT = "D"
Width = int | str  # PER_ELEMENT or 1
StateLayout = tuple[tuple[str, Width], ...]

STATE_LAYOUTS: dict[str, StateLayout] = {
    "adam": (("m", PER_ELEMENT), ("v", PER_ELEMENT)),
    "adamw": (("m", PER_ELEMENT), ("v", PER_ELEMENT)),
    "sgd": (),
    "adagrad": (("sum", PER_ELEMENT),),
    "rowwise_adagrad": (("sum", 1),),
    "partial_rowwise_adam": (("m", PER_ELEMENT), ("v", 1)),
}
KINDS = tuple(STATE_LAYOUTS)
# which hyperparameters each kind reads (the others are ignored and not described)
USES_BETAS = frozenset({"adam", "adamw", "partial_rowwise_adam"})
USES_EPS = frozenset({"adam", "adamw", "adagrad", "rowwise_adagrad", "partial_rowwise_adam"})
TAKES_WEIGHT_DECAY = frozenset({"adamw", "sgd", "rowwise_adagrad", "partial_rowwise_adam"})


def state_layout(kind: str) -> StateLayout:
    try:
        return STATE_LAYOUTS[kind]
    except KeyError:
        raise ValueError(f"optimizer {kind!r} is not one of {', '.join(KINDS)}") from None


def state_widths(kind: str, dim: int) -> tuple[tuple[str, int], ...]:
    """(name, floats per row) of each state tensor of a row of width `dim`."""
    return tuple((name, dim if width == PER_ELEMENT else int(width))
                 for name, width in state_layout(kind))


def state_floats_per_row(kind: str, dim: int) -> int:
    return sum(width for _, width in state_widths(kind, dim))


def state_bytes_per_element(kind: str, dim: int) -> float:
    """float32 state bytes per element of a row of width `dim` (per-row values spread over
    the row)."""
    return 4 * state_floats_per_row(kind, dim) / dim


def describe_layout(kind: str) -> str:
    """'m[D] v[1]' (D: one float per element, 1: one per row); 'none' for sgd."""
    return " ".join(f"{name}[{width}]" for name, width in state_layout(kind)) or "none"


@dataclass(frozen=True)
class OptimizerSpec:
    """A sparse optimizer and its hyperparameters (those a kind does not read are ignored:
    betas outside USES_BETAS, eps outside USES_EPS). Checkpoints record it
    (`dataclasses.asdict`); a run resumes only with the same one, but for lr and
    weight_decay (worker/checkpoint/checkpointer.py `resume_changes`)."""

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
        if self.kind not in TAKES_WEIGHT_DECAY and self.weight_decay != 0.0:
            raise InvalidArgument(
                f"optimizer {self.kind} takes no weight_decay (got {self.weight_decay!r}); "
                "torch.optim.Adagrad refuses it with sparse gradients: use rowwise_adagrad "
                "(decoupled decay) or 0")

    def state_layout(self) -> StateLayout:
        """(name, width) of each per-row state tensor: width PER_ELEMENT ("D") or 1."""
        return STATE_LAYOUTS[self.kind]

    def state_widths(self, dim: int) -> tuple[tuple[str, int], ...]:
        return state_widths(self.kind, dim)

    @property
    def has_state(self) -> bool:
        return bool(STATE_LAYOUTS[self.kind])

    @property
    def has_moments(self) -> bool:
        """Whether the kind keeps any per-row state (the name from when adam's m and v were
        the only state)."""
        return self.has_state

    def describe(self) -> str:
        """One line with the hyperparameters the kind reads, e.g. for a refusal."""
        parts = [f"lr={self.lr:g}"]
        if self.kind in USES_BETAS:
            parts.append(f"betas=({self.beta1:g}, {self.beta2:g})")
        if self.kind in USES_EPS:
            parts.append(f"eps={self.eps:g}")
        if self.kind in TAKES_WEIGHT_DECAY:
            parts.append(f"weight_decay={self.weight_decay:g}")
        return f"{self.kind}({', '.join(parts)})"


def describe_saved(saved: Mapping[str, Any]) -> str:
    """An optimizer recorded in a checkpoint (asdict of an OptimizerSpec), in one line."""
    try:
        return OptimizerSpec(**dict(saved)).describe()
    except (TypeError, InvalidArgument):
        return repr(dict(saved))
