"""The owner's fused kernel for bags pooled at the owner (hybridps/native/pooled_bags.c).

When a requester sends an owner its part of every bag (worker/embedding/input_dist.py, "pooled at
the owner"), the owner's work for a unit (worker/embedding/groups.py: a block of rows holding one
or more tables) is, in the torch path: dedupe the ids it received (`OwnerPool.build`),
gather the distinct rows, add their weight prediction (worker/updates/staleness.py), sum each
bag (`PoolAtOwner`), and in backward sum each distinct row's bag gradients. `forward`
and `backward` here do the same in ONE native call each for all the unit's pooled
entries, with the same float32 results bit for bit (tests/hybridps/test_pooled_bags.py): the
torch path stays the reference and the fallback. `requests` does the requester's side
of such an entry (which owner gets which ids of which bag) in one call too.

Which path runs: `HYBRIDPS_POOL_KERNEL=auto|native|torch`; unset, it follows
`HYBRIDPS_KERNEL` (hybridps/optim.py's switch, default auto): auto takes the native
kernel when the extension is built. `set_pool_kernel` changes it in-process (tests).
The native kernel takes CPU blocks of float32 or bf16 rows (bf16 widened exactly, the
gradient rounded back by torch as in the torch path); anything else (CUDA rows) takes
the torch path whatever the choice.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

KERNELS = ("auto", "native", "torch")
KERNEL_ENV = "HYBRIDPS_POOL_KERNEL"
FALLBACK_ENV = "HYBRIDPS_KERNEL"  # when KERNEL_ENV is unset
ROW_DTYPES = (torch.float32, torch.bfloat16)

_ext: ModuleType | None
_load_error: str | None
try:
    _ext = importlib.import_module("hybridps.native._pooled_bags")
    _load_error = None
except ImportError as e:  # not built (no C compiler at install), or another interpreter's
    _ext = None
    _load_error = f"{type(e).__name__}: {e}"

_native: ModuleType | None = None  # the extension when the native kernel is in use


def set_pool_kernel(choice: str = "auto") -> str:
    """auto (native if built), native (required: RuntimeError if not built) or torch;
    returns pool_kernel_name()."""
    global _native
    choice = (choice or "auto").strip().lower()
    if choice not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: the pooled-bags kernel must be one of "
                         f"{KERNELS}")
    if choice == "native" and _ext is None:
        raise RuntimeError(f"{KERNEL_ENV}=native but the pooled-bags kernel is not built "
                           f"({_load_error}); reinstall with a C compiler (pip install -e .) "
                           "or use auto/torch")
    _native = _ext if choice in ("auto", "native") else None
    return pool_kernel_name()


def pool_kernel_name() -> str:
    return "native" if _native is not None else "torch"


def fused_for(weight_RD: torch.Tensor) -> bool:
    """Whether the native kernel is in use and takes this block of rows."""
    return (_native is not None and weight_RD.is_cpu and weight_RD.dim() == 2
            and weight_RD.dtype in ROW_DTYPES and weight_RD.is_contiguous())


@functools.cache
def _takes_cuts(ext: ModuleType) -> bool:
    """Whether the built extension routes by cut points (an older build: row-wise only)."""
    return bool(ext.build_info().get("cuts"))


def requests(ids_M: torch.Tensor, offsets_B: torch.Tensor | None, rows: int, world: int,
             cuts: Sequence[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The requester's side of one entry pooled at its owners (worker/embedding/input_dist.py
    make_requests, whose torch path is the reference) in one native call: (local_M, the
    ids' rows at their owners grouped by owner, id order within one; lengths_WB, int64
    [world * bags]: each owner's share of each bag; per_owner_W). `cuts`: the table's
    world + 1 cut points (worker/embedding/sharding.py), None: row-wise. None where the
    native kernel is not in use or does not take these tensors (not CPU int64, bad
    offsets or cuts): the caller takes the torch path."""
    ext = _native
    if (ext is None or offsets_B is None or not (ids_M.is_cpu and offsets_B.is_cpu)
            or ids_M.dtype != torch.int64 or offsets_B.dtype != torch.int64
            or (cuts is not None and (len(cuts) != world + 1 or not _takes_cuts(ext)))):
        return None
    cuts_C = None if cuts is None else torch.tensor(list(cuts), dtype=torch.int64)
    ids_M, offsets_B = ids_M.contiguous(), offsets_B.contiguous()
    bags = offsets_B.numel()
    local_M = torch.empty_like(ids_M)
    lengths_WB = torch.empty(world * bags, dtype=torch.int64)
    per_owner_W = torch.empty(world, dtype=torch.int64)
    if ext.requests(ids_M.data_ptr(), ids_M.numel(), offsets_B.data_ptr(), bags, rows, world,
                    local_M.data_ptr(), lengths_WB.data_ptr(), per_owner_W.data_ptr(),
                    0 if cuts_C is None else cuts_C.data_ptr()) < 0:
        return None
    return local_M, lengths_WB, per_owner_W


