"""All-gather of per-rank rows of different lengths, with autograd, for row-sharded work.

Sharded scoring (KvsAll, shard-parallel ranking) needs every rank to score EVERY query of
the global batch against the rows it owns. Each rank computes the queries of its own
samples, `all_gather_rows` concatenates them in rank order; its backward sums the gradient
of every rank's copy (an all-reduce) and hands each rank the slice of its own queries, so
the query's inputs (looked-up rows, dense parameters) get the gradient of all the blocks.

`sizes` (rows of every rank) must be known on every rank: `gather_sizes` exchanges them.
In a world of one (group None) everything is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def dist_info(embedding: Any) -> tuple[int, int, dist.ProcessGroup | None]:
    """(rank, world_size, group) of a ShardedEmbedding; (0, 1, None) for the single-process
    reference's LocalEmbedding (which has none of them)."""
    return (int(getattr(embedding, "rank", 0)), int(getattr(embedding, "world_size", 1)),
            getattr(embedding, "group", None))


def gather_sizes(n: int, world_size: int, group: dist.ProcessGroup | None,
                 device: torch.device | str = "cpu") -> list[int]:
    """[rows of rank 0, ..., rows of rank W-1] (a collective unless world_size == 1)."""
    if world_size == 1:
        return [n]
    local = torch.tensor([n], dtype=torch.int64, device=device)
    out = [torch.zeros_like(local) for _ in range(world_size)]
    dist.all_gather(out, local, group=group)
    return [int(t) for t in out]


def _gather(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    width = max(sizes)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


class AllGatherRows(torch.autograd.Function):
    """x [sizes[rank], ...] -> [sum(sizes), ...]; backward: all-reduce, keep own slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: list[int], rank: int,
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grads[0].contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        lo = sum(ctx.sizes[: ctx.rank])
        return grad[lo: lo + ctx.sizes[ctx.rank]], None, None, None


def all_gather_rows(x: torch.Tensor, sizes: list[int], rank: int, world_size: int,
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's x (rank order), differentiable when x requires grad."""
    if x.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank} holds {x.shape[0]} rows but sizes say {sizes[rank]}")
    if world_size == 1:
        return x
    if not x.requires_grad:
        with torch.no_grad():
            return _gather(x, sizes, group)
    out = AllGatherRows.apply(x, sizes, rank, group)
    assert isinstance(out, torch.Tensor)
    return out


def all_reduce_sum(x: torch.Tensor, world_size: int, group: dist.ProcessGroup | None
                   ) -> torch.Tensor:
    """Sum over ranks (in place; no autograd)."""
    if world_size > 1:
        dist.all_reduce(x, group=group)
    return x
