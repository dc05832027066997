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

Two implementations of apply_rows_ / apply_update_:
- "native": the fused single-pass C loops of hybridps/native/fused_adam.c (one pass over
  the rows, m and v updated in place, delta written into one buffer, optionally
  caller-owned; a pthread pool across rows). m and v are bitwise those of the torch
  path, as are sgd and the row update; the adam/adamw delta can differ in the last
  bits (<= ~5 ulp) because torch's float32 sqrt is not always correctly rounded.
- "torch": the vectorized torch ops below, the reference.
The module picks one at import (`HYBRIDPS_KERNEL=auto|native|torch`, default auto:
native when the extension is built); `kernel_name()` says which. Calls whose
tensors the C loops do not take (not CPU, not float32, not contiguous...) use the
torch path whatever the choice. Kernel threads: `HYBRIDPS_KERNEL_THREADS` (0 or unset:
torch.get_num_threads() of the calling thread; the shard server's --kernel-threads,
the same variable, sets default_kernel_threads() for 0); `num_threads=` overrides per call.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from hybridps.errors import InvalidArgument, NonFiniteUpdate

KINDS = ("adam", "adamw", "sgd")
KERNELS = ("auto", "native", "torch")
KERNEL_ENV = "HYBRIDPS_KERNEL"
THREADS_ENV = "HYBRIDPS_KERNEL_THREADS"


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


def _all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


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
    if check_finite and not _all_finite(numer, v_new, delta):
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
    if check_finite and not _all_finite(m, v, delta):
        raise NonFiniteUpdate("the update would make m, v or the delta non-finite")
    m_RD.index_copy_(0, ids_U, m)
    v_RD.index_copy_(0, ids_U, v)
    return delta, 1.0 - spec.lr * spec.weight_decay


def sgd_rows_(spec: OptimizerSpec, grads_UD: torch.Tensor) -> tuple[torch.Tensor, float]:
    return grads_UD.mul(-spec.lr), 1.0 - spec.lr * spec.weight_decay


def apply_rows_torch_(
    spec: OptimizerSpec,
    m_RD: torch.Tensor | None,
    v_RD: torch.Tensor | None,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float]:
    """The torch reference of apply_rows_ (any device and dtype)."""
    if spec.kind == "sgd":
        delta, decay = sgd_rows_(spec, grads_UD)
        if check_finite and not _all_finite(delta):
            raise NonFiniteUpdate("the update would make the delta non-finite")
        return delta, decay
    assert m_RD is not None and v_RD is not None  # internal invariant, not user input
    if spec.kind == "adam":
        return sparse_adam_rows_(spec, m_RD, v_RD, ids_U, grads_UD, step, check_finite)
    return adamw_rows_(spec, m_RD, v_RD, ids_U, grads_UD, step, check_finite)


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


HUGEPAGE_MIN_BYTES = 4 << 20
HUGEPAGE_BYTES = 2 << 20
# Where each array a row kernel reads at the same row sits past a 2 MiB boundary
# (alloc_state's `offset`): m, v and the master row of one id fall in different L1 sets.
# "rows": a CPU rank's own embedding rows (worker/embedding.py).
STATE_OFFSETS = {"m": 0, "v": 2048, "master": 1024, "rows": 3072}


