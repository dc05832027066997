"""--local-memory-budget-mb and a dynamic table (worker/updates/local_spill.py `plan_paged`):
the rows paged out of its slots are bounded by the budget, their payload spills within
--local-spill-max-gb, and rows are dropped only beyond memory and disk; short of drops a
bounded run is bitwise the unbounded one (fused and reference steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hybridps.dynamic import DynamicSpec
from hybridps.optim import OptimizerSpec
from hybridps.paged_rows import quota_rows
from hybridps.paged_spill import payload_columns, payload_page_rows
from hybridps.spilled_rows import HeldRows, SpilledRows, spilled_bytes
from tests.worker.embedding.dynamic.test_dynamic_train import SEED, Run
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.local_spill import LocalBudget, PagedBound, plan_frames, plan_paged
from worker.updates.source import LocalSparseOptimizer, StalenessWindow
from worker.updates.staleness import RowPredictor

SLOTS = 64
# wide rows: an entry's row and state (4 * 3 * DIM bytes) are most of what it costs, so
# spilling them holds several times the rows in the same memory
DIM = 32
IDS = 3000  # distinct raw ids drawn (skewed), far more than the slots
STEPS = 40
PER_STEP = 64
DISK = 64 << 20


def _data(steps: int = STEPS, seed: int = 5) -> list[torch.Tensor]:
    """`PER_STEP` distinct raw ids a step (Zipf-ish over IDS ids, spread over int64), and
    some repeated."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-2**62, 2**62, IDS)
    weights = 1.0 / np.arange(1, IDS + 1) ** 0.7
    out = []
    for _ in range(steps):
        ids = pool[rng.choice(IDS, size=PER_STEP, replace=False, p=weights / weights.sum())]
        out.append(torch.from_numpy(np.concatenate([ids, ids[:PER_STEP // 4]])))
    return out


class _BoundedRun(Run):
    """tests/worker/embedding/dynamic/test_dynamic_train.py's loop, one LRU dynamic table of
    SLOTS slots, its source bounded by `budget`."""

    def __init__(self, budget: LocalBudget | None, fused: bool, staleness: int = 2) -> None:
        table = TableConfig("user", SLOTS, DIM, DynamicSpec(eviction="lru"))
        self.emb = ShardedEmbedding([table], seed=SEED, init_std=0.5)
        self.name = table.name
        self.source = LocalSparseOptimizer(self.emb, OptimizerSpec(lr=0.05), budget=budget)
        self.emb.set_pager(self.source)
        self.dynamic.fused = fused
        self.window = StalenessWindow(self.source, self.emb, staleness,
                                      RowPredictor(self.emb, staleness))
        self.w = torch.linspace(-1.0, 1.0, DIM)
        self.peak_paged = 0
        self.peak_memory = 0

    def after_lookup(self, step: int, data: list[torch.Tensor], ids_of: object) -> None:
        store = self.source.paged[self.name]
        self.peak_paged = max(self.peak_paged, len(store))
        self.peak_memory = max(self.peak_memory, store.held_bytes)

    @property
    def store_stats(self) -> dict[str, int]:
        """The source's report, as of the last push (after the last page call)."""
        return self.source.stats.local_memory


def _free_peak() -> int:
    run = _BoundedRun(None, fused=False)
    run.train(_data())
    return run.peak_paged


def _memory_for(rows: int) -> int:
    """A budget whose paged share keeps `rows` rows in memory alone (quota_rows)."""
    store = _BoundedRun(None, fused=False).source.paged["user"]
    columns = SLOTS * 2 * DIM * 4  # adam's m and v of the slots: within half the budget
    lo, hi = 0, 1 << 30
    while lo < hi:  # the least quota whose rows reach `rows`
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if quota_rows(mid, store.row_bytes, SLOTS) >= rows else (
            mid + 1, hi)
    return lo + columns


def _assert_same(a: _BoundedRun, b: _BoundedRun) -> None:
    assert torch.equal(a.emb.weights["user"].data, b.emb.weights["user"].data)
    sa = a.source.columns["user"].read(0, SLOTS)
    sb = b.source.columns["user"].read(0, SLOTS)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    x, y = a.source.paged["user"].entries(), b.source.paged["user"].entries()
    assert x.count > 0 and torch.equal(x.ids, y.ids) and torch.equal(x.rows, y.rows)
    assert torch.equal(x.seen, y.seen) and torch.equal(x.freq, y.freq)
    for name in x.state:
        assert torch.equal(x.state[name], y.state[name]), name


def test_the_paged_rows_get_what_the_columns_leave_of_the_budget(tmp_path: Path) -> None:
    """With a dynamic table the columns spill beyond half the budget; the paged rows get
    the rest, split by the columns' bytes in memory; their payload spills only within
    --local-spill-max-gb."""
    layout = [("m", DIM), ("v", DIM)]
    units = [("user", 4096, layout), ("s", 12288, layout)]
    state = (4096 + 12288) * 2 * DIM * 4  # 4 MiB
    budget = LocalBudget(state, str(tmp_path), 0)
    assert plan_frames(units, budget, "rank 0") == {"user": 0, "s": 0}  # fits the budget
    frames = plan_frames(units, budget, "rank 0", dynamic=True)  # but not half of it
    assert frames["user"] > 0 and frames["s"] > 0
    with pytest.raises(ValueError, match=r"take 4\.0 MiB, more than half of "
                       r"--local-memory-budget-mb 4 \(the other half is the dynamic "
                       r"tables' paged rows'\); give --local-spill-dir"):
        plan_frames(units, LocalBudget(state), "rank 0", dynamic=True)
    store = _BoundedRun(None, fused=False).source.paged["user"]
    bounds = plan_paged([("user", store, SLOTS, 300), ("ad", store, SLOTS, 100)],
                        LocalBudget(5000, str(tmp_path), 0), 1000, 0, "rank 0")
    assert bounds == {"user": PagedBound(3000, 0, 3000, 0), "ad": PagedBound(1000, 0, 1000, 0)}
    assert plan_paged([("user", store, SLOTS, 0)], LocalBudget(), 0, 0, "rank 0") == {
        "user": PagedBound()}
    with pytest.raises(ValueError, match=r"hold 0\.0 MiB of --local-memory-budget-mb 0: "
                       "nothing is left for its dynamic tables' paged rows"):
        plan_paged([("user", store, SLOTS, 0)], LocalBudget(5000), 5000, 0, "rank 0")
    spilled = plan_paged([("user", store, SLOTS, 300), ("ad", store, SLOTS, 100)],
                         LocalBudget(1 << 20, str(tmp_path), 8 << 20), 0, 2 << 20, "rank 0")
    for name, bound in spilled.items():  # the disk the static files leave, split 3:1
        assert bound.frames > 0 and bound.quota > bound.memory
        assert bound.disk == (6 << 20) * (3 if name == "user" else 1) // 4


@pytest.mark.parametrize("fused", [True, False])
def test_a_spilled_paged_store_is_bitwise_the_unbounded_one(tmp_path: Path,
                                                            fused: bool) -> None:
    """A budget whose memory keeps a third of the paged rows' payload: the rest spills to
    disk, nothing is dropped, and the run is the unbounded one bitwise on either step (a
    bounded store takes the reference step)."""
    peak = _free_peak()
    assert peak > 400
    free = _BoundedRun(None, fused)
    budget = LocalBudget(_memory_for(peak // 2), str(tmp_path / "spill"), DISK)
    bounded = _BoundedRun(budget, fused)
    assert isinstance(bounded.source.columns["user"], HeldRows)  # they fit half the budget
    assert bounded.source.local_store("user") is None
    payload = bounded.source.paged_payloads["user"]
    assert isinstance(payload, SpilledRows) and payload.max_disk_bytes <= DISK
    data = _data()
    free.train(data)
    bounded.train(data)
    assert bounded.peak_paged == peak
    slots = bounded.dynamic.tables["user"].slots.stats
    assert slots.page_ins > 100 and slots.dropped_paged == 0
    stats = bounded.store_stats
    assert stats["paged_dropped"] == 0 and stats["paged_rows"] == len(
        bounded.source.paged["user"])
    assert stats["paged_spills"] > 0 and stats["paged_fills"] > 0
    assert stats["paged_disk_bytes"] > 0
    _assert_same(free, bounded)
    # what the store holds in memory stays within its share of the budget (plus the
    # pools' slack of one call's rows: hybridps/paged_rows.py `held_overhead_bytes`)
    store = bounded.source.paged["user"]
    bound = bounded.source.paged_bounds["user"]
    assert bounded.peak_memory <= bound.memory + store.held_overhead_bytes
    bounded.source.close()
    assert not any((tmp_path / "spill").iterdir())


def test_rows_are_dropped_only_beyond_memory_and_disk(tmp_path: Path) -> None:
    """The budget of the test above, without --local-spill-max-gb: its memory alone holds
    half the rows, so the oldest are dropped (counted); with the disk none are; with too
    little disk some are, fewer than without."""
    peak = _free_peak()
    memory = _memory_for(peak // 2)
    layout = [("m", DIM), ("v", DIM)]
    short = spilled_bytes(payload_columns(DIM, layout), 3 * peak // 4 + SLOTS,
                          payload_page_rows(DIM, layout, LocalBudget().page_bytes))
    dropped = {}
    for disk in (0, DISK, short):  # a disk that holds 3/4 of the rows
        run = _BoundedRun(LocalBudget(memory, str(tmp_path / f"spill{disk}"), disk),
                          fused=False)
        run.train(_data())
        slots = run.dynamic.tables["user"].slots.stats
        stats = run.store_stats
        assert stats["paged_dropped"] == slots.dropped_paged
        store = run.source.paged["user"]
        bound = run.source.paged_bounds["user"]
        assert bound.memory + SLOTS * 2 * DIM * 4 == memory
        assert store.nbytes <= bound.quota  # the drops keep the store within its quota
        assert run.peak_memory <= bound.memory + store.held_overhead_bytes
        dropped[disk] = slots.dropped_paged
        run.source.close()
    assert dropped[0] > 0 and dropped[DISK] == 0 and 0 < dropped[short] < dropped[0]


def test_the_fused_step_runs_while_no_budget_bounds_the_store() -> None:
    run = _BoundedRun(None, fused=True)
    assert run.source.local_store("user") is not None
    assert run.source.paged_bounds["user"] == PagedBound()
