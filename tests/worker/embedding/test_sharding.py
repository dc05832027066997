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
    assert TableConfig("t", 10, 4).sharding == "row_wise"


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


def test_a_scheme_not_routed_yet_is_refused_by_name() -> None:
    from worker.embedding.rows import table_row_range
    assert table_row_range(TableConfig("t", 10, 4), 1, 2) == (5, 10)
    with pytest.raises(ConfigError, match="'table_wise'"):
        table_row_range(TableConfig("t", 10, 4, sharding="table_wise"), 0, 2)


def test_describe_names_each_tables_scheme_and_ranks() -> None:
    from worker.embedding.sharded import ShardedEmbedding
    emb = ShardedEmbedding([TableConfig("a", 10, 4), TableConfig("b", 1, 4)], rank=0,
                           world_size=2, seed=0)
    assert emb.describe()["sharding"] == {"a": {"scheme": "row_wise", "ranks": [0, 1]},
                                          "b": {"scheme": "row_wise", "ranks": [1]}}