def alloc_state(rows: int, dim: int, *, hugepages: bool = True, offset: int = 0,
                zero: bool = True) -> torch.Tensor:
    """A float32 [rows, dim] CPU tensor for optimizer state or embedding rows, zeroed
    unless `zero=False` (a large table's memory is then left untouched, as torch.empty
    leaves it, for a caller that writes every element itself).

    Tables of HUGEPAGE_MIN_BYTES or more start `offset` bytes (a multiple of 64, below
    4096) past a 2 MiB boundary, and their storage is exactly the table (a save writes
    no slack). Why: the update kernel reads m[id] and v[id] together, and two tables
    allocated one after the other sit a whole number of pages apart, so m[id] and v[id]
    share an L1 set; with power-of-two table sizes they also share the way predictor's
    tag on this machine's AMD cores, and bench/bench_wire.py's 2^19 x 64 tables updated
    at 6.7 M rows/s instead of 16-18 (STATE_OFFSETS gives each array its own offset).

    With `hugepages` (Linux, extension built) the memory is advised for transparent
    huge pages before it is first touched. The row kernels touch random rows of
    tables far beyond the reach of the TLB with 4 KiB pages, and in a VM each TLB
    miss is a two-level page walk: bench/bench_kernel.py measured the native update
    1.2-1.7x faster on such tables (more right after allocation).
    """
    if offset % 64 or not 0 <= offset < 4096:
        raise ValueError(f"offset {offset} must be a multiple of 64 in [0, 4096)")
    nbytes = rows * dim * 4
    if nbytes < HUGEPAGE_MIN_BYTES:
        return torch.zeros(rows, dim, dtype=torch.float32)
    raw = np.empty(nbytes + HUGEPAGE_BYTES + offset, dtype=np.uint8)
    start = (-raw.ctypes.data) % HUGEPAGE_BYTES + offset
    # from_numpy of the slice: the tensor's storage is the slice (it keeps `raw` alive)
    t = torch.from_numpy(raw[start:start + nbytes].view(np.float32).reshape(rows, dim))
    ext, _ = _native_module()
    if hugepages and ext is not None:
        ext.advise_hugepages(t.data_ptr(), nbytes)
    return t.zero_() if zero else t


# -- dispatch ---------------------------------------------------------------------------

def _is_cpu_f32(t: torch.Tensor) -> bool:
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
    if not _is_cpu_f32(out) or out.numel() < n * dim:
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
    """One optimizer step (1-based `step`) on unique local rows `ids_U`.

    `out`: an optional reusable CPU float32 buffer (contiguous, at least U*D elements)
    that receives the delta; the returned delta is then a view of it, valid until the
    buffer is reused, and the native path allocates nothing. `num_threads`: threads
    of the native kernels for this call (default kernel_threads()). `check_finite`:
    raise NonFiniteUpdate, with m and v as they were, when any new m, v or delta
    element is not finite (finite gradients can overflow: 3e38 squared); the native
    kernel then stores the old rows in a per-thread scratch as it goes and puts them
    back (`undo_rows_` puts back those of the last step on demand).
    """
    ext = _native
    if ext is not None:
        done = _apply_rows_native(ext, spec, m_RD, v_RD, ids_U, grads_UD, step, out,
                                  num_threads, check_finite)
        if done is not None:
            return done
    _scratch.undo = None
    old = None
    if check_finite and m_RD is not None and v_RD is not None:  # for undo_rows_
        old = (m_RD.index_select(0, ids_U), v_RD.index_select(0, ids_U))
    delta, decay = apply_rows_torch_(spec, m_RD, v_RD, ids_U, grads_UD, step, check_finite)
    if old is not None:
        assert m_RD is not None and v_RD is not None
        _scratch.undo = (m_RD, v_RD, ids_U, old)
    if out is not None:
        inputs = (grads_UD,) if m_RD is None or v_RD is None else (m_RD, v_RD, grads_UD)
        view = _delta_buffer(out, delta.shape[0], delta.shape[1], inputs)
        view.copy_(delta)
        delta = view
    return delta, decay


