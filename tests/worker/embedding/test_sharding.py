"""The sharding seam (worker/embedding/sharding.py): schemes' cuts, owner and local ids,
row-wise equal to the historical equal split, and the planner's placement."""

from __future__ import annotations

import pytest
import torch

from hybridps.cli import ConfigError
from worker.embedding.input_dist import owner_of
from worker.embedding.rows import TableConfig, row_range
from worker.embedding.sharding import (
    SCHEMES,
    RowWise,
    TableCost,
    TableWise,
    check_sharding,
    place_tables,
)


def _old_row_range(num_rows: int, rank: int, world: int) -> tuple[int, int]:
    return rank * num_rows // world, (rank + 1) * num_rows // world


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8, 13, 100, 1001])
def test_row_wise_is_the_equal_split(num_rows: int, world: int) -> None:
    scheme = RowWise()
    for rank in range(world):
        assert scheme.row_range(num_rows, rank, world) == _old_row_range(num_rows, rank, world)
        assert row_range(num_rows, rank, world) == _old_row_range(num_rows, rank, world)
    ids = torch.arange(num_rows)
    owner = scheme.owner_of(ids, num_rows, world)
    assert torch.equal(owner, owner_of(ids, num_rows, world))


@pytest.mark.parametrize("scheme", [RowWise(), TableWise(0), TableWise(2)])
@pytest.mark.parametrize("num_rows", [1, 3, 17])
def test_owner_and_local_round_trip(scheme, num_rows: int) -> None:
    world = 3
    cuts = scheme.cuts(num_rows, world)
    assert len(cuts) == world + 1 and cuts[0] == 0 and cuts[-1] == num_rows
    assert cuts == sorted(cuts)
    ids = torch.randint(0, num_rows, (50,))
    owner = scheme.owner_of(ids, num_rows, world)
    local = scheme.local_of(ids, owner, num_rows, world)
    for i, r, lo in zip(ids.tolist(), owner.tolist(), local.tolist(), strict=True):
        start, end = scheme.row_range(num_rows, r, world)
        assert start <= i < end and lo == i - start


def test_table_wise_puts_all_rows_on_its_owner() -> None:
    scheme = TableWise(1)
    assert [scheme.row_range(10, r, 3) for r in range(3)] == [(0, 0), (0, 10), (10, 10)]
    assert scheme.ranks(10, 3) == [1]
    assert torch.equal(scheme.owner_of(torch.arange(10), 10, 3), torch.ones(10, dtype=torch.int64))
    with pytest.raises(ValueError, match="owner 3"):
        TableWise(3).cuts(10, 3)


def test_registry_names() -> None:
    assert {"row_wise": RowWise, "table_wise": TableWise} == SCHEMES


def test_bad_sharding_value_is_named() -> None:
    with pytest.raises(ValueError, match="'colwise'"):
        check_sharding("colwise")
    with pytest.raises(ConfigError, match="'diagonal'"):
        TableConfig("t", 10, 4, sharding="diagonal")
    with pytest.raises(ConfigError, match="lookups"):
        TableConfig("t", 10, 4, lookups=0)
    assert TableConfig("t", 10, 4).sharding == ""  # the run's --sharding (row_wise default)
    assert TableConfig("t", 10, 4, sharding="table_wise").sharding == "table_wise"


def test_place_tables_small_whole_large_row_wise_balanced() -> None:
    tables = [TableCost("big", 1_000_000, 16)] + [
        TableCost(f"s{i}", 1000 * (i + 1), 16) for i in range(6)]
    plan = place_tables(tables, 2)
    assert plan["big"] == RowWise()
    owners = [plan[f"s{i}"] for i in range(6)]
    assert all(isinstance(s, TableWise) for s in owners)
    per_rank = [sum(t.num_rows for t in tables[1:] if plan[t.name] == TableWise(r))
                for r in range(2)]
    assert abs(per_rank[0] - per_rank[1]) <= 2000  # largest-first greedy: within one table
    assert place_tables(tables, 2) == plan  # deterministic
    assert all(s == RowWise() for s in place_tables(tables, 1).values())


