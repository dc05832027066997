"""The owner's fused pooled-bags kernel (hybridps/pooled_bags.py, PoolUnitAtOwner) against
the torch path it replaces (OwnerPool.build + gather + weight prediction + PoolAtOwner,
worker/embedding/input_dist.py and worker/embedding/sharded.py), bitwise: the bag sums, the
layout the backward uses, and the coalesced row gradients the push gets, on random bags (empty
bags, a row repeated in a bag and across bags, several tables of a unit, fp32 and bf16
rows, with and without the weight prediction); then ShardedEmbedding on 2 gloo ranks,
pooled at the owner, sum and mean, grouped tables, with a prediction: every lookup and
gradient the same with either kernel; and the worker (torchrun, 2 ranks, K=1 with the
prediction) dumps the same state with the torch path forced (HYBRIDPS_POOL_KERNEL=torch).
Bits are compared as integers (+0.0 is not -0.0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import worker.embedding.input_dist as input_dist
from hybridps import pooled_bags
from hybridps.pooled_bags import BagsAtOwner
from hybridps.row_deltas import add_offsets_
from tests.testing.spawn_helpers import run_ranks
from tests.worker.train.test_worker_e2e import MAIN, REPO, TORCHRUN
from worker.embedding.input_dist import OwnerPool, PoolAtOwner, PoolUnitAtOwner
from worker.embedding.rows import TableConfig, coalesce_grads
from worker.embedding.sharded import ShardedEmbedding
from worker.runtime.dist import DistContext
from worker.updates.staleness import RowPrediction

needs_native = pytest.mark.skipif(
    pooled_bags._ext is None, reason=f"pooled-bags kernel not built ({pooled_bags._load_error})")


@pytest.fixture
def kernel() -> Iterator[None]:
    before = pooled_bags.pool_kernel_name()
    yield
    pooled_bags.set_pool_kernel(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a.contiguous()), bits(b.contiguous())), f"{what} differs"


def make_entries(gen: torch.Generator, tables: list[tuple[int, int]], bags: int,
                 max_len: int, hot: int) -> list[BagsAtOwner]:
    """tables: (rows, offset in the block); bag lengths 0..max_len (some empty), ids drawn
    from `hot` rows half the time (repeats in a bag and across bags)."""
    entries = []
    for rows, offset in tables:
        lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
        if bags > 2:
            lengths[1] = 0
        num = int(lengths.sum())
        ids = torch.randint(0, rows, (num,), generator=gen)
        hot_ids = torch.randint(0, min(hot, rows), (num,), generator=gen)
        ids = torch.where(torch.rand(num, generator=gen) < 0.5, hot_ids, ids)
        entries.append(BagsAtOwner(ids, lengths, offset, rows))
    return entries


def make_prediction(gen: torch.Generator, block_rows: int, dim: int, share: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.nonzero(torch.rand(block_rows, generator=gen) < share).squeeze(1)
    return keys, torch.randn(keys.numel(), dim, generator=gen) * 1e-2


def torch_path(weight: torch.Tensor, entries: list[BagsAtOwner],
               prediction: tuple[torch.Tensor, torch.Tensor] | None
               ) -> tuple[torch.Tensor, list[OwnerPool]]:
    """What ShardedEmbedding.fetch does per entry without the fused kernel."""
    outs, pools = [], []
    for e in entries:
        pool = OwnerPool.build(e.ids_M, e.lengths_B, e.rows)
        rows_U = pool.uniq_U + e.offset if e.offset else pool.uniq_U
        with torch.no_grad():
            rows_UD = weight.index_select(0, rows_U).to(torch.float32)
            if prediction is not None and rows_U.numel():
                rows_UD = add_offsets_(rows_UD, rows_U.contiguous(), *prediction)
        outs.append(PoolAtOwner.apply(weight, rows_UD, pool, rows_U))
        pools.append(pool)
    return torch.cat(outs) if len(outs) > 1 else outs[0], pools


def pushed_grad(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row gradient as pop_grads hands it to the push (coalesced, fp32)."""
    grad = weight.grad
    assert grad is not None and grad.is_sparse
    [(ids_U, grads_UD)] = coalesce_grads([(grad._indices()[0], grad._values(),
                                           weight.shape[0])])
    return ids_U, grads_UD.to(torch.float32)


