"""Tables and their rows: what a table is, which rows a rank owns, where ids go, and the
deterministic, world-size independent row init (worker/embedding/sharded.py re-exports all of it).

Row init: the global table is generated in fixed chunks of INIT_CHUNK_ROWS rows, chunk c of
table t seeded by (seed, t, c), N(0, 1) * init_std like nn.Embedding; a rank generates only
the chunks overlapping its range, so every world size sees the same table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridps.cli import ConfigError
from hybridps.dynamic import DynamicSpec
from hybridps.state_alloc import STATE_OFFSETS, alloc_state
from worker.embedding.input_dist import owner_of, unique_inverse
from worker.embedding.sharding import RowWise, Scheme, TableCost, check_sharding, place_tables

INIT_CHUNK_ROWS = 65536


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: `num_rows` x `dim`, looked up by global row id.

    `dynamic` (docs/dynamic_ids.md): looked up by raw int64 ids instead, `num_rows` being
    its device capacity (slots), with these admission and eviction policies."""

    name: str
    num_rows: int
    dim: int
    dynamic: DynamicSpec | None = None
    # row_wise | table_wise | auto (worker/embedding/sharding.py); "": the run's --sharding
    sharding: str = ""
    lookups: int = 1  # ids per sample: the planner's lookup cost

    def __post_init__(self) -> None:
        """ConfigError (a ValueError) naming the bad value: the worker reports it as one
        line, also when a custom Task's tables() builds it."""
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(f"table name {self.name!r} must be a Python identifier")
        for field in ("num_rows", "dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ConfigError(f"table {self.name!r}: {field}={value!r} is not an int")
        if self.dynamic is not None and not isinstance(self.dynamic, DynamicSpec):
            raise ConfigError(f"table {self.name!r}: dynamic={self.dynamic!r} is not a "
                              "DynamicSpec")
        if self.num_rows < 1:
            if self.dynamic is not None:
                raise ConfigError(f"table {self.name!r}: dynamic capacity {self.num_rows} "
                                  "must be >= 1")
            raise ConfigError(f"table {self.name!r}: num_rows={self.num_rows} must be >= 1")
        if self.dim < 1:
            raise ConfigError(f"table {self.name!r}: dim={self.dim} must be >= 1")
        try:
            if self.sharding:
                check_sharding(self.sharding, f"table {self.name!r}: sharding")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if isinstance(self.lookups, bool) or not isinstance(self.lookups, int) \
                or self.lookups < 1:
            raise ConfigError(f"table {self.name!r}: lookups={self.lookups!r} must be an "
                              "int >= 1")


def place(tables: Sequence[TableConfig], world_size: int, default: str = RowWise.name
          ) -> dict[str, Scheme]:
    """Each table's scheme (worker/embedding/sharding.py place_tables): its own choice, or
    `default` (the run's --sharding) where it has none. Deterministic: every rank places
    the same tables the same way."""
    check_sharding(default, "sharding")
    return place_tables([TableCost(t.name, t.num_rows, t.dim, t.lookups, t.sharding or default)
                         for t in tables], world_size)


def table_row_range(table: TableConfig, rank: int, world_size: int,
                    scheme: Scheme | None = None) -> tuple[int, int]:
    """[start, end) of `table`'s rows that rank `rank` owns under `scheme` (None: row-wise)."""
    return (scheme or RowWise()).row_range(table.num_rows, rank, world_size)


def row_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the rows rank `rank` owns row-wise: [r*R//W, (r+1)*R//W)."""
    return RowWise().row_range(num_rows, rank, world_size)


@dataclass
class Routing:
    """Where the ids of one lookup go.

    unique_U: sorted distinct ids; inverse_N: ids_N == unique_U[inverse_N];
    send_counts: how many of unique_U each rank owns (unique_U is grouped by
    owner in rank order, so chunk r of unique_U goes to rank r).
    """

    unique_U: torch.Tensor
    inverse_N: torch.Tensor
    send_counts: list[int]


def route(ids_N: torch.Tensor, num_rows: int, world_size: int, table: str = "?",
          scheme: Scheme | None = None) -> Routing:
    """Stage 1: dedupe + bucketize by owner (under `scheme`; None: row-wise). ids_N: int64
    global row ids, any shape."""
    flat_N = ids_N.reshape(-1).to(torch.int64)
    unique_U, inverse_N = torch.unique(flat_N, sorted=True, return_inverse=True)
    if unique_U.numel():
        lo, hi = int(unique_U[0]), int(unique_U[-1])
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"table {table!r}: row id {bad} outside [0, {num_rows})")
    owner_U = (owner_of(unique_U, num_rows, world_size) if scheme is None
               else scheme.owner_of(unique_U, num_rows, world_size))
    send_counts = torch.bincount(owner_U, minlength=world_size).tolist()
    return Routing(unique_U, inverse_N, send_counts)


def _chunk_seed(seed: int, table_index: int, chunk: int) -> int:
    state = np.random.SeedSequence([seed, table_index, chunk]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def init_rows(num_rows: int, dim: int, start: int, end: int, *, seed: int, table_index: int,
              init_std: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [end-start, dim] (float32, CPU) of the global table, world-size independent;
    written into `out` when given (a table's part of a group's block: worker/embedding/groups.py).

    A large block is allocated like the server's state (hybridps.state_alloc.alloc_state: huge
    pages, 2 MiB-aligned): on a CPU rank these are the rows themselves, gathered and
    updated at random every step, and on 4 KiB pages a 25M x 16 table's gather +
    update of 4k rows took ~300 us instead of ~225 us (one thread, this 2-core VM)."""
    out_RD = (alloc_state(max(end - start, 0), dim, offset=STATE_OFFSETS["rows"], zero=False)
              if out is None else out)
    if end <= start:
        return out_RD
    for chunk in range(start // INIT_CHUNK_ROWS, (end - 1) // INIT_CHUNK_ROWS + 1):
        lo = chunk * INIT_CHUNK_ROWS
        hi = min(lo + INIT_CHUNK_ROWS, num_rows)
        gen = torch.Generator().manual_seed(_chunk_seed(seed, table_index, chunk))
        a, b = max(lo, start), min(hi, end)
        if (a, b) == (lo, hi):  # whole chunk: generate in place (no copy; 50M rows: -30%)
            torch.randn(hi - lo, dim, generator=gen, out=out_RD[a - start:b - start])
        else:
            chunk_CD = torch.randn(hi - lo, dim, generator=gen)
            out_RD[a - start:b - start] = chunk_CD[a - lo:b - lo]
        out_RD[a - start:b - start].mul_(init_std)  # while the chunk is in cache
    return out_RD


def coalesce_grads(grads: Sequence[tuple[torch.Tensor, torch.Tensor, int]]
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sparse row gradient (rows_N, values_ND, rows of its table) of tables of one
    width: (rows_U sorted distinct, values_UD summed per row).

    All of them in ONE sort (`unique_inverse`, the tables' rows side by side): on the CPU it
    is several times faster than torch's own coalesce, and one call for DLRM's 26 tables
    instead of 26 (docs/performance-log.md). Duplicates are summed in the order they came
    (index_add_). A lone gradient made coalesced (PoolAtOwner's: rows sorted and distinct;
    the flag does not survive autograd's accumulation) is taken as it is."""
    if len(grads) == 1:
        rows_N, values_ND, num_rows = grads[0]
        if bool((rows_N[1:] > rows_N[:-1]).all()):
            return [(rows_N, values_ND)]
        uniq_U, inverse_N = unique_inverse(rows_N, num_rows)
        summed_UD = values_ND.new_zeros((uniq_U.numel(), values_ND.shape[1]))
        return [(uniq_U, summed_UD.index_add_(0, inverse_N, values_ND))]
    sizes = [rows_N.numel() for rows_N, _, _ in grads]
    firsts = [0]
    for _, _, num_rows in grads:
        firsts.append(firsts[-1] + num_rows)
    device = grads[0][0].device
    first_T = torch.tensor(firsts[:-1], dtype=torch.int64, device=device)
    keys_N = torch.cat([rows_N for rows_N, _, _ in grads]) + torch.repeat_interleave(
        first_T, torch.tensor(sizes, device=device), output_size=sum(sizes))
    values_ND = torch.cat([values for _, values, _ in grads])
    uniq_U, inverse_N = unique_inverse(keys_N, firsts[-1])
    summed_UD = values_ND.new_zeros((uniq_U.numel(), values_ND.shape[1]))
    summed_UD.index_add_(0, inverse_N, values_ND)
    ends = [*torch.bucketize(first_T, uniq_U).tolist()[1:], uniq_U.numel()]  # per table
    out, lo = [], 0
    for first, hi in zip(firsts[:-1], ends, strict=True):
        out.append((uniq_U[lo:hi] - first, summed_UD[lo:hi]))
        lo = hi
    return out


def initial_blocks(table: TableConfig, start: int, end: int, held_RD: torch.Tensor, *,
                   seed: int, table_index: int, init_std: float, rank: int
                   ) -> Iterator[tuple[int, torch.Tensor]]:
    """(global start, fp32 rows on the CPU): rows [start, end) of `table` as initialised,
    in order, with `held_RD` the rows a rank holds for that range.

    They seed an fp32 master copy of bf16 rows. Regenerated one init chunk at a
    time (init_rows is deterministic), so no fp32 copy of the table is kept; each
    block is checked against the held rows, which must be it rounded to their dtype
    (else something changed the rows after init and the master would not be the
    rows' master).
    """
    lo = start
    while lo < end:
        hi = min((lo // INIT_CHUNK_ROWS + 1) * INIT_CHUNK_ROWS, end)
        rows_RD = init_rows(table.num_rows, table.dim, lo, hi, seed=seed,
                            table_index=table_index, init_std=init_std)
        block_RD = held_RD[lo - start:hi - start].to("cpu")
        if not torch.equal(rows_RD.to(held_RD.dtype), block_RD):
            raise RuntimeError(f"table {table.name!r} rank {rank}: rows [{lo}, {hi}) on the "
                               "device are not the initial rows rounded to "
                               f"{held_RD.dtype}; cannot seed the master copy from them")
        yield lo, rows_RD
        lo = hi
