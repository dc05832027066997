"""Row-wise optimizer kernels for the shard server (and --local-optimizer workers).

Every kernel updates the optimizer state of the rows it is given in place and
returns (delta_UD, decay) such that the caller applies
    rows[ids] = rows[ids] * decay + delta
to the embedding rows, which live on the worker's device, not here.

Semantics (see README, "Optimizer semantics"; the kinds, their per-row state and their
kernels: one record each, hybridps/optim_kinds.py):
- adam: torch.optim.SparseAdam exactly: lazy (only touched rows change), one
  step counter per partition that advances on every push, eps added to
  sqrt(v) (not to the bias-corrected sqrt(v_hat)), and the bias correction
  folded into the step size: lr * sqrt(1 - b2^t) / (1 - b1^t).
- adamw: torch.optim.AdamW on the touched rows: decoupled decay
  w *= 1 - lr*wd, eps added to sqrt(v)/sqrt(1 - b2^t).
- sgd: w = w * (1 - lr*wd) - lr * g.
- adagrad, rowwise_adagrad, partial_rowwise_adam: torch.optim.Adagrad's sparse step and
  FBGEMM's EXACT_ROWWISE_ADAGRAD and PARTIAL_ROWWISE_ADAM (hybridps/optim_torch.py).
The state is a name -> tensor mapping per spec.state_layout() (`step_rows_`), or, in
the older form, two tensors by position (`apply_rows_(spec, m, v, ...)`).
No grpc in this module.

Two implementations of step_rows_ / apply_rows_ / apply_update_:
- "native": the fused single-pass C loops of hybridps/native/ (each kind's entry:
  hybridps/optim_native.py; one pass over the rows,
  the state updated in place, delta written into one buffer, optionally caller-owned;
  a pthread pool across rows). The state is bitwise that of the torch path, as are
  sgd, the row update and the deltas of the newer kinds; the adam/adamw delta can
  differ in the last bits (<= ~5 ulp) because torch's float32 sqrt is not always
  correctly rounded.
- "torch": the vectorized torch ops of hybridps/optim_torch.py, the reference (a kind
  with no native entry always runs its torch kernel).
The module picks one at import (`HYBRIDPS_KERNEL=auto|native|torch`, default auto:
native when the extension is built); `kernel_name()` says which. Calls whose
tensors the C loops do not take (not CPU, not float32, not contiguous...) use the
torch path whatever the choice. Kernel threads: `HYBRIDPS_KERNEL_THREADS` (0 or unset:
torch.get_num_threads() of the calling thread; the shard server's --kernel-threads,
the same variable, sets default_kernel_threads() for 0); `num_threads=` overrides per call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import torch

from hybridps.optim_kinds import KINDS as KINDS
from hybridps.optim_kinds import OptimizerSpec as OptimizerSpec
from hybridps.optim_native import NativeCall
from hybridps.optim_torch import adamw_rows_ as adamw_rows_
from hybridps.optim_torch import sgd_rows_ as sgd_rows_
from hybridps.optim_torch import sparse_adam_rows_ as sparse_adam_rows_
from hybridps.optim_torch import step_rows_torch_

KERNELS = ("auto", "native", "torch")
KERNEL_ENV = "HYBRIDPS_KERNEL"
THREADS_ENV = "HYBRIDPS_KERNEL_THREADS"

# name -> [rows, width] float32 tensor, as spec.state_layout() declares them
RowState = Mapping[str, torch.Tensor]


def state_tensors(spec: OptimizerSpec, state: RowState) -> tuple[torch.Tensor, ...]:
    """`state`'s tensors in layout order; KeyError naming a missing one."""
    return tuple(state[name] for name, _ in spec.state_layout())


def apply_rows_torch_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor | None,
    v_RD: torch.Tensor | None,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float]:
    """The torch reference of apply_rows_ (any device and dtype); m_RD, v_RD: the state
    tensors in layout order (adam: m, v; rowwise_adagrad: sum, None; sgd: None, None)."""
    return step_rows_torch_(spec, (m_RD, v_RD), ids_U, grads_UD, step, check_finite)