@dataclass
class BagsAtOwner:
    """One pooled entry as its owner received it: ids_M (table-local rows, requester
    order, each requester's in bag order) and lengths_B (every requester's bags, in
    requester order); the table is `rows` rows at `offset` in its unit's block."""

    ids_M: torch.Tensor
    lengths_B: torch.Tensor
    offset: int
    rows: int


@dataclass
class PoolLayout:
    """What forward found and backward needs: the distinct block rows (sorted), where each
    one's occurrences start (U + 1) and the bag of every occurrence, grouped by row."""

    uniq_U: torch.Tensor
    starts_U1: torch.Tensor
    bags_by_row_M: torch.Tensor
    bags: int  # the bags of every entry, the rows of the gradient backward takes


def _ids(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def forward(weight_RD: torch.Tensor, entries: Sequence[BagsAtOwner],
            prediction: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, PoolLayout]:
    """(bags_BD, layout): every entry's bags summed (entry after entry; float32), rows plus
    `prediction` (keys_P sorted distinct block rows, offset_PD float32) where it has one.

    Native only (`fused_for(weight_RD)` must hold): the caller keeps the torch path."""
    ext = _native
    assert ext is not None and fused_for(weight_RD), "forward() without the native kernel"
    dim = weight_RD.shape[1]
    ids = [_ids(e.ids_M) for e in entries]
    lengths = [_ids(e.lengths_B) for e in entries]
    for e, ids_M, lengths_B in zip(entries, ids, lengths, strict=True):
        if ids_M.dim() != 1 or lengths_B.dim() != 1 or not (ids_M.is_cpu and lengths_B.is_cpu):
            raise ValueError(f"pooled bags take 1-D CPU ids and lengths, got "
                             f"{tuple(ids_M.shape)} and {tuple(lengths_B.shape)}")
        if e.offset < 0 or e.rows < 0 or e.offset + e.rows > weight_RD.shape[0]:
            raise ValueError(f"table rows [{e.offset}, {e.offset + e.rows}) outside the "
                             f"block's {weight_RD.shape[0]}")
    table = torch.tensor([[i.data_ptr(), i.numel(), n.data_ptr(), n.numel(), e.offset, e.rows]
                          for e, i, n in zip(entries, ids, lengths, strict=True)],
                         dtype=torch.int64).reshape(len(entries), 6)
    total = sum(i.numel() for i in ids)
    bags_BD = torch.empty(sum(n.numel() for n in lengths), dim, dtype=torch.float32)
    uniq = torch.empty(total, dtype=torch.int64)
    starts = torch.empty(total + 1, dtype=torch.int64)
    bags_by_row = torch.empty(total, dtype=torch.int64)
    keys_P = offset_PD = None
    if prediction is not None and prediction[0].numel():
        keys_P = _ids(prediction[0])
        offset_PD = prediction[1].to(torch.float32).contiguous()
        if offset_PD.shape != (keys_P.numel(), dim) or not (keys_P.is_cpu and offset_PD.is_cpu):
            raise ValueError(f"prediction of {keys_P.numel()} rows with offsets "
                             f"{tuple(offset_PD.shape)} for rows of width {dim}")
    num = ext.forward(weight_RD.data_ptr(), weight_RD.shape[0], dim,
                      weight_RD.dtype == torch.bfloat16, table.data_ptr(), len(entries),
                      0 if keys_P is None else keys_P.data_ptr(),
                      0 if keys_P is None else keys_P.numel(),
                      0 if offset_PD is None else offset_PD.data_ptr(), bags_BD.data_ptr(),
                      uniq.data_ptr(), starts.data_ptr(), bags_by_row.data_ptr())
    return bags_BD, PoolLayout(uniq[:num], starts[:num + 1], bags_by_row, bags_BD.shape[0])


def backward(layout: PoolLayout, grad_BD: torch.Tensor) -> torch.Tensor:
    """grad_UD: each distinct row's gradient (float32), the sum of its bags' gradients."""
    ext = _native
    assert ext is not None, "backward() without the native kernel"
    grad = grad_BD.to(torch.float32).contiguous()
    if grad.dim() != 2 or grad.shape[0] != layout.bags or not grad.is_cpu:
        raise ValueError(f"the gradient of {layout.bags} bags must be a CPU [bags, dim] "
                         f"tensor, got {tuple(grad.shape)} on {grad.device}")
    num, dim = layout.uniq_U.numel(), grad.shape[1]
    grad_UD = torch.empty(num, dim, dtype=torch.float32)
    ext.backward(grad.data_ptr(), dim, num, layout.starts_U1.data_ptr(),
                 layout.bags_by_row_M.data_ptr(), grad_UD.data_ptr())
    return grad_UD


set_pool_kernel(os.environ.get(KERNEL_ENV) or os.environ.get(FALLBACK_ENV, "auto"))