def _apply_rows_native(
    ext: ModuleType,
    spec: OptimizerSpec,
    m_RD: torch.Tensor | None,
    v_RD: torch.Tensor | None,
    ids_U: torch.Tensor,
    grads_UD: torch.Tensor,
    step: int,
    out: torch.Tensor | None,
    num_threads: int | None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, float] | None:
    """The native step, or None when these tensors are not for the C loops."""
    if not _is_cpu_f32(grads_UD) or grads_UD.dim() != 2:
        return None
    n, dim = grads_UD.shape
    threads = num_threads if num_threads is not None else kernel_threads()
    if spec.kind == "sgd":
        delta = _delta_buffer(out, n, dim, (grads_UD,))
        ext.scale(grads_UD.data_ptr(), delta.data_ptr(), n * dim, -spec.lr, threads)
        if check_finite and not _all_finite(delta):
            raise NonFiniteUpdate("the update would make the delta non-finite")
        _scratch.undo = None
        return delta, 1.0 - spec.lr * spec.weight_decay
    if m_RD is None or v_RD is None:
        return None
    ids = _int64_ids(ids_U)
    if (ids is None or ids.shape[0] != n or not _is_cpu_f32(m_RD) or not _is_cpu_f32(v_RD)
            or m_RD.dim() != 2 or m_RD.shape != v_RD.shape or m_RD.shape[1] != dim
            or (m_RD.numel() and _overlaps(m_RD, v_RD))):
        return None
    delta = _delta_buffer(out, n, dim, (m_RD, v_RD, grads_UD))
    b1, b2 = spec.beta1, spec.beta2
    rows = m_RD.shape[0]
    snap: tuple[int, int] = (0, 0)
    _scratch.undo = None
    if check_finite:
        sm, sv = _snapshot_buffers(n * dim)
        snap = (sm.data_ptr(), sv.data_ptr())
    if spec.kind == "adam":
        step_size = spec.lr * math.sqrt(1 - b2**step) / (1 - b1**step)
        undone = ext.adam(m_RD.data_ptr(), v_RD.data_ptr(), rows, dim, ids.data_ptr(), n,
                          grads_UD.data_ptr(), delta.data_ptr(), 1 - b1, 1 - b2, spec.eps,
                          -step_size, threads, *snap)
        decay = 1.0
    else:
        step_size = spec.lr / (1 - b1**step)
        undone = ext.adamw(m_RD.data_ptr(), v_RD.data_ptr(), rows, dim, ids.data_ptr(), n,
                           grads_UD.data_ptr(), delta.data_ptr(), 1 - b1, b2, 1 - b2,
                           math.sqrt(1 - b2**step), spec.eps, -step_size, threads, *snap)
        decay = 1.0 - spec.lr * spec.weight_decay
    if undone:
        raise NonFiniteUpdate("the update would make m, v or the delta non-finite")
    if check_finite:
        sm, sv = _snapshot_buffers(n * dim)
        _scratch.undo = (m_RD, v_RD, ids, (sm.view(n, dim), sv.view(n, dim)))
    return delta, decay


class _Scratch(threading.local):
    """Per-thread: the snapshot buffers of check_finite steps, and what undo_rows_ needs."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)
        # (m, v, ids, (old m rows, old v rows)) of the last check_finite step
        self.undo: tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                         tuple[torch.Tensor, torch.Tensor]] | None = None


_scratch = _Scratch()


def _snapshot_buffers(elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 [elems] views of a per-thread buffer that grows, never shrinks."""
    if _scratch.buffer.numel() < 2 * elems:
        _scratch.buffer = torch.empty(max(2 * elems, 1 << 16), dtype=torch.float32)
    return _scratch.buffer[:elems], _scratch.buffer[elems:2 * elems]


def undo_rows_() -> bool:
    """Put back the m, v rows of this thread's last check_finite step (e.g. when what
    follows it, the master rows, turns out non-finite); False when there is none."""
    undo, _scratch.undo = _scratch.undo, None
    if undo is None:
        return False
    m_RD, v_RD, ids, (old_m, old_v) = undo
    m_RD.index_copy_(0, ids, old_m)
    v_RD.index_copy_(0, ids, old_v)
    return True