def step_rows_torch_state_(spec: OptimizerSpec, state: RowState, ids_U: torch.Tensor,
                           grads_UD: torch.Tensor, step: int, check_finite: bool = False
                           ) -> tuple[torch.Tensor, float]:
    """The torch reference of step_rows_ (state by name)."""
    return step_rows_torch_(spec, state_tensors(spec, state), ids_U, grads_UD, step,
                            check_finite)


def apply_update_torch_(rows_RD: torch.Tensor, ids_U: torch.Tensor, delta_UD: torch.Tensor,
                        decay: float) -> None:
    """The torch reference of apply_update_ (any device and dtype)."""
    delta = delta_UD.to(device=rows_RD.device, dtype=rows_RD.dtype, non_blocking=True)
    ids = ids_U.to(device=rows_RD.device, non_blocking=True)
    if decay == 1.0:
        rows_RD.index_add_(0, ids, delta)
    else:
        rows_RD.index_copy_(0, ids, rows_RD.index_select(0, ids).mul_(decay).add_(delta))


# -- kernel choice ----------------------------------------------------------------------

_requested = "auto"
_native: ModuleType | None = None  # the extension when the native kernels are in use
_threads: int | None = None  # None: torch.get_num_threads() of the calling thread


def _native_module() -> tuple[ModuleType | None, str | None]:
    from hybridps import native

    return native.ext, native.load_error


def set_kernel(choice: str = "auto") -> str:
    """Choose the row kernels: auto (native if built), native (required) or torch.

    Returns kernel_name(). Raises ValueError for an unknown choice and RuntimeError
    when native is required but the extension is not built or does not load.
    """
    global _native, _requested
    choice = (choice or "auto").strip().lower()
    if choice not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: the kernel must be one of {KERNELS}")
    ext, error = _native_module()
    if choice == "native" and ext is None:
        raise RuntimeError(
            f"{KERNEL_ENV}=native but the native kernels are not available ({error}); "
            "reinstall with a C compiler (pip install -e .) or use auto/torch"
        )
    _native = ext if choice in ("auto", "native") else None
    _requested = choice
    return kernel_name()


def native_in_use() -> ModuleType | None:
    """The native extension when the native kernels are in use (`set_kernel`), else None."""
    return _native


def kernel_name() -> str:
    """'native' or 'torch': which row kernels apply_rows_ / apply_update_ use."""
    return "native" if _native is not None else "torch"


