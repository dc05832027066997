"""The shard server's per-push bookkeeping over the row kernels' extension: one pass that
checks a push's ids and gradients (range, order, finiteness, magnitude), the marks of
rows a partition has touched, and the digest of a push's payload. The native path is
used when the row kernels are native (hybridps/optim.py `set_kernel`; the digest: when
built); the torch path is the reference. No grpc here."""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from hybridps import native
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


# -- a push's payload digest ------------------------------------------------------------

DIGEST_K32 = 0x9E3779B9
DIGEST_LANES = 8
MASK64 = 2**64 - 1


def words_digest(t: torch.Tensor) -> int:
    """A 64-bit digest of `t`'s bytes: 8 lanes, lane j = sum(word[i] * (2i + 1) *
    DIGEST_K32) mod 2^32 over its 32-bit words i = j mod 8 (the native `digest` when
    built, else the same in numpy), folded into one number."""
    if t.numel() == 0:
        return 0
    t = t.detach().contiguous().cpu()
    nbytes = t.numel() * t.element_size()
    ext = native.ext
    if ext is not None and hasattr(ext, "digest") and nbytes % 4 == 0:
        lanes = [int(x) for x in ext.digest(t.data_ptr(), nbytes)]
    else:
        raw = t.reshape(-1).view(torch.uint8).numpy()
        pad = (-raw.size) % (4 * DIGEST_LANES)
        words = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)]).view(np.uint32)
        position = np.arange(words.size, dtype=np.uint32).reshape(-1, DIGEST_LANES)
        mult = (position * np.uint32(2) + np.uint32(1)) * np.uint32(DIGEST_K32)
        lanes = [int(x) for x in (words.reshape(-1, DIGEST_LANES) * mult).sum(
            axis=0, dtype=np.uint32)]
    h = 0
    for lane in lanes:
        h = ((h ^ lane) * 0x100000001B3) & MASK64
    return h


def _mix64(x: int) -> int:
    """splitmix64's finalizer: every input bit reaches every output bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def payload_digest(ids_U: torch.Tensor, grads_UD: torch.Tensor, lr: float | None) -> int:
    """A 64-bit digest of a push's payload (ids, gradients, its own lr), kept with its
    cached answer: a re-sent step must carry the same payload to get that answer
    (ps/session.py). A checksum against client bugs, not a cryptographic hash: the
    partition secret keeps others from pushing at all."""
    h = (words_digest(ids_U) * 0xD6E8FEB86659FD93 + words_digest(grads_UD)) & MASK64
    h ^= (int(ids_U.shape[0]) * 0xA0761D6478BD642F) & MASK64
    if lr is not None:
        h ^= struct.unpack("<Q", struct.pack("<d", lr))[0]
    return _mix64(h)