def apply_update_(rows_RD: torch.Tensor, ids_U: torch.Tensor, delta_UD: torch.Tensor,
                  decay: float, *, num_threads: int | None = None) -> None:
    """rows[ids] = rows[ids] * decay + delta, on the rows' device and dtype (ids unique)."""
    ext = _native
    if (ext is not None and _is_cpu_f32(rows_RD) and rows_RD.dim() == 2
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


# -- push checks and row marks (the server's per-push bookkeeping) ------------------------

def scan_push(ids_U: torch.Tensor, grads_UD: torch.Tensor, lo: int,
              hi: int) -> tuple[int, bool, int]:
    """(first position of an id outside [lo, hi) or -1, whether the ids strictly
    increase, first non-finite element of grads (flat, row-major) or -1).

    `ids_U` int64 [U], `grads_UD` float32 [U, D] (the caller checked dtypes and shapes).
    The native kernels do it in one allocation-free pass over each; the torch path
    allocates [U] masks. After a bad id the other two are (False, -1).
    """
    ext = _native
    if (ext is not None and ids_U.is_cpu and ids_U.is_contiguous()
            and _is_cpu_f32(grads_UD)):
        return ext.scan_push(ids_U.data_ptr(), ids_U.shape[0], lo, hi, grads_UD.data_ptr(),
                             grads_UD.numel())
    return _scan_push_torch(ids_U, grads_UD, lo, hi)


def scan_push_max(ids_U: torch.Tensor, grads_UD: torch.Tensor, lo: int,
                  hi: int) -> tuple[int, bool, int, float]:
    """scan_push, plus an upper bound of |gradient| (at most 2^-7 relative above the
    largest; 0.0 when another check failed first), in the same pass on the native path."""
    ext = _native
    if (ext is not None and ids_U.is_cpu and ids_U.is_contiguous()
            and _is_cpu_f32(grads_UD)):
        return ext.scan_push(ids_U.data_ptr(), ids_U.shape[0], lo, hi, grads_UD.data_ptr(),
                             grads_UD.numel(), 1)
    bad, increasing, nonfinite = _scan_push_torch(ids_U, grads_UD, lo, hi)
    if bad >= 0 or nonfinite >= 0 or grads_UD.numel() == 0:
        return bad, increasing, nonfinite, 0.0
    return bad, increasing, nonfinite, float(grads_UD.abs().amax())


def _scan_push_torch(ids_U: torch.Tensor, grads_UD: torch.Tensor, lo: int,
                     hi: int) -> tuple[int, bool, int]:
    n = ids_U.shape[0]
    if n == 0:
        return -1, True, -1
    low, high = (int(x) for x in torch.aminmax(ids_U))  # two scalars, no [U] temporaries
    if low < lo or high >= hi:
        return int(((ids_U < lo) | (ids_U >= hi)).nonzero()[0, 0]), False, -1
    increasing = n < 2 or bool((ids_U[1:] > ids_U[:-1]).all())
    # A finite sum implies finite elements (inf and NaN propagate through +), and a sum
    # allocates nothing, where isfinite() makes a [U, dim] mask; only a non-finite sum
    # (a bad element, or an overflow of finite ones) takes the exact check.
    if math.isfinite(float(grads_UD.sum())):
        return -1, increasing, -1
    bad = (~torch.isfinite(grads_UD)).reshape(-1).nonzero()
    return -1, increasing, int(bad[0, 0]) if bad.numel() else -1


def mark_rows_(flags_R: torch.Tensor, ids_U: torch.Tensor) -> int:
    """flags[ids] = True (bool [R], unique local ids); returns how many were False."""
    ext = _native
    if (ext is not None and flags_R.is_cpu and flags_R.dtype == torch.bool
            and flags_R.is_contiguous() and ids_U.is_cpu
            and ids_U.dtype == torch.int64 and ids_U.is_contiguous()):
        return int(ext.mark_rows(flags_R.data_ptr(), flags_R.shape[0], ids_U.data_ptr(),
                                 ids_U.shape[0]))
    fresh = int((~flags_R.index_select(0, ids_U)).sum()) if ids_U.numel() else 0
    flags_R.index_fill_(0, ids_U, True)
    return fresh


set_kernel(os.environ.get(KERNEL_ENV, "auto"))
_threads = _threads_from_env()