def set_kernel_threads(n: int | None) -> None:
    """Threads for the native kernels; None: torch.get_num_threads() at each call."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"kernel threads must be >= 1, got {n}")
    _threads = n


def kernel_threads() -> int:
    return _threads if _threads is not None else torch.get_num_threads()


def kernel_info() -> dict[str, Any]:
    """For start-up logs: the kernel in use, what was asked, threads, the build."""
    ext, error = _native_module()
    info: dict[str, Any] = {
        "kernel": kernel_name(),
        "requested": _requested,
        "threads": kernel_threads(),
        "native_available": ext is not None,
    }
    if ext is None:
        info["native_error"] = error
    else:
        info["native_build"] = ext.build_info()
    return info


def default_kernel_threads() -> int:
    """The shard server's default: every core, up to 8.

    The native pool's caller works too and never waits for a pool thread the OS has not
    scheduled, so asking for more threads than are free costs little; past ~8 threads a
    node's memory bandwidth, not the thread count, bounds the (memory-bound) loops.
    """
    return max(1, min(8, os.cpu_count() or 1))


def _threads_from_env() -> int | None:
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{THREADS_ENV}={raw!r} is not an integer") from None
    if n < 0:
        raise ValueError(f"{THREADS_ENV}={raw!r} must be >= 0 (0: the default)")
    # 0 is the server's --kernel-threads default (the same variable): decided by the caller.
    return n or None


# -- dispatch ---------------------------------------------------------------------------

def is_cpu_f32(t: torch.Tensor) -> bool:
    # (.is_cpu, not .device.type: the server asks this several times a push, and
    # building a torch.device to read its type costs 5x more.)
    return t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _spans_overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _spans_overlap(_span(a), _span(b))


def _delta_buffer(out: torch.Tensor | None, n: int, dim: int,
                  inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The [n, dim] delta: a view of `out` (reused, no allocation) or a new tensor."""
    if out is None:
        return torch.empty(n, dim, dtype=torch.float32)
    if not is_cpu_f32(out) or out.numel() < n * dim:
        raise ValueError(
            f"out must be a contiguous CPU float32 tensor of at least {n}x{dim} elements, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    # The span of the n*dim elements used, compared as ints: no view is made to compare.
    start = out.data_ptr()
    used = (start, start + n * dim * out.element_size())
    if n:
        for t in inputs:
            if t.numel() and _spans_overlap(used, _span(t)):
                raise ValueError("out must not overlap the optimizer state or the gradients")
    return out.as_strided((n, dim), (dim, 1))  # out's first n*dim elements (contiguous)


def _int64_ids(ids_U: torch.Tensor) -> torch.Tensor | None:
    if not ids_U.is_cpu or ids_U.dim() != 1:
        return None
    if ids_U.dtype == torch.int32:
        ids_U = ids_U.to(torch.int64)
    if ids_U.dtype != torch.int64:
        return None
    return ids_U.contiguous()


def apply_rows_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor | None,
    v_RD: torch.Tensor | None,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    *,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float]:
    """One optimizer step (1-based `step`) on unique local rows `ids_U`, with the state
    tensors given in layout order (adam: m, v; rowwise_adagrad: its sum and None; sgd:
    None, None): `step_rows_` with the state by position.

    `out`: an optional reusable CPU float32 buffer (contiguous, at least U*D elements)
    that receives the delta; the returned delta is then a view of it, valid until the
    buffer is reused, and the native path allocates nothing. `num_threads`: threads
    of the native kernels for this call (default kernel_threads()). `check_finite`:
    raise NonFiniteUpdate, with the state as it was, when any new state or delta
    element is not finite (finite gradients can overflow: 3e38 squared); the native
    kernel then stores the old rows in a per-thread scratch as it goes and puts them
    back (`undo_rows_` puts back those of the last step on demand).
    """
    slots = (m_RD, v_RD)[:len(spec.state_layout())]
    if any(t is None for t in slots):
        raise ValueError(f"optimizer {spec.kind} needs its state tensors "
                         f"{[name for name, _ in spec.state_layout()]}")
    return _step(spec, tuple(t for t in slots if t is not None), ids_U, grads_UD, step,
                 out, num_threads, check_finite)


def step_rows_(
    spec: OptimizerSpec,
    state: RowState,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    *,
    out: torch.Tensor | None = None,
    num_threads: int | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float]:
    """One optimizer step on unique local rows `ids_U`; `state` holds the tensors of
    spec.state_layout() by name ([rows, D] or [rows, 1] each). The rest as apply_rows_."""
    return _step(spec, state_tensors(spec, state), ids_U, grads_UD, step, out, num_threads,
                 check_finite)


def _step(spec: OptimizerSpec, tensors: tuple[torch.Tensor, ...], ids_U: torch.Tensor,
          grads_UD: torch.Tensor, step: int, out: torch.Tensor | None,
          num_threads: int | None, check_finite: bool) -> tuple[torch.Tensor, float]:
    ext = _native
    if ext is not None:
        done = _step_native(ext, spec, tensors, ids_U, grads_UD, step, out, num_threads,
                            check_finite)
        if done is not None:
            return done
    _scratch.undo = None
    old = None
    if check_finite and tensors:  # for undo_rows_
        old = tuple(t.index_select(0, ids_U) for t in tensors)
    delta, decay = step_rows_torch_(spec, tensors, ids_U, grads_UD, step, check_finite)
    if old is not None:
        _scratch.undo = (tensors, ids_U, old)
    if out is not None:
        view = _delta_buffer(out, delta.shape[0], delta.shape[1], (*tensors, grads_UD))
        view.copy_(delta)
        delta = view
    return delta, decay


def _state_ok(tensors: tuple[torch.Tensor, ...], widths: tuple[tuple[str, int], ...]) -> bool:
    """The state tensors are what the C loops take: CPU float32 contiguous [rows, width]
    each, of the same rows, none overlapping another."""
    if len(tensors) != len(widths):
        return False
    rows = tensors[0].shape[0] if tensors else 0
    for t, (_, width) in zip(tensors, widths, strict=True):
        if not is_cpu_f32(t) or t.dim() != 2 or t.shape != (rows, width):
            return False
    return not (len(tensors) == 2 and tensors[0].numel() and tensors[1].numel()
                and _overlaps(tensors[0], tensors[1]))


