"""The sparse optimizers: one record per kind (`OptimizerKind`), in one registry
(torch-free: the worker's flag parsing and `--plan` read it without importing torch).

A record says everything the rest of the code asks of a kind, and every reader reads it:
- `state`: its per-row state, (name, width) pairs: width PER_ELEMENT ("D") is one float32 per
  element of the row, 1 is one float32 per row. The shard server (ps/core/partition.py),
  the in-process `--local-optimizer` (worker/updates/source.py), checkpoints
  (hybridps/checkpoint.py) and every byte count (`--max-state-bytes`, stats, `--plan`) hold
  and count state by these names, which are the names of the tensors in checkpoint files
  (adam's m and v are those of checkpoints written before there were other optimizers);
- `reads`: the hyperparameters it uses (of HYPERPARAMETERS; the others are ignored, not
  described, and weight_decay != 0 is refused with `no_weight_decay` when it is not read);
- `dense`: the dense part's optimizer `--dense-optimizer auto` picks (DENSE_OPTIMIZERS: the
  torch.optim class and its arguments; worker/dense/optimizer.py builds it);
- `torch_step`: its torch reference row kernel (any device and dtype; hybridps/optim.py runs it
  when the native kernel does not take the tensors, and the tests hold the native one to it);
- `native_step`: its entry to the C loops of hybridps/native/ (hybridps/optim_native.py), or
  None (the torch kernel always);
- `bound`: its overflow bound (hybridps/optim_bounds.py), which the shard server's
  OverflowBound (ps/core/overflow.py) reads to prove a push cannot overflow float32;
- `reference`: the torch.optim optimizer the whole-table reference trainer uses
  (tests/testing/reference_trainer.py), ROW_KERNELS (its torch kernel on whole tables), or None;
- `touched_from`: the state tensor from which a restored server rebuilds its touched marks;
- `summary`: the flag's help text for it.
Kernels are named "module:function" (imported on first use, so that this module stays
torch-free) or given as the function itself. The flag's choices (worker/config), `--plan`,
OptimizerSpec and the checkpoint description (`describe_saved`) read the registry too, so
adding an optimizer is one record (BUILT_IN, or `register_kind`) and its kernels:
docs/usage.md, "How to add an optimizer". KINDS are the built-in kinds: the wire's
OptimizerConfig.Kind (proto/hybridps/v1/shard.proto) has exactly these, so a kind registered
at run time is served in process (`--local-optimizer`, ps/core) but not over gRPC.

What each built-in kind computes (hybridps/optim_torch.py has the exact float32 operations):
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

import importlib
import math
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass
from typing import Any

from hybridps import optim_bounds
from hybridps.errors import InvalidArgument

PER_ELEMENT = "D"
Width = int | str  # PER_ELEMENT or 1
StateLayout = tuple[tuple[str, Width], ...]
# the hyperparameters a kind may read, in the order descriptions name them (betas: beta1 and
# beta2 of OptimizerSpec)
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# a kernel: the function, or "module:function" (imported on first use)
KernelRef = str | Callable[..., Any]
ROW_KERNELS = "rows"  # OptimizerKind.reference: the kind's torch kernel on whole tables


@dataclass(frozen=True)
class DenseOptimizer:
    """A --dense-optimizer choice: the torch.optim class (by name) and whether it takes
    foreach=True (one dispatch per op for all parameters; worker/dense/optimizer.py)."""

    torch_class: str
    foreach: bool = True


# --dense-optimizer's choices besides auto (in --help's order)
DENSE_OPTIMIZERS: dict[str, DenseOptimizer] = {
    "adam": DenseOptimizer("Adam"),
    "adamw": DenseOptimizer("AdamW"),
    "sgd": DenseOptimizer("SGD", foreach=False),
    "adagrad": DenseOptimizer("Adagrad"),
}


@dataclass(frozen=True)
class TorchReference:
    """The torch.optim optimizer (taking sparse gradients) a whole-table reference trains a
    kind with, and the OptimizerSpec fields it is given (tests/testing/reference_trainer.py). One
    given no weight_decay stands for runs without weight decay only."""

    torch_class: str
    args: tuple[str, ...] = ("lr",)


@dataclass(frozen=True)
class OptimizerKind:
    """One sparse optimizer: everything the code asks of it (see the module doc)."""

    name: str
    state: StateLayout
    reads: frozenset[str]
    dense: str
    torch_step: KernelRef
    bound: optim_bounds.Bound
    native_step: KernelRef | None = None
    reference: TorchReference | str | None = ROW_KERNELS
    no_weight_decay: str = ""  # why weight_decay != 0 is refused, when it is not read
    # the state tensor that is non-zero exactly on the rows pushes touched (the accumulated
    # g^2): a server restoring a checkpoint marks those rows touched (ps/core/checkpoint.py)
    touched_from: str | None = None
    summary: str = ""  # --optimizer's help for this kind (default: the name)

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"optimizer kind {self.name!r} must be a lower-case identifier")
        unknown = set(self.reads) - set(HYPERPARAMETERS)
        if "lr" not in self.reads or unknown:
            raise ValueError(f"optimizer {self.name}: reads={sorted(self.reads)} must hold lr "
                             f"and only names of {HYPERPARAMETERS}")
        names = [n for n, _ in self.state]
        if len(set(names)) != len(names) or any(
                w != PER_ELEMENT and (not isinstance(w, int) or w < 1) for _, w in self.state):
            raise ValueError(f"optimizer {self.name}: state={self.state!r} needs distinct "
                             f"names and widths {PER_ELEMENT!r} or an int >= 1")
        if self.touched_from is not None and self.touched_from not in names:
            raise ValueError(f"optimizer {self.name}: touched_from={self.touched_from!r} is "
                             f"not one of its state tensors {names}")
        if self.dense not in DENSE_OPTIMIZERS:
            raise ValueError(f"optimizer {self.name}: dense={self.dense!r} is not one of "
                             f"{', '.join(DENSE_OPTIMIZERS)}")

    @property
    def takes_weight_decay(self) -> bool:
        return "weight_decay" in self.reads

    def state_widths(self, dim: int) -> tuple[tuple[str, int], ...]:
        """(name, floats per row) of each state tensor of a row of width `dim`."""
        return tuple((name, dim if width == PER_ELEMENT else int(width))
                     for name, width in self.state)

    def torch_kernel(self) -> Callable[..., Any]:
        """torch_step(spec, state tensors in layout order, ids_U, grads_UD, step,
        check_finite) -> (delta_UD, decay), the state rows updated in place."""
        return resolve(self.torch_step)

    def native_kernel(self) -> Callable[..., Any] | None:
        """native_step(spec, call: hybridps.optim_native.NativeCall) -> decay, or None."""
        return None if self.native_step is None else resolve(self.native_step)


_resolved: dict[str, Callable[..., Any]] = {}


def resolve(ref: KernelRef) -> Callable[..., Any]:
    """The function `ref` names ("module:function"), imported once; a function as it is."""
    if not isinstance(ref, str):
        return ref
    fn = _resolved.get(ref)
    if fn is None:
        module, _, name = ref.partition(":")
        fn = _resolved[ref] = getattr(importlib.import_module(module), name)
    return fn


_REGISTRY: dict[str, OptimizerKind] = {}


def register_kind(record: OptimizerKind) -> OptimizerKind:
    """Add an optimizer kind (ValueError when its name is taken); returns it."""
    if record.name in _REGISTRY:
        raise ValueError(f"optimizer kind {record.name!r} is already registered")
    _REGISTRY[record.name] = record
    return record


def unregister_kind(name: str) -> None:
    """Remove a kind added by register_kind (the built-in ones stay)."""
    if name in KINDS:
        raise ValueError(f"optimizer kind {name!r} is built in")
    _REGISTRY.pop(name, None)


def kind_names() -> tuple[str, ...]:
    """Every registered kind, the built-in ones first."""
    return tuple(_REGISTRY)


def is_kind(name: object) -> bool:
    return isinstance(name, str) and name in _REGISTRY


def kind_record(name: str) -> OptimizerKind:
    """The record of kind `name` (InvalidArgument naming the kinds when there is none)."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"optimizer kind {name!r} is not one of {kind_names()}") from None


