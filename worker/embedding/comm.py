"""The one collective of the embedding path: all_to_all_single with split sizes.

`exchange` moves tensors whose first dimension is split between ranks (no
gradient). `exchange_blocks` is the input dist's one round: every rank sends
every rank a block of int64s whose length the receiver does not know yet, with
a small fixed-size header, in ONE all_to_all of padded blocks (no separate
all_to_all of the counts). `AllToAllRows` is the autograd Function used for
embedding rows and pooled partial sums: forward sends them from owners to
requesters, backward sends their gradients back to the owners the reverse way
(the split sizes swap). All work for gloo (CPU) and NCCL (GPU) unchanged.

Every rank must call these in the same order (they are collectives). The
seconds spent inside them are added to COMM_SECONDS so the training loop
can report the all_to_all share of a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from worker.runtime.device_copy import sync_point, to_device

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


@dataclass
class BlockCap:
    """The int64 elements a block of `exchange_blocks` carries in its one round.

    Every rank derives the next value from what it received (the largest block any rank
    sent), so all ranks hold the same value before every exchange of the same sequence
    (one BlockCap per process group and lookup: the sequence of its exchanges is the
    same on every rank)."""

    elements: int = 0

    def update(self, largest: int) -> None:
        """Grow past a block that did not fit, shrink when blocks stay under half: 1/8
        headroom, so a block a little larger than the last ones still fits."""
        if largest > self.elements or 2 * largest < self.elements:
            self.elements = largest + largest // 8 + 16


def exchange_blocks(header_WH: torch.Tensor, blocks: list[torch.Tensor], cap: BlockCap,
                    group: dist.ProcessGroup | None, direction: str | None = "forward"
                    ) -> tuple[list[list[int]], torch.Tensor, list[int]]:
    """Block r (1-D int64) and header row r go to rank r; returns (the header rows received,
    one list per source rank; the blocks received, concatenated in source order; their
    lengths).

    One all_to_all of W equal slots [length, largest length the sender sends anyone,
    header, block padded to cap.elements]; a block longer than the cap sends its tail in
    a second all_to_all whose splits every rank knows from the slots (rare: the cap
    follows the largest block, `BlockCap.update`)."""
    world, width = header_WH.shape
    lengths = [int(b.numel()) for b in blocks]
    fit = cap.elements
    slot = 2 + width + fit
    send_WS = header_WH.new_empty((world, slot))
    send_WS[:, 0] = to_device(torch.tensor(lengths, dtype=torch.int64), send_WS.device)
    send_WS[:, 1] = max(lengths)
    send_WS[:, 2:2 + width] = header_WH
    for r, block in enumerate(blocks):
        n = min(lengths[r], fit)
        send_WS[r, 2 + width:2 + width + n] = block[:n]
    recv_WS = _all_to_all(send_WS.reshape(-1), [slot] * world, [slot] * world, group,
                          direction).view(world, slot)
    with sync_point("input_dist"):
        meta = recv_WS[:, :2 + width].tolist()
    recv_lengths = [int(m[0]) for m in meta]
    largest = max(int(m[1]) for m in meta)
    parts = [recv_WS[s, 2 + width:2 + width + min(n, fit)] for s, n in enumerate(recv_lengths)]
    if largest > fit:  # every rank sees the same `largest`: all take this branch or none
        tails = [b[fit:] for b in blocks]
        tail_in = [max(n - fit, 0) for n in recv_lengths]
        tail = _all_to_all(torch.cat(tails), tail_in, [t.numel() for t in tails], group,
                           direction).split(tail_in)
        parts = [p for pair in zip(parts, tail, strict=True) for p in pair]
    cap.update(largest)
    return [m[2:] for m in meta], torch.cat(parts), recv_lengths


class AllToAllRows(torch.autograd.Function):
    """rows_MD held for requesters -> rows_UD requested by this rank; grads go back.

    The rows may be pooled partial sums (a bag's rows of one owner, summed there)."""

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