def _step_native(
    ext: ModuleType,
    spec: OptimizerSpec,
    tensors: tuple[torch.Tensor, ...],
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    out: torch.Tensor | None,
    num_threads: int | None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float] | None:
    """The native step, or None when these tensors are not for the C loops."""
    if not is_cpu_f32(grads_UD) or grads_UD.dim() != 2:
        return None
    native_step = spec.record.native_kernel()
    if native_step is None:  # a kind with a torch kernel only
        return None
    n, dim = grads_UD.shape
    threads = num_threads if num_threads is not None else kernel_threads()
    widths = spec.state_widths(dim)
    ids = None
    if widths:  # a kind without state reads no ids
        ids = _int64_ids(ids_U)
        if ids is None or ids.shape[0] != n or not _state_ok(tensors, widths):
            return None
    delta = _delta_buffer(out, n, dim, (*tensors, grads_UD))
    _scratch.undo = None
    snaps: list[torch.Tensor] = []
    if check_finite and widths:
        snaps = _snapshot_buffers([n * w for _, w in widths])
    call = NativeCall(ext, tuple(t.data_ptr() for t in tensors),
                      tensors[0].shape[0] if tensors else 0, dim,
                      ids.data_ptr() if ids is not None else 0, n, grads_UD, delta, step,
                      threads, tuple(s.data_ptr() for s in snaps), check_finite)
    decay = native_step(spec, call)
    if check_finite and ids is not None:
        old = tuple(s.view(n, w) for s, (_, w) in zip(snaps, widths, strict=True))
        _scratch.undo = (tensors, ids, old)
    return delta, decay


class _Scratch(threading.local):
    """Per-thread: the snapshot buffers of check_finite steps, and what undo_rows_ needs."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)
        # (state tensors, ids, old rows of each) of the last check_finite step
        self.undo: tuple[tuple[torch.Tensor, ...], torch.Tensor,
                         tuple[torch.Tensor, ...]] | None = None


_scratch = _Scratch()


def _snapshot_buffers(sizes: Sequence[int]) -> list[torch.Tensor]:
    """float32 views of `sizes` elements each, of one per-thread buffer that grows, never
    shrinks."""
    total = sum(sizes)
    if _scratch.buffer.numel() < total:
        _scratch.buffer = torch.empty(max(total, 1 << 16), dtype=torch.float32)
    views, at = [], 0
    for size in sizes:
        views.append(_scratch.buffer[at:at + size])
        at += size
    return views


def undo_rows_() -> bool:
    """Put back the state rows of this thread's last check_finite step (e.g. when what
    follows it, the master rows, turns out non-finite); False when there is none."""
    undo, _scratch.undo = _scratch.undo, None
    if undo is None:
        return False
    tensors, ids, old = undo
    for t, rows in zip(tensors, old, strict=True):
        t.index_copy_(0, ids, rows)
    return True


def apply_update_(rows_RD: torch.Tensor, ids_U: torch.Tensor, delta_UD: torch.Tensor,
                  decay: float, *, num_threads: int | None = None) -> None:
    """rows[ids] = rows[ids] * decay + delta, on the rows' device and dtype (ids unique)."""
    ext = _native
    if (ext is not None and is_cpu_f32(rows_RD) and rows_RD.dim() == 2
            and not (rows_RD.requires_grad and torch.is_grad_enabled())):
        delta = delta_UD.to(device=rows_RD.device, dtype=rows_RD.dtype).contiguous()
        ids = _int64_ids(ids_U.to(device=rows_RD.device))
        n, dim = rows_RD.shape
        if (ids is not None and delta.dim() == 2 and delta.shape == (ids.shape[0], dim)
                and not (delta.numel() and _overlaps(rows_RD, delta))):
            threads = num_threads if num_threads is not None else kernel_threads()
            ext.apply_update(rows_RD.data_ptr(), n, dim, ids.data_ptr(), ids.shape[0],
                             delta.data_ptr(), float(decay), threads)
            return
    apply_update_torch_(rows_RD, ids_U, delta_UD, decay)


set_kernel(os.environ.get(KERNEL_ENV, "auto"))
_threads = _threads_from_env()