_T = "hybridps.optim_torch:"  # the torch kernels
_N = "hybridps.optim_native:"  # the entries to the C loops
_SPARSE_ADAGRAD = ("torch's sparse Adagrad has no weight decay: use rowwise_adagrad "
                   "(decoupled decay) or 0")
BUILT_IN = (
    OptimizerKind(
        "adam", state=(("m", PER_ELEMENT), ("v", PER_ELEMENT)),
        reads=frozenset({"lr", "betas", "eps"}), dense="adam",
        torch_step=_T + "adam_step", native_step=_N + "adam", bound=optim_bounds.adam,
        reference=TorchReference("SparseAdam"), touched_from="v",
        no_weight_decay="torch.optim.SparseAdam has none: use adamw",
        summary="adam (SparseAdam)"),
    OptimizerKind(
        "adamw", state=(("m", PER_ELEMENT), ("v", PER_ELEMENT)),
        reads=frozenset({"lr", "betas", "eps", "weight_decay"}), dense="adamw",
        torch_step=_T + "adamw_step", native_step=_N + "adamw", bound=optim_bounds.adamw,
        reference=None, touched_from="v"),
    OptimizerKind(
        "sgd", state=(), reads=frozenset({"lr", "weight_decay"}), dense="sgd",
        torch_step=_T + "sgd_step", native_step=_N + "sgd", bound=optim_bounds.sgd,
        reference=TorchReference("SGD")),
    OptimizerKind(
        "adagrad", state=(("sum", PER_ELEMENT),), reads=frozenset({"lr", "eps"}),
        dense="adagrad", torch_step=_T + "adagrad_step", native_step=_N + "adagrad",
        bound=optim_bounds.adagrad, reference=TorchReference("Adagrad", ("lr", "eps")),
        touched_from="sum", no_weight_decay=_SPARSE_ADAGRAD),
    OptimizerKind(
        "rowwise_adagrad", state=(("sum", 1),),
        reads=frozenset({"lr", "eps", "weight_decay"}), dense="adagrad",
        torch_step=_T + "rowwise_adagrad_step", native_step=_N + "rowwise_adagrad",
        bound=optim_bounds.rowwise_adagrad, reference=ROW_KERNELS, touched_from="sum",
        summary="rowwise_adagrad (FBGEMM's exact rowwise Adagrad: one value a row)"),
    OptimizerKind(
        "partial_rowwise_adam", state=(("m", PER_ELEMENT), ("v", 1)),
        reads=frozenset({"lr", "betas", "eps", "weight_decay"}), dense="adam",
        torch_step=_T + "partial_rowwise_adam_step", native_step=_N + "partial_rowwise_adam",
        bound=optim_bounds.partial_rowwise_adam, reference=ROW_KERNELS, touched_from="v",
        summary="partial_rowwise_adam (m per element, v per row)"),
)
for _record in BUILT_IN:
    register_kind(_record)