def test_place_tables_respects_a_table_choice() -> None:
    tables = [TableCost("a", 10, 4, sharding="row_wise"),
              TableCost("b", 10**6, 4, sharding="table_wise"),
              TableCost("c", 10, 4)] + [TableCost(f"d{i}", 10**5, 4) for i in range(4)]
    plan = place_tables(tables, 2)  # 7 lookups: half a rank's share (1.75) holds one
    assert plan["a"] == RowWise()
    assert isinstance(plan["b"], TableWise)
    assert isinstance(plan["c"], TableWise)
    with pytest.raises(ValueError, match="'x'"):
        place_tables([TableCost("e", 10, 4, sharding="x")], 2)


def test_table_row_range_follows_the_scheme() -> None:
    from worker.embedding.rows import place, table_row_range
    assert table_row_range(TableConfig("t", 10, 4), 1, 2) == (5, 10)
    assert table_row_range(TableConfig("t", 10, 4), 0, 2, TableWise(1)) == (0, 0)
    assert table_row_range(TableConfig("t", 10, 4), 1, 2, TableWise(1)) == (0, 10)
    tables = [TableConfig("a", 10, 4), TableConfig("b", 10**6, 4, sharding="row_wise")]
    assert place(tables, 2) == {"a": RowWise(), "b": RowWise()}
    placed = place(tables, 2, "table_wise")  # the run's choice; b keeps its own
    assert isinstance(placed["a"], TableWise) and placed["b"] == RowWise()
    with pytest.raises(ValueError, match="'diagonal'"):
        place(tables, 2, "diagonal")


def test_owner_local_of_many_tables_is_each_schemes() -> None:
    from worker.embedding.input_dist import owner_local
    world = 3
    tables = [(17, RowWise()), (5, TableWise(2)), (1, RowWise()), (9, TableWise(0)),
              (40, RowWise())]
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, n, (int(s),), generator=gen)
           for (n, _), s in zip(tables, [30, 0, 4, 12, 50], strict=True)]
    owner, local = owner_local(torch.cat(ids), [i.numel() for i in ids],
                               [s.cuts(n, world) for n, s in tables], world)
    want_owner = torch.cat([s.owner_of(i, n, world) for (n, s), i in zip(tables, ids,
                                                                          strict=True)])
    want_local = torch.cat([s.local_of(i, s.owner_of(i, n, world), n, world)
                            for (n, s), i in zip(tables, ids, strict=True)])
    assert torch.equal(owner, want_owner) and torch.equal(local, want_local)
    one_owner, one_local = owner_local(ids[0], [30], [RowWise().cuts(17, world)], world)
    assert torch.equal(one_owner, owner_of(ids[0], 17, world))
    assert torch.equal(one_local, local[:30])
    # a scheme neither row-wise nor whole on a rank takes the search over every cut
    uneven = [0, 2, 2, 9]
    mixed = [s.cuts(n, world) for n, s in tables[:3]] + [uneven]
    some = torch.cat([*ids[:3], torch.tensor([0, 1, 2, 8, 5])])
    sizes = [*(i.numel() for i in ids[:3]), 5]
    owner, local = owner_local(some, sizes, mixed, world)
    assert torch.equal(owner[-5:], torch.tensor([0, 0, 2, 2, 2]))
    assert torch.equal(local[-5:], torch.tensor([0, 1, 0, 6, 3]))
    assert torch.equal(owner[:-5], want_owner[:34]) and torch.equal(local[:-5],
                                                                     want_local[:34])


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_pooled_requests_by_cuts_match_the_torch_path(kernel: str) -> None:
    """The native requester kernel routes by the cut points as make_requests' torch path
    does (row-wise by division, any scheme by its cuts)."""
    from hybridps import pooled_bags
    from worker.embedding.input_dist import make_requests
    if kernel == "native" and pooled_bags.set_pool_kernel("auto") != "native":
        pytest.skip("the pooled-bags kernel is not built")
    world = 3
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 50, (40,), generator=gen), torch.randint(0, 7, (25,), generator=gen)]
    offsets = [torch.tensor([0, 3, 3, 10, 39]), torch.tensor([0, 0, 12, 20])]
    rows = [50, 7]
    for schemes in ([RowWise(), RowWise()], [TableWise(2), RowWise()],
                    [RowWise(), TableWise(1)]):
        cuts = [s.cuts(n, world) for s, n in zip(schemes, rows, strict=True)]
        results = {}
        for path in (kernel, "torch"):
            pooled_bags.set_pool_kernel(path)
            try:
                results[path] = make_requests(ids, rows, torch.tensor(rows), [True, True],
                                              offsets, world, cuts)
            finally:
                pooled_bags.set_pool_kernel("auto")
        got, ref = results[kernel], results["torch"]
        assert torch.equal(got.header_WH, ref.header_WH)
        assert all(torch.equal(a, b) for a, b in zip(got.blocks, ref.blocks, strict=True))
        owned = [[s.row_range(n, r, world) for s, n in zip(schemes, rows, strict=True)]
                 for r in range(world)]
        for r in range(world):  # table 0's ids asked of an owner of none: none
            if owned[r][0][0] == owned[r][0][1]:
                assert int(got.header_WH[r, 1]) == 0


