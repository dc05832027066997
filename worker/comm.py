"""The one collective of the embedding path: all_to_all_single with split sizes.

`exchange` moves tensors whose first dimension is split between ranks
(counts, ids: no gradient). `AllToAllRows` is the autograd Function used
for embedding rows: forward sends rows from owners to requesters, backward
sends the row gradients back to the owners the reverse way (the split sizes
swap). Both work for gloo (CPU) and NCCL (GPU) unchanged.

Every rank must call these in the same order (they are collectives). The
seconds spent inside them are added to COMM_SECONDS so the training loop
can report the all_to_all share of a step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

# Wall seconds spent inside all_to_all_single since the last reset, by direction.
COMM_SECONDS: dict[str, float] = {"forward": 0.0, "backward": 0.0}


def reset_comm_seconds() -> dict[str, float]:
    """Return the seconds accumulated so far and start again from zero."""
    out = dict(COMM_SECONDS)
    for key in COMM_SECONDS:
        COMM_SECONDS[key] = 0.0
    return out


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None, direction: str | None) -> torch.Tensor:
    """x [sum(in_splits), ...] -> [sum(out_splits), ...]; chunk r of x goes to rank r.

    direction None: not added to COMM_SECONDS (the pipeline's input dist, which runs on
    its own thread and would otherwise count into the training thread's step)."""
    t0 = time.perf_counter()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    if direction is not None:
        COMM_SECONDS[direction] += time.perf_counter() - t0
    return out


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
             group: dist.ProcessGroup | None, direction: str | None = "forward"
             ) -> torch.Tensor:
    """all_to_all without autograd (counts, ids)."""
    with torch.no_grad():
        return _all_to_all(x, out_splits, in_splits, group, direction)


class AllToAllRows(torch.autograd.Function):
    """rows_MD held for requesters -> rows_UD requested by this rank; grads go back."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(rows, out_splits, in_splits, group, "forward")

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = _all_to_all(grads[0], ctx.in_splits, ctx.out_splits, ctx.group, "backward")
        return grad, None, None, None


def all_to_all_rows(rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    out = AllToAllRows.apply(rows, out_splits, in_splits, group)
    assert isinstance(out, torch.Tensor)  # for the type checker
    return out
