"""The shard server's per-push bookkeeping over the row kernels' extension: one pass that
checks a push's ids and gradients (range, order, finiteness, magnitude), the marks of
rows a partition has touched, and the digest of a push's payload. The native path is
used when the row kernels are native (hybridps/optim.py `set_kernel`; the digest: when
built); the torch path is the reference. No grpc here."""

from __future__ import annotations

import math
from collections.abc import Sequence

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


def scan_push_max(ids_U: torch.Tensor, grads_UD: torch.Tensor, lo: int, hi: int,
                  digest: PayloadDigest | None = None) -> tuple[int, bool, int, float]:
    """scan_push, plus an upper bound of |gradient| (at most 2^-7 relative above the
    largest; 0.0 when another check failed first), in the same pass on the native path;
    and the chunk added to `digest` (in that pass too) when the checks pass."""
    ext = native_in_use()
    if (ext is not None and ids_U.is_cpu and ids_U.is_contiguous()
            and is_cpu_f32(grads_UD)):
        if digest is None:
            return ext.scan_push(ids_U.data_ptr(), ids_U.shape[0], lo, hi,
                                 grads_UD.data_ptr(), grads_UD.numel(), 1)
        bad, increasing, nonfinite, bound, id_lanes, grad_lanes = ext.scan_push(
            ids_U.data_ptr(), ids_U.shape[0], lo, hi, grads_UD.data_ptr(), grads_UD.numel(),
            1, digest.id_words, digest.grad_words)
        if bad < 0 and nonfinite < 0:
            digest.merge(id_lanes, grad_lanes, ids_U, grads_UD)
        return bad, increasing, nonfinite, bound
    bad, increasing, nonfinite = _scan_push_torch(ids_U, grads_UD, lo, hi)
    if bad >= 0 or nonfinite >= 0 or grads_UD.numel() == 0:
        if digest is not None and bad < 0 and nonfinite < 0:
            digest.add(ids_U, grads_UD)
        return bad, increasing, nonfinite, 0.0
    if digest is not None:
        digest.add(ids_U, grads_UD)
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

DIGEST_LANES = 8
MASK32 = 2**32 - 1


def digest_lanes(t: torch.Tensor, offset: int = 0) -> list[int]:
    """The 16 digest lanes of `t`'s bytes as 32-bit words at positions offset..: the word
    at position p adds itself to lane p mod 8 and (p // 8) * itself to lane 8 + p mod 8,
    mod 2^32 (the native `digest` when built, else the same in numpy). A changed word
    changes the first, two swapped words the second."""
    if t.numel() == 0:
        return [0] * (2 * DIGEST_LANES)
    t = t.detach().contiguous().cpu()
    nbytes = t.numel() * t.element_size()
    ext = native.ext
    if ext is not None and hasattr(ext, "digest") and nbytes % 4 == 0:
        return [int(x) for x in ext.digest(t.data_ptr(), nbytes, offset)]
    raw = t.reshape(-1).view(torch.uint8).numpy()
    words = np.concatenate([raw, np.zeros((-raw.size) % 4, dtype=np.uint8)]).view(np.uint32)
    position = np.arange(offset, offset + words.size, dtype=np.uint64)
    block = ((position >> np.uint64(3)) & np.uint64(MASK32)).astype(np.uint32)
    sums, weighted = [0] * DIGEST_LANES, [0] * DIGEST_LANES
    for j in range(DIGEST_LANES):
        mine = (position % DIGEST_LANES) == j
        sums[j] = int(words[mine].sum(dtype=np.uint32))
        weighted[j] = int((words[mine] * block[mine]).sum(dtype=np.uint32))
    return sums + weighted


class PayloadDigest:
    """The digest of one push's payload (ids, gradients, its own lr), built chunk by chunk
    (`add`, or in the same pass as the checks: `scan_push_max`'s `digest`): kept with the
    push's cached answer, so a re-sent step gets that answer only if it carries the same
    payload (ps/core/session.py). A checksum against client bugs, not a cryptographic hash:
    the partition secret keeps others from pushing at all."""

    def __init__(self) -> None:
        self.id_lanes: list[int] = []  # 16 lanes each once a chunk is in (digest_lanes)
        self.grad_lanes: list[int] = []
        self.id_words = 0    # words digested so far: the next chunk's positions
        self.grad_words = 0
        self.ids = 0

    def merge(self, id_lanes: Sequence[int], grad_lanes: Sequence[int], ids_U: torch.Tensor,
              grads_UD: torch.Tensor) -> None:
        """Add a chunk's lanes (computed at this digest's offsets)."""
        if not self.id_lanes:  # the first chunk (most pushes have one)
            self.id_lanes, self.grad_lanes = list(id_lanes), list(grad_lanes)
        else:
            self.id_lanes = [(a + b) & MASK32 for a, b in zip(self.id_lanes, id_lanes,
                                                              strict=True)]
            self.grad_lanes = [(a + b) & MASK32 for a, b in zip(self.grad_lanes, grad_lanes,
                                                                strict=True)]
        self.id_words += 2 * int(ids_U.shape[0])  # int64 ids
        self.grad_words += grads_UD.numel()       # float32 gradients
        self.ids += int(ids_U.shape[0])

    def add(self, ids_U: torch.Tensor, grads_UD: torch.Tensor) -> PayloadDigest:
        """Digest a chunk (after the ones before it)."""
        self.merge(digest_lanes(ids_U, self.id_words), digest_lanes(grads_UD, self.grad_words),
                   ids_U, grads_UD)
        return self

    def value(self, lr: float | None) -> tuple[object, ...]:
        """The digest, compared whole: ids, lr and every lane (no hash of them, so no
        collision beyond the lanes')."""
        empty = [0] * (2 * DIGEST_LANES)
        return (self.ids, lr, *(self.id_lanes or empty), *(self.grad_lanes or empty))


def payload_digest(ids_U: torch.Tensor, grads_UD: torch.Tensor, lr: float | None
                   ) -> tuple[object, ...]:
    """The PayloadDigest of a whole push."""
    return PayloadDigest().add(ids_U, grads_UD).value(lr)