def test_describe_names_each_tables_scheme_and_ranks() -> None:
    from worker.embedding.sharded import ShardedEmbedding
    emb = ShardedEmbedding([TableConfig("a", 10, 4), TableConfig("b", 1, 4)], rank=0,
                           world_size=2, seed=0)
    assert emb.describe()["sharding"] == {"a": {"scheme": "row_wise", "ranks": [0, 1]},
                                          "b": {"scheme": "row_wise", "ranks": [1]}}


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool_at", ["owner", "requester"])
@pytest.mark.parametrize("sharding", ["table_wise", "auto"])
def test_two_process_table_wise_and_auto_match_nn_embedding(
        tmp_path, sharding: str, pool_at: str) -> None:
    """Routed through the scheme's cuts: each table's outputs and owned-row gradients
    equal plain nn.Embedding / nn.EmbeddingBag over the global batch, every table on the
    ranks its placement names (a rank owning none of a table). Grouped tables (a rank
    owning none of a group) run end to end: tests/worker/embedding/test_sharding_e2e.py."""
    import torch.multiprocessing as mp

    from tests.worker.embedding import test_embedding as te
    mp.spawn(te._spawned, args=(str(tmp_path / "store"), str(tmp_path), True, pool_at,
                                sharding), nprocs=te.WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(te.WORLD)]
    ref_outs, ref_grads = te.reference(te.global_case())
    for key, ref in ref_outs.items():
        got = torch.cat([res["outs"][key] for res in results])
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    te._check_grads([res["grads"] for res in results], [res["ranges"] for res in results],
                    ref_grads)
    placed = results[0]["sharding"]
    assert placed == results[1]["sharding"]
    schemes = {name: p["scheme"] for name, p in placed.items()}
    if sharding == "table_wise":
        assert set(schemes.values()) == {"table_wise"}
        assert {p["ranks"][0] for p in placed.values()} == {0, 1}  # balanced over both
    else:  # auto: the 37-row table is over half a rank's share of bytes, the rest go whole
        assert schemes == {"a": "row_wise", "b": "table_wise", "c": "table_wise",
                           "tiny": "table_wise"}
    for name, p in placed.items():
        for rank, res in enumerate(results):
            start, end = res["ranges"][name]
            assert (end > start) == (rank in p["ranks"]), (name, rank, p)