# name: (tables (rows, offset), bags, max bag length, hot rows, dim, rows past the tables)
# The sort's cases: tiny (insertion), one radix pass (small), two (one-table, unit-of-three,
# one-dim), a pass whose digit is the same for all (corner: ids low in a large block).
CASES = {
    "tiny": ([(30, 0)], 4, 3, 5, 4, 3),
    "small": ([(1500, 0)], 64, 5, 20, 8, 0),
    "one-table": ([(50_000, 0)], 512, 20, 200, 64, 0),
    "unit-of-three": ([(900, 0), (40, 900), (5000, 940)], 64, 6, 10, 7, 1),
    "long-bags": ([(3000, 0)], 8, 300, 30, 16, 0),
    "no-ids": ([(100, 0)], 5, 0, 1, 8, 0),
    "one-dim": ([(1 << 20, 0)], 300, 8, 50, 1, 0),
    "corner": ([(100, 0)], 64, 5, 20, 8, 1 << 20),
}


@needs_native
@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("predict", [0.0, 0.3], ids=["K0", "K1-predicted"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_owner_pool_is_bitwise_the_torch_path(case: str, predict: float,
                                                    row_dtype: torch.dtype) -> None:
    tables, bags, max_len, hot, dim, past = CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 1000 + int(predict * 10))
    block_rows = max(rows + offset for rows, offset in tables) + past
    entries = make_entries(gen, tables, bags, max_len, hot)
    prediction = make_prediction(gen, block_rows, dim, predict) if predict else None
    init = torch.randn(block_rows, dim, generator=gen).to(row_dtype)
    init[5] = -0.0  # a bag of -0.0 rows sums to +0.0 on both paths
    grad_out = torch.randn(bags * len(tables), dim, generator=gen)

    pooled_bags.set_pool_kernel("native")
    w_native = init.clone().requires_grad_()
    out_native = PoolUnitAtOwner.apply(w_native, entries, prediction)
    assert isinstance(out_native, torch.Tensor)
    out_native.backward(grad_out)

    pooled_bags.set_pool_kernel("torch")
    w_torch = init.clone().requires_grad_()
    out_torch, pools = torch_path(w_torch, entries, prediction)
    out_torch.backward(grad_out)

    assert_same_bits(out_native, out_torch, "bag sums")
    if len(entries) == 1:  # the native layout is OwnerPool's (block rows)
        pooled_bags.set_pool_kernel("native")
        _, layout = pooled_bags.forward(init, entries, prediction)
        assert torch.equal(layout.uniq_U, pools[0].uniq_U + entries[0].offset)
        assert torch.equal(layout.starts_U1[:-1], pools[0].row_starts_U)
        assert torch.equal(layout.bags_by_row_M, pools[0].bags_by_row_M)
    grad = w_native.grad
    assert grad is not None and grad.dtype == row_dtype
    rows_U = grad._indices()[0]
    assert bool((rows_U[1:] > rows_U[:-1]).all()), "rows not sorted and distinct"
    ids_n, grads_n = pushed_grad(w_native)
    ids_t, grads_t = pushed_grad(w_torch)
    assert torch.equal(ids_n, ids_t)
    assert_same_bits(grads_n, grads_t, "row gradients")


@needs_native
@pytest.mark.usefixtures("kernel")
def test_fused_pool_sums_in_bag_order_from_plus_zero() -> None:
    """Pins the order: 1e8 + 1 - 1e8 in float32 is 0 in this order, 1 in another."""
    pooled_bags.set_pool_kernel("native")
    weight = torch.tensor([[1e8], [1.0], [-1e8], [-0.0]])
    entry = BagsAtOwner(torch.tensor([0, 1, 2, 3, 3]), torch.tensor([3, 0, 2]), 0, 4)
    out, layout = pooled_bags.forward(weight, [entry])
    assert out[:, 0].tolist() == [0.0, 0.0, 0.0] and bits(out)[2, 0] == 0  # +0.0
    grad = pooled_bags.backward(layout, torch.tensor([[1e8], [7.0], [1.0]]))
    assert layout.uniq_U.tolist() == [0, 1, 2, 3]
    assert grad[:, 0].tolist() == [1e8, 1e8, 1e8, 2.0]


@needs_native
@pytest.mark.usefixtures("kernel")
def test_fused_pool_rejects_bad_ids_and_lengths_naming_them() -> None:
    pooled_bags.set_pool_kernel("native")
    weight = torch.zeros(10, 2)
    with pytest.raises(ValueError, match="row id 6 outside"):
        pooled_bags.forward(weight, [BagsAtOwner(torch.tensor([1, 6]), torch.tensor([2]), 4, 6)])
    with pytest.raises(ValueError, match="sum to 3, not its 2"):
        pooled_bags.forward(weight, [BagsAtOwner(torch.tensor([1, 2]), torch.tensor([3]), 0, 6)])
    with pytest.raises(ValueError, match="length -1"):
        pooled_bags.forward(weight, [BagsAtOwner(torch.tensor([1]), torch.tensor([2, -1]), 0, 6)])
    with pytest.raises(ValueError, match="outside the block"):
        pooled_bags.forward(weight, [BagsAtOwner(torch.tensor([1]), torch.tensor([1]), 6, 6)])


@pytest.mark.usefixtures("kernel")
def test_torch_choice_never_calls_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pooled_bags.set_pool_kernel("torch") == "torch"
    if pooled_bags._ext is not None:
        def boom(*args: object) -> None:
            raise AssertionError("pooled-bags kernel called with the torch path chosen")

        monkeypatch.setattr(pooled_bags._ext, "forward", boom)
        monkeypatch.setattr(pooled_bags._ext, "backward", boom)
        monkeypatch.setattr(pooled_bags._ext, "requests", boom)
    assert not pooled_bags.fused_for(torch.zeros(3, 2))
    assert pooled_bags.requests(torch.arange(3), torch.tensor([0]), 10, 2) is None
    with pytest.raises(ValueError, match="must be one of"):
        pooled_bags.set_pool_kernel("fastest")


@needs_native
@pytest.mark.parametrize("world", [1, 2, 3])
def test_native_requests_are_the_torch_paths(kernel: None, world: int) -> None:
    """make_requests (the requester's stage 1) with the pooled entries' requests made
    natively or by the torch path: the same header, blocks and inverses, for mixes of
    plain and pooled entries (empty bags, an entry with no bags, tables of several
    sizes)."""
    gen = torch.Generator().manual_seed(world)
    for trial in range(40):
        num = int(torch.randint(1, 5, (1,), generator=gen))
        rows_E = [int(torch.randint(world, 5000, (1,), generator=gen)) for _ in range(num)]
        pooled = [bool(torch.randint(0, 2, (1,), generator=gen)) for _ in range(num)]
        flat, offsets = [], []
        for rows, pool in zip(rows_E, pooled, strict=True):
            bags = 0 if trial % 7 == 0 and pool else int(torch.randint(1, 30, (1,), generator=gen))
            lengths = torch.randint(0, 6, (bags,), generator=gen)
            flat.append(torch.randint(0, rows, (int(lengths.sum()),), generator=gen))
            offsets.append(torch.cumsum(lengths, 0) - lengths if pool else None)
        args = (flat, rows_E, torch.tensor(rows_E), pooled, offsets, world)
        pooled_bags.set_pool_kernel("native")
        got = input_dist.make_requests(*args)
        pooled_bags.set_pool_kernel("torch")
        want = input_dist.make_requests(*args)
        assert torch.equal(got.header_WH, want.header_WH)
        assert len(got.blocks) == len(want.blocks) == world
        assert all(torch.equal(a, b) for a, b in zip(got.blocks, want.blocks, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got.inverse, want.inverse, strict=True))
        assert (got.rows_from, got.asked, got.pooled_bags) == (
            want.rows_from, want.asked, want.pooled_bags)


@needs_native
def test_native_requests_name_an_id_outside_the_table(kernel: None) -> None:
    pooled_bags.set_pool_kernel("native")
    ids = torch.tensor([3, 9, 10, 1])
    with pytest.raises(ValueError, match="id 10 at position 2 is outside the table's rows"):
        pooled_bags.requests(ids, torch.tensor([0, 2]), 10, 2)
    assert pooled_bags.requests(ids, torch.tensor([0, 5]), 10, 2) is None  # offset past n


def _kernel_in_subprocess(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in (pooled_bags.KERNEL_ENV, pooled_bags.FALLBACK_ENV)}
    proc = subprocess.run([sys.executable, "-c", "from hybridps import pooled_bags; "
                           "print(pooled_bags.pool_kernel_name())"],
                          env={**clean, **env}, capture_output=True, text=True, timeout=120,
                          check=True)
    return proc.stdout.strip()


@needs_native
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_env_picks_the_kernel_and_follows_hybridps_kernel() -> None:
    assert _kernel_in_subprocess({}) == "native"
    assert _kernel_in_subprocess({"HYBRIDPS_KERNEL": "torch"}) == "torch"
    assert _kernel_in_subprocess({"HYBRIDPS_KERNEL": "torch",
                                  "HYBRIDPS_POOL_KERNEL": "native"}) == "native"
    assert _kernel_in_subprocess({"HYBRIDPS_POOL_KERNEL": "torch"}) == "torch"


# -- ShardedEmbedding on 2 ranks: the same lookups and gradients with either kernel --------

TABLES = [TableConfig("a", 700, 8), TableConfig("b", 90, 8), TableConfig("c", 400, 8)]


LOOKUPS = [  # per step: (table, pooling or None: plain rows, ids a bag)
    [("a", "mean", 5), ("b", "sum", 3), ("c", "mean", 9)],  # one native call (a unit)
    [("b", None, 3), ("a", "mean", 5), ("c", "sum", 9), ("b", "mean", 1)],  # + rows of b
    [("a", "mean", 5), ("b", "sum", 3), ("c", "mean", 9), ("a", "sum", 2)],  # a twice: 4 calls
]
NATIVE_CALLS = 1 + 1 + 4


def _lookups(emb: ShardedEmbedding, rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    names, ids, bags = [], [], []
    for name, mode, per_bag in LOOKUPS[step]:
        num_rows = emb.tables[name].num_rows
        lengths = torch.randint(0, per_bag + 1, (16,), generator=gen)
        lengths[3] = 0
        flat = torch.randint(0, num_rows, (int(lengths.sum()),), generator=gen)
        flat[:4] = torch.randint(0, 5, (4,), generator=gen)  # repeats, across ranks too
        names.append(name)
        ids.append(flat)
        bags.append(None if mode is None else (torch.cumsum(lengths, 0) - lengths, mode))
    return emb.lookup_many(names, ids, bags)


def _step(emb: ShardedEmbedding, rank: int, step: int
          ) -> tuple[list[torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    outs = _lookups(emb, rank, step)
    gen = torch.Generator().manual_seed(7 + step)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    return [o.detach() for o in outs], emb.pop_grads()


def _two_ranks_scenario(ctx: DistContext, row_dtype_name: str) -> None:
    row_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[row_dtype_name]
    emb = ShardedEmbedding(TABLES, rank=ctx.rank, world_size=ctx.world_size,
                           group=ctx.embedding_group, seed=3, pool_at="owner",
                           group_tables=True, row_dtype=row_dtype)
    [unit] = emb.units
    calls = {"fused": 0}
    real_apply = PoolUnitAtOwner.apply

    def counted(*args: object) -> object:
        calls["fused"] += 1
        return real_apply(*args)

    input_dist.PoolUnitAtOwner.apply = counted  # type: ignore[method-assign]
    try:
        results = {}
        for kernel in ("native", "torch"):
            pooled_bags.set_pool_kernel(kernel)
            calls["fused"] = 0
            got = [_step(emb, ctx.rank, 0)]  # K=0: no prediction
            prediction = RowPrediction()  # as worker/updates/staleness.py sets it at K >= 1
            gen = torch.Generator().manual_seed(ctx.rank)
            rows = emb.weights[unit].shape[0]
            keys = torch.nonzero(torch.rand(rows, generator=gen) < 0.4).squeeze(1)
            prediction.tables = {unit: (keys, torch.randn(keys.numel(), 8, generator=gen))}
            emb.offset_rows(prediction)
            got += [_step(emb, ctx.rank, 1), _step(emb, ctx.rank, 2)]
            emb.offset_rows(None)
            results[kernel] = got
            assert calls["fused"] == (NATIVE_CALLS if kernel == "native" else 0), calls
    finally:
        input_dist.PoolUnitAtOwner.apply = real_apply  # type: ignore[method-assign]
        pooled_bags.set_pool_kernel("auto")
    for (outs_n, grads_n), (outs_t, grads_t) in zip(results["native"], results["torch"],
                                                    strict=True):
        for o_n, o_t in zip(outs_n, outs_t, strict=True):
            assert_same_bits(o_n, o_t, f"rank {ctx.rank} lookup")
        assert grads_n.keys() == grads_t.keys()
        for name in grads_n:
            assert torch.equal(grads_n[name][0], grads_t[name][0])
            assert_same_bits(grads_n[name][1], grads_t[name][1], f"rank {ctx.rank} {name} grad")


@needs_native
@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("row_dtype", ["fp32", "bf16"])
def test_two_ranks_pooled_at_owner_same_with_either_kernel(row_dtype: str) -> None:
    run_ranks("tests.hybridps.test_pooled_bags:_two_ranks_scenario", 2, row_dtype)


# -- end to end: the worker with either kernel dumps the same state -----------------------

E2E_JOB = ["--task", "tables", "--tables", "a:3000:4,b:500:3,c:100", "--num-rows", "3000",
           "--pool-at", "owner", "--local-optimizer", "true", "--staleness", "1",
           "--batch-size", "32", "--steps", "12", "--dim", "8",
           "--log-every", "1", "--eval-batches", "1", "--progress", "false"]


def _run_worker_with(kernel: str, out: Path, extra: list[str]) -> dict[str, Any]:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYBRIDPS_POOL_KERNEL=kernel)
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", MAIN, *E2E_JOB,
                           *extra, "--dump-state", str(out / "state.pt"), "--results",
                           str(out / "r.json")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240, check=False)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads((out / "r.json").read_text())
    return result


@needs_native
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("row_dtype", ["fp32", "bf16"])
def test_worker_dumps_the_same_state_with_either_kernel(tmp_path: Path, row_dtype: str) -> None:
    """K=1 with the weight prediction, a group of three tables (two pooled at the owner,
    one plain): the torch path forced gives the native run's rows, dense state and losses
    bit for bit."""
    runs = {}
    for kernel in ("native", "torch"):
        res = _run_worker_with(kernel, tmp_path / kernel, ["--row-dtype", row_dtype])
        runs[kernel] = (res, torch.load(tmp_path / kernel / "state.pt"))
    (native_res, native_state), (torch_res, torch_state) = runs["native"], runs["torch"]
    assert native_res["embedding"]["pooled_at_owner"] == ["a", "b"]
    assert native_res["table_groups"] == {"group-d8": ["a", "b", "c"]}
    assert native_res["staleness"]["compensation"]["predicted_rows_mean"] > 0
    assert native_res["owner_pool"]["kernel"] == "native"
    assert native_res["owner_pool"]["native_calls"] > 0
    assert torch_res["owner_pool"] == {"kernel": "torch", "native_calls": 0}
    assert native_res["loss_curve"] == torch_res["loss_curve"]
    assert native_res["eval"] == torch_res["eval"]
    for part in ("tables", "dense"):
        assert native_state[part].keys() == torch_state[part].keys()
        for key, value in native_state[part].items():
            assert_same_bits(value, torch_state[part][key], f"{part} {key}")
