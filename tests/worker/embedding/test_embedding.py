"""Sharded embedding: routing, init, and lookups/gradients against plain nn.Embedding.

The multi-process case spawns 2 real gloo processes (FileStore rendezvous);
each looks up its slice of one global batch, and the test compares outputs
and the coalesced, 1/W-scaled owned-row gradients with a single-process
nn.Embedding / nn.EmbeddingBag forward+backward of the global mean loss.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from worker.embedding import sharded as emb_mod
from worker.embedding.input_dist import owner_of
from worker.embedding.rows import TableConfig, init_rows, route, row_range
from worker.embedding.sharded import ShardedEmbedding
from worker.tasks.base import Batch

WORLD = 2
LOCAL_B = 6
TABLES = [TableConfig("a", 37, 4), TableConfig("b", 11, 3), TableConfig("c", 20, 2),
          TableConfig("tiny", 1, 2)]
SEED, STD = 3, 0.5


# -- routing and init -------------------------------------------------------------------

@pytest.mark.parametrize("num_rows", [1, 2, 7, 100, 65537])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_row_ranges_cover_table(num_rows: int, world: int) -> None:
    ranges = [row_range(num_rows, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_rows
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end == start
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1
    ids = torch.arange(num_rows)
    owners = owner_of(ids, num_rows, world)
    expected = torch.tensor([next(r for r, (s, e) in enumerate(ranges) if s <= i < e)
                             for i in range(num_rows)]) if num_rows < 1000 else None
    if expected is not None:
        assert torch.equal(owners, expected)
    for r, (s, e) in enumerate(ranges):
        assert bool((owners[s:e] == r).all())


@pytest.mark.parametrize("num_rows", [3, 1000, 10**9 + 7, (1 << 40) - 1])
@pytest.mark.parametrize("world", [2, 3, 8, 13])
def test_owner_by_division_is_the_range_search(num_rows: int, world: int) -> None:
    """owner_of's division equals a search of row_range's starts at the ends of every range
    and at random ids, with one table size per id (a fused multi-table lookup) too."""
    starts = torch.tensor([row_range(num_rows, r, world)[0] for r in range(world)])
    edges = torch.cat([starts, starts - 1, starts + 1]).clamp(0, num_rows - 1)
    ids = torch.cat([edges, torch.randint(0, num_rows, (5000,))])
    expected = torch.searchsorted(starts, ids, right=True) - 1
    assert torch.equal(owner_of(ids, num_rows, world), expected)
    per_id = torch.full_like(ids, num_rows)
    assert torch.equal(owner_of(ids, per_id, world), expected)


def test_route_dedupes_and_groups_by_owner() -> None:
    ids = torch.tensor([[9, 1, 9], [5, 1, 0]])
    routing = route(ids, num_rows=10, world_size=3)  # ranges [0,3) [3,6) [6,10)
    assert routing.unique_U.tolist() == [0, 1, 5, 9]
    assert torch.equal(routing.unique_U[routing.inverse_N], ids.reshape(-1))
    assert routing.send_counts == [2, 1, 1]


def test_route_rejects_out_of_range_ids() -> None:
    with pytest.raises(IndexError, match=r"table 'x': row id 10 outside \[0, 10\)"):
        route(torch.tensor([3, 10]), num_rows=10, world_size=2, table="x")
    with pytest.raises(IndexError, match="row id -1"):
        route(torch.tensor([-1]), num_rows=10, world_size=2, table="x")


def test_fused_lookup_names_the_table_and_id_out_of_range() -> None:
    """One range check covers all tables of a fused lookup; the error names the bad
    table and id (each table against its own size), and nothing is left staged."""
    emb = ShardedEmbedding([TableConfig("small", 5, 2), TableConfig("big", 100, 2)])
    ok = emb.lookup_many(["small", "big"], [torch.tensor([4]), torch.tensor([99, 5])])
    assert [tuple(r.shape) for r in ok] == [(1, 2), (2, 2)]
    with pytest.raises(IndexError, match=r"table 'small': row id 5 outside \[0, 5\)"):
        emb.lookup_many(["small", "big"], [torch.tensor([0, 5]), torch.tensor([99])])
    with pytest.raises(IndexError, match=r"table 'big': row id -2 outside \[0, 100\)"):
        emb.lookup_many(["small", "big"], [torch.tensor([1]), torch.tensor([7, -2])])
    assert emb.weights["small"].grad is None and emb.weights["big"].grad is None


def test_init_rows_is_world_size_independent() -> None:
    rows, dim = 70_000, 2  # spans two init chunks of 65536 rows
    full = init_rows(rows, dim, 0, rows, seed=5, table_index=1, init_std=0.1)
    for world in (2, 3):
        parts = [init_rows(rows, dim, *row_range(rows, r, world), seed=5, table_index=1,
                           init_std=0.1) for r in range(world)]
        assert torch.equal(torch.cat(parts), full)
    assert abs(float(full.std()) - 0.1) < 0.01
    other = init_rows(rows, dim, 0, 10, seed=5, table_index=2, init_std=0.1)
    assert not torch.equal(other, full[:10])


def test_batch_slice_rebases_bags() -> None:
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    offsets = torch.tensor([0, 2, 2, 5])  # bags [1,2] [] [3,4,5] [6]
    batch = Batch(4, ids={"u": torch.arange(4)}, bags={"t": (ids, offsets)})
    part = batch.slice(1, 3)
    assert part.size == 2 and part.ids["u"].tolist() == [1, 2]
    assert part.bags["t"][0].tolist() == [3, 4, 5] and part.bags["t"][1].tolist() == [0, 0]
    tail = batch.slice(3, 4)
    assert tail.bags["t"][0].tolist() == [6] and tail.bags["t"][1].tolist() == [0]


# -- the lookup case shared by the one-process and two-process tests -----------------------

def global_case() -> dict[str, torch.Tensor]:
    """One global batch of WORLD * LOCAL_B samples, with duplicates and an empty bag."""
    g = torch.Generator().manual_seed(11)
    n = WORLD * LOCAL_B
    a_ids = torch.randint(0, 37, (n, 3), generator=g)
    a_ids[:, 0] = 36  # a hot row, owned by the last rank, requested by every rank
    lengths = torch.randint(0, 4, (n,), generator=g)
    lengths[1] = 0
    b_ids = torch.randint(0, 11, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    c_ids = torch.randint(0, 10, (n,), generator=g)  # only rank 0's rows of c
    return {
        "a_ids": a_ids, "b_ids": b_ids, "b_offsets": offsets, "b_lengths": lengths,
        "c_ids": c_ids, "tiny_ids": torch.zeros(n, dtype=torch.int64),
        "g_a": torch.randn(n, 3, 4, generator=g), "g_sum": torch.randn(n, 3, generator=g),
        "g_mean": torch.randn(n, 3, generator=g), "g_c": torch.randn(n, 2, generator=g),
        "g_tiny": torch.randn(n, 2, generator=g),
    }


def local_slice(case: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    lo, hi = rank * LOCAL_B, (rank + 1) * LOCAL_B
    out = {k: v[lo:hi] for k, v in case.items() if k not in ("b_ids", "b_offsets")}
    start = int(case["b_offsets"][lo])
    stop = start + int(case["b_lengths"][lo:hi].sum())
    out["b_ids"] = case["b_ids"][start:stop]
    out["b_offsets"] = case["b_offsets"][lo:hi] - start
    return out


def sharded_forward(emb: ShardedEmbedding, part: dict[str, torch.Tensor], fused: bool = False
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean-over-local-samples loss and the raw lookup outputs.

    fused: the same lookups through lookup_many (one exchange per width: the two bags of
    b, pooled two ways, and the plain lookups of c and tiny)."""
    rows_a = emb.lookup("a", part["a_ids"])
    if fused:
        bag_sum, bag_mean = emb.lookup_many(
            ["b", "b"], [part["b_ids"], part["b_ids"]],
            bags=[(part["b_offsets"], "sum"), (part["b_offsets"], "mean")])
        rows_c, rows_tiny = emb.lookup_many(["c", "tiny"], [part["c_ids"], part["tiny_ids"]])
    else:
        bag_sum = emb.lookup_bag("b", part["b_ids"], part["b_offsets"], mode="sum")
        bag_mean = emb.lookup_bag("b", part["b_ids"], part["b_offsets"], mode="mean")
        rows_c = emb.lookup("c", part["c_ids"])
        rows_tiny = emb.lookup("tiny", part["tiny_ids"])
    per_sample = ((rows_a * part["g_a"]).sum((1, 2)) + (bag_sum * part["g_sum"]).sum(1)
                  + (bag_mean * part["g_mean"]).sum(1) + (rows_c * part["g_c"]).sum(1)
                  + (rows_tiny * part["g_tiny"]).sum(1))
    outs = {"a": rows_a, "sum": bag_sum, "mean": bag_mean, "c": rows_c, "tiny": rows_tiny}
    return per_sample.mean(), {k: v.detach() for k, v in outs.items()}


