"""The input dist's parts (worker/embedding/input_dist.py, worker/embedding/comm.py
exchange_blocks).

- the numpy sort behind dedupe and coalesce gives torch.unique's / torch.sort's results,
  on both of its paths (packed keys, and torch when the key does not fit 63 bits);
- transpose_blocks reorders blocks like a loop over them would;
- PoolAtOwner pools like F.embedding_bag and its gradient is the dense one, over sorted
  distinct rows (coalesced as made);
- exchange_blocks on 3 gloo ranks: blocks of any length arrive whole, in one round once
  the cap fits, with a second round when a block outgrows it, and every rank holds the
  same cap after every exchange.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.testing.spawn_helpers import run_ranks
from worker.embedding.comm import BlockCap, exchange_blocks
from worker.embedding.input_dist import (
    OwnerPool,
    PoolAtOwner,
    sort_stable,
    transpose_blocks,
    unique_inverse,
    unique_runs,
)
from worker.runtime.dist import DistContext


@pytest.mark.parametrize("bound", [7, 100_000, 1 << 62], ids=["tiny", "ids", "torch-path"])
@pytest.mark.parametrize("num", [0, 1, 2, 100, 5000, 20_000])
def test_unique_runs_is_torch_unique(bound: int, num: int) -> None:
    gen = torch.Generator().manual_seed(num)
    values = torch.randint(0, min(bound, 1 << 40), (num,), generator=gen)
    uniq, inverse, order, runs = unique_runs(values, bound)
    ref_uniq, ref_inverse, ref_runs = torch.unique(values, sorted=True, return_inverse=True,
                                                   return_counts=True)
    assert torch.equal(uniq, ref_uniq) and torch.equal(inverse, ref_inverse)
    assert torch.equal(runs, ref_runs)
    assert all(torch.equal(a, b) for a, b in zip(unique_inverse(values, bound),
                                                 (ref_uniq, ref_inverse), strict=True))
    ref_sorted, ref_order = torch.sort(values, stable=True)
    got_sorted, got_order = sort_stable(values, bound)
    assert torch.equal(got_sorted, ref_sorted) and torch.equal(got_order, ref_order)
    assert torch.equal(order, ref_order)


def test_transpose_blocks_reorders_like_a_loop() -> None:
    counts = torch.tensor([[2, 0, 3], [1, 4, 0]])  # 2 x 3 blocks, row-major in x
    x, blocks, pos = [], {}, 0
    for a in range(2):
        for b in range(3):
            n = int(counts[a, b])
            blocks[(a, b)] = list(range(pos, pos + n))
            x += blocks[(a, b)]
            pos += n
    expected = [v for b in range(3) for a in range(2) for v in blocks[(a, b)]]
    got = torch.tensor(x).index_select(0, transpose_blocks(counts, len(x)))
    assert got.tolist() == expected


def test_pool_at_owner_is_embedding_bag_and_its_gradient_coalesced() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 4, generator=gen, requires_grad=True)
    lengths = torch.tensor([3, 0, 5, 1, 2])
    ids = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    ids[:3] = 7  # repeats within a bag and across bags
    ids[-1] = 7
    pool = OwnerPool.build(ids, lengths, 50)
    out = PoolAtOwner.apply(weight, weight.detach().index_select(0, pool.uniq_U), pool)
    assert isinstance(out, torch.Tensor)
    offsets = torch.cumsum(lengths, 0) - lengths
    torch.testing.assert_close(out, F.embedding_bag(ids, weight.detach(), offsets, mode="sum"),
                               rtol=0, atol=0)
    grad_out = torch.randn(5, 4, generator=gen)
    out.backward(grad_out)
    grad = weight.grad
    assert grad is not None and grad.is_sparse
    ref = weight.detach().clone().requires_grad_()
    F.embedding_bag(ids, ref, offsets, mode="sum").backward(grad_out)
    assert ref.grad is not None
    torch.testing.assert_close(grad.to_dense(), ref.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(grad._indices()[0], torch.unique(ids)), "rows not sorted and distinct"


def _exchange_scenario(ctx: DistContext) -> None:
    rank, world = ctx.rank, ctx.world_size
    group = ctx.embedding_group
    cap = BlockCap()
    caps = []
    # step lengths: block (src -> dst) has LEN[step] * (src + 1) + dst elements
    for step, base in enumerate([5, 5, 4, 40, 3, 0]):
        header = torch.tensor([[rank, dst, step] for dst in range(world)])
        blocks = [torch.arange(base * (rank + 1) + dst) + 1000 * rank for dst in range(world)]
        got_header, data, lengths = exchange_blocks(header, blocks, cap, group)
        assert got_header == [[src, rank, step] for src in range(world)]
        expected = [torch.arange(base * (src + 1) + rank) + 1000 * src for src in range(world)]
        assert lengths == [e.numel() for e in expected]
        assert torch.equal(data, torch.cat(expected)), (step, data, expected)
        caps.append(cap.elements)
    every: list[list[int]] = [[] for _ in range(world)]
    dist.all_gather_object(every, caps)
    assert all(c == caps for c in every), every
    assert caps[0] >= 5 * world + world - 1 and caps[3] >= 40 * world + world - 1
    assert caps[5] < caps[3], "the cap shrinks once blocks stay small"


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_exchange_blocks_on_three_ranks() -> None:
    run_ranks("tests.worker.embedding.test_input_dist:_exchange_scenario", 3)
