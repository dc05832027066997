"""The shard server's per-push bookkeeping over the row kernels' extension: one pass that
checks a push's ids and gradients (range, order, finiteness, magnitude), and the marks of
rows a partition has touched. The native path is used when the row kernels are native
(hybridps/optim.py `set_kernel`); the torch path is the reference. No grpc here."""

from __future__ import annotations

import math

import torch

from hybridps.optim import is_cpu_f32, native_in_use


def scan_push(ids_U: torch.Tensor, grads_UD: torch.Tensor, lo: int,
              hi: int) -> tuple[int, bool, int]:
    """(first position of an id outside [lo, hi) or -1, whether the ids strictly
    increase, first non-finite element of grads (flat, row-major) or -1).

    `ids_U` int64 [U], `grads_UD` float32 [U, D] (the caller checked dtypes and shapes).
    The native kernels do it in one allocation-free pass over each; the torch path
    allocates [U] masks. After a bad id the other two are (False, -1).
    """
    ext = native_in_use()
    if (ext is not None and ids_U.is_cpu and ids_U.is_contiguous()
            and is_cpu_f32(grads_UD)):
        return ext.scan_push(ids_U.data_ptr(), ids_U.shape[0], lo, hi, grads_UD.data_ptr(),
                             grads_UD.numel())
    return _scan_push_torch(ids_U, grads_UD, lo, hi)


def scan_push_max(ids_U: torch.Tensor, grads_UD: torch.Tensor, lo: int,
                  hi: int) -> tuple[int, bool, int, float]:
    """scan_push, plus an upper bound of |gradient| (at most 2^-7 relative above the
    largest; 0.0 when another check failed first), in the same pass on the native path."""
    ext = native_in_use()
    if (ext is not None and ids_U.is_cpu and ids_U.is_contiguous()
            and is_cpu_f32(grads_UD)):
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
    ext = native_in_use()
    if (ext is not None and flags_R.is_cpu and flags_R.dtype == torch.bool
            and flags_R.is_contiguous() and ids_U.is_cpu
            and ids_U.dtype == torch.int64 and ids_U.is_contiguous()):
        return int(ext.mark_rows(flags_R.data_ptr(), flags_R.shape[0], ids_U.data_ptr(),
                                 ids_U.shape[0]))
    fresh = int((~flags_R.index_select(0, ids_U)).sum()) if ids_U.numel() else 0
    flags_R.index_fill_(0, ids_U, True)
    return fresh