def reference(case: dict[str, torch.Tensor]
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain nn.Embedding / nn.EmbeddingBag over the global batch: outputs, dense grads."""
    weights = {t.name: init_rows(t.num_rows, t.dim, 0, t.num_rows, seed=SEED, table_index=i,
                                 init_std=STD) for i, t in enumerate(TABLES)}
    plain = {name: nn.Embedding.from_pretrained(w, freeze=False, sparse=True)
             for name, w in weights.items()}
    bag_sum = nn.EmbeddingBag(11, 3, mode="sum", sparse=True)
    bag_mean = nn.EmbeddingBag(11, 3, mode="mean", sparse=True)
    bag_sum.weight = bag_mean.weight = plain["b"].weight
    rows_a = plain["a"](case["a_ids"])
    s = bag_sum(case["b_ids"], case["b_offsets"])
    m = bag_mean(case["b_ids"], case["b_offsets"])
    rows_c = plain["c"](case["c_ids"])
    rows_tiny = plain["tiny"](case["tiny_ids"])
    per_sample = ((rows_a * case["g_a"]).sum((1, 2)) + (s * case["g_sum"]).sum(1)
                  + (m * case["g_mean"]).sum(1) + (rows_c * case["g_c"]).sum(1)
                  + (rows_tiny * case["g_tiny"]).sum(1))
    per_sample.mean().backward()  # the global mean loss
    grads = {}
    for name, mod in plain.items():
        grad = mod.weight.grad
        assert grad is not None and grad.is_sparse
        grads[name] = grad.coalesce().to_dense()
    outs = {"a": rows_a, "sum": s, "mean": m, "c": rows_c, "tiny": rows_tiny}
    return {k: v.detach() for k, v in outs.items()}, grads


def _spawned(rank: int, store: str, out_dir: str, fused: bool, pool_at: str = "auto",
             sharding: str = "row_wise", group_tables: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    try:
        group = dist.new_group()
        emb = ShardedEmbedding(TABLES, rank=rank, world_size=WORLD, group=group, seed=SEED,
                               init_std=STD, pool_at=pool_at, sharding=sharding,
                               group_tables=group_tables)
        loss, outs = sharded_forward(emb, local_slice(global_case(), rank), fused)
        loss.backward()
        grads = emb.pop_grads(scale=1.0 / WORLD)
        weights = {k: w.detach().clone() for k, w in emb.weights.items()}
        torch.save({"outs": outs, "grads": grads, "ranges": emb.ranges, "weights": weights,
                    "full": emb.gather_full(dst=0), "pooled": emb._pool_choice,
                    "caps": {k[1:]: c.elements for k, c in emb._caps.items()},
                    "sharding": emb.describe()["sharding"]},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    from worker.runtime.lifecycle import exit_process

    exit_process(0)  # as worker/main.py does: no teardown abort after a clean finish


def _check_grads(per_rank: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
                 ranges: list[dict[str, tuple[int, int]]],
                 ref_grads: dict[str, torch.Tensor]) -> None:
    for table in TABLES:
        got = torch.zeros(table.num_rows, table.dim)
        for rank, grads in enumerate(per_rank):
            ids_U, grads_UD = grads[table.name]
            start, end = ranges[rank][table.name]
            assert ids_U.dtype == torch.int64 and grads_UD.shape == (ids_U.numel(), table.dim)
            assert bool(((ids_U >= start) & (ids_U < end)).all()), "push outside owned rows"
            assert torch.equal(ids_U, torch.unique(ids_U)), "not coalesced (unique, sorted)"
            got[ids_U] = grads_UD
        torch.testing.assert_close(got, ref_grads[table.name], rtol=1e-5, atol=1e-7)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "lookup_many"])
def test_two_process_lookup_and_grads_match_nn_embedding(tmp_path: Path, fused: bool) -> None:
    mp.spawn(_spawned, args=(str(tmp_path / "store"), str(tmp_path), fused), nprocs=WORLD,
             join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    case = global_case()
    ref_outs, ref_grads = reference(case)
    for key, ref in ref_outs.items():
        got = torch.cat([res["outs"][key] for res in results])
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    _check_grads([res["grads"] for res in results], [res["ranges"] for res in results],
                 ref_grads)
    # rank 1 requested no row of c: an empty gradient (-> an empty push), not a missing one
    ids_c, grads_c = results[1]["grads"]["c"]
    assert ids_c.numel() == 0 and grads_c.shape == (0, 2)
    # rank 0 owns no row of the 1-row table
    assert results[0]["ranges"]["tiny"] == (0, 0)
    full = results[0]["full"]
    for i, t in enumerate(TABLES):
        expect = init_rows(t.num_rows, t.dim, 0, t.num_rows, seed=SEED, table_index=i,
                           init_std=STD)
        assert torch.equal(full[t.name], expect)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool_at", ["owner", "requester"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "lookup_many"])
def test_two_process_bags_either_way_match_nn_embedding_bag(tmp_path: Path, fused: bool,
                                                            pool_at: str) -> None:
    """The bags pooled at their owner (partial sums travel, the requester adds them and
    divides by the bag length) and pooled at the requester (rows travel) give the outputs
    and the owned-row gradients of nn.EmbeddingBag over the global batch; plain lookups in
    the same exchange are unchanged."""
    mp.spawn(_spawned, args=(str(tmp_path / "store"), str(tmp_path), fused, pool_at),
             nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    ref_outs, ref_grads = reference(global_case())
    for key, ref in ref_outs.items():
        got = torch.cat([res["outs"][key] for res in results])
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    _check_grads([res["grads"] for res in results], [res["ranges"] for res in results],
                 ref_grads)
    assert all(res["caps"] for res in results), "no exchange_blocks ran"
    assert results[0]["caps"] == results[1]["caps"], "the ranks disagree on the block size"
    pooled_at_owner = [any(pooled) for _, pooled in results[0]["caps"]]
    assert any(pooled_at_owner) == (pool_at == "owner"), results[0]["caps"]


def _pooling_choice(rank: int, store: str, out_dir: str) -> None:
    """auto: a bag of 40 ids over 5,000 rows is pooled at the owner, a bag of 2 ids stays
    rows; every rank decides the same from the summed sizes."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    try:
        tables = [TableConfig("long", 5000, 8), TableConfig("short", 5000, 8)]
        emb = ShardedEmbedding(tables, rank=rank, world_size=WORLD, group=dist.new_group())
        gen = torch.Generator().manual_seed(rank)
        long_ids = torch.randint(0, 5000, (64 * 40,), generator=gen)
        short_ids = torch.randint(0, 5000, (64 * 2,), generator=gen)
        offsets = [torch.arange(0, 64 * pool, pool) for pool in (40, 2)]
        outs = emb.lookup_many(["long", "short"], [long_ids, short_ids],
                               [(offsets[0], "mean"), (offsets[1], "sum")])
        full = {t.name: init_rows(t.num_rows, t.dim, 0, t.num_rows, seed=0, table_index=i,
                                  init_std=1.0) for i, t in enumerate(tables)}
        torch.testing.assert_close(outs[0], nn.functional.embedding_bag(
            long_ids, full["long"], offsets[0], mode="mean"), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(outs[1], nn.functional.embedding_bag(
            short_ids, full["short"], offsets[1], mode="sum"), rtol=1e-6, atol=1e-6)
        torch.save(dict(emb._pool_choice), Path(out_dir) / f"choice{rank}.pt")
    finally:
        dist.destroy_process_group()
    from worker.runtime.lifecycle import exit_process

    exit_process(0)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_auto_pools_long_bags_at_the_owner_and_short_ones_at_the_requester(
        tmp_path: Path) -> None:
    mp.spawn(_pooling_choice, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
             join=True)
    choices = [torch.load(tmp_path / f"choice{r}.pt") for r in range(WORLD)]
    assert choices[0] == choices[1] == {(("long", "short"), (True, True)): (True, False)}


def test_world_size_one_uses_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("world size 1 must not communicate")

    monkeypatch.setattr(dist, "all_to_all_single", forbidden)
    monkeypatch.setattr(emb_mod, "exchange", forbidden)
    monkeypatch.setattr(emb_mod, "all_to_all_rows", forbidden)
    assert not dist.is_initialized()
    emb = ShardedEmbedding(TABLES, seed=SEED, init_std=STD)  # no process group at all
    case = global_case()
    loss, outs = sharded_forward(emb, case)
    loss.backward()
    grads = emb.pop_grads(scale=1.0)
    ref_outs, ref_grads = reference(case)
    for key, ref in ref_outs.items():
        torch.testing.assert_close(outs[key], ref, rtol=1e-6, atol=1e-7)
    _check_grads([grads], [emb.ranges], ref_grads)
    assert all(w.grad is None for w in emb.weights.values()), "pop_grads clears the grads"


def test_apply_update_checks_owned_range() -> None:
    emb = ShardedEmbedding([TableConfig("a", 10, 2)], rank=1, world_size=2, init_std=0.0)
    emb.apply_update("a", torch.tensor([5, 7]), torch.ones(2, 2), 1.0)
    assert emb.weights["a"].detach()[[0, 2]].eq(1).all() and emb.weights["a"].sum() == 4
    emb.apply_update("a", torch.tensor([5]), torch.zeros(1, 2), 0.5)
    assert emb.weights["a"].detach()[0].tolist() == [0.5, 0.5]
    with pytest.raises(IndexError, match=r"outside the owned range \[5, 10\) of rank 1"):
        emb.apply_update("a", torch.tensor([4]), torch.ones(1, 2), 1.0)


def test_range_check_of_many_tables_names_the_table() -> None:
    """Past two tables the range check is one fused comparison: it still names the table
    and the id, whichever table holds it."""
    tables = [TableConfig(f"t{i}", 10 + i, 2) for i in range(5)]
    emb = ShardedEmbedding(tables)
    ids = [torch.tensor([9 + i]) for i in range(5)]
    assert len(emb.lookup_many([t.name for t in tables], ids)) == 5
    for bad, value in ((3, 13), (0, -1), (4, 14)):
        wrong = list(ids)
        wrong[bad] = torch.tensor([0, value])
        with pytest.raises(IndexError, match=rf"table 't{bad}': row id {value} outside"):
            emb.lookup_many([t.name for t in tables], wrong)


def test_pool_at_rejects_an_unknown_place() -> None:
    from worker.config.train_config import TrainConfig

    with pytest.raises(ValueError, match="pool_at='nowhere' is not one of auto, owner"):
        TrainConfig.of(local_optimizer=True, pool_at="nowhere")
    with pytest.raises(ValueError, match="pool_at='nowhere'"):
        ShardedEmbedding(TABLES, pool_at="nowhere")