KINDS = kind_names()  # the built-in kinds (those the wire's OptimizerConfig.Kind names)


class _Layouts(Mapping[str, StateLayout]):
    """kind -> state layout, of the registry as it is now."""

    def __getitem__(self, kind: str) -> StateLayout:
        if kind not in _REGISTRY:
            raise KeyError(kind)
        return _REGISTRY[kind].state

    def __iter__(self) -> Iterator[str]:
        return iter(kind_names())

    def __len__(self) -> int:
        return len(_REGISTRY)


class _KindsReading(Set[str]):
    """The registered kinds that read hyperparameter `name`, as the registry is now."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _kinds(self) -> list[str]:
        return [k for k, r in _REGISTRY.items() if self.name in r.reads]

    def __contains__(self, kind: object) -> bool:
        return is_kind(kind) and self.name in _REGISTRY[str(kind)].reads

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds())

    def __len__(self) -> int:
        return len(self._kinds())


STATE_LAYOUTS: Mapping[str, StateLayout] = _Layouts()
USES_BETAS: Set[str] = _KindsReading("betas")
USES_EPS: Set[str] = _KindsReading("eps")
TAKES_WEIGHT_DECAY: Set[str] = _KindsReading("weight_decay")


def _record_or_value_error(kind: str) -> OptimizerKind:
    record = _REGISTRY.get(kind)
    if record is None:
        raise ValueError(f"optimizer {kind!r} is not one of {', '.join(kind_names())}")
    return record


def state_layout(kind: str) -> StateLayout:
    return _record_or_value_error(kind).state


# What a shard server holds for each row besides its optimizer state: the "touched" flag
# and the "changed" flag (the rows an incremental checkpoint writes), one byte each; the
# server's budget (ps/core/partition.py) and the planner (worker/plan.py) both count them.
SERVER_FLAG_BYTES_PER_ROW = 2


def state_widths(kind: str, dim: int) -> tuple[tuple[str, int], ...]:
    """(name, floats per row) of each state tensor of a row of width `dim`."""
    return _record_or_value_error(kind).state_widths(dim)


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
    """A sparse optimizer and its hyperparameters (those its kind does not read are ignored:
    OptimizerKind.reads). Checkpoints record it (`dataclasses.asdict`); a run resumes only
    with the same one, but for lr and weight_decay (worker/checkpoint/resume.py
    `resume_changes`)."""

    kind: str = "adam"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        record = kind_record(self.kind)
        checks = {"lr": self.lr, "eps": self.eps, "weight_decay": self.weight_decay}
        for name, value in checks.items():
            if not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"optimizer {name}={value!r} must be finite and >= 0")
        for name, value in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not (0.0 <= value < 1.0):
                raise InvalidArgument(f"optimizer {name}={value!r} must be in [0, 1)")
        if not record.takes_weight_decay and self.weight_decay != 0.0:
            raise InvalidArgument(
                f"optimizer {self.kind} takes no weight_decay (got {self.weight_decay!r})"
                + (f"; {record.no_weight_decay}" if record.no_weight_decay else ""))

    @property
    def record(self) -> OptimizerKind:
        """The kind's record (hybridps/optim_kinds.py)."""
        return _REGISTRY[self.kind]

    def state_layout(self) -> StateLayout:
        """(name, width) of each per-row state tensor: width PER_ELEMENT ("D") or 1."""
        return self.record.state

    def state_widths(self, dim: int) -> tuple[tuple[str, int], ...]:
        return self.record.state_widths(dim)

    @property
    def has_state(self) -> bool:
        return bool(self.record.state)

    @property
    def has_moments(self) -> bool:
        """Whether the kind keeps any per-row state (the name from when adam's m and v were
        the only state)."""
        return self.has_state

    def describe(self) -> str:
        """One line with the hyperparameters the kind reads, e.g. for a refusal."""
        values = {"lr": f"lr={self.lr:g}", "betas": f"betas=({self.beta1:g}, {self.beta2:g})",
                  "eps": f"eps={self.eps:g}", "weight_decay": f"weight_decay={self.weight_decay:g}"}
        parts = [values[name] for name in HYPERPARAMETERS if name in self.record.reads]
        return f"{self.kind}({', '.join(parts)})"


def describe_saved(saved: Mapping[str, Any]) -> str:
    """An optimizer recorded in a checkpoint (asdict of an OptimizerSpec), in one line."""
    try:
        return OptimizerSpec(**dict(saved)).describe()
    except (TypeError, InvalidArgument):
        return repr(dict(saved))
