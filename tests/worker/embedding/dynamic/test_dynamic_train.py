"""Dynamic tables trained in one process (--local-optimizer's kernels, the staleness window,
the weight prediction): equal to a static table, paging bitwise, and the pin rule at K=2.

The loop is the training loop's (worker/train/trainer.py) written small: before_step, lookup,
backward, pop_grads, push, pushed; drain at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from hybridps.dynamic import DynamicSpec, initial_rows
from hybridps.optim import OptimizerSpec
from worker.embedding.dynamic.ids import DynamicIds, Expiry
from worker.embedding.dynamic.slots import NATIVE
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.source import LocalSparseOptimizer, StalenessWindow
from worker.updates.staleness import RowPredictor

DIM = 4
SEED = 3
POOL = np.concatenate([np.array([-7, 0, 2**63 - 1, -(2**63)], dtype=np.int64),
                       np.random.default_rng(0).integers(-2**62, 2**62, 56)])


def batches(steps: int, per_step: int, seed: int = 1) -> list[torch.Tensor]:
    """Skewed draws from POOL (60 raw ids), `per_step` distinct ids a step."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, POOL.size + 1)
    out = []
    for _ in range(steps):
        pick = rng.choice(POOL.size, size=per_step, replace=False, p=weights / weights.sum())
        ids = POOL[pick]
        out.append(torch.from_numpy(np.concatenate([ids, ids[: per_step // 2]])))  # repeats
    return out


class Run:
    """One table, trained on `ids` with a fixed linear target."""

    def __init__(self, table: TableConfig, staleness: int, kind: str = "adam") -> None:
        self.emb = ShardedEmbedding([table], seed=SEED, init_std=0.5)
        self.name = table.name
        self.source = LocalSparseOptimizer(self.emb, OptimizerSpec(kind=kind, lr=0.05))
        self.emb.set_pager(self.source)
        predictor = RowPredictor(self.emb, staleness) if staleness else None
        self.window = StalenessWindow(self.source, self.emb, staleness, predictor)
        self.w = torch.linspace(-1.0, 1.0, DIM)

    def train(self, data: list[torch.Tensor],
              ids_of: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> None:
        self.train_steps(data, range(len(data)), ids_of)
        self.window.drain(len(data) - 1)

    def train_steps(self, data: list[torch.Tensor], steps: range,
                    ids_of: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> None:
        """Steps `steps` of `data` (no drain: the caller's next steps follow)."""
        for step in steps:
            ids = data[step]
            self.window.before_step(step)
            rows = self.emb.lookup(self.name, ids_of(ids))
            self.after_lookup(step, data, ids_of)
            target = torch.sin(ids.double()).float()
            loss = ((rows @ self.w - target) ** 2).mean()
            loss.backward()
            grads = self.emb.pop_grads()
            self.source.push(step, grads)
            self.window.pushed(step, grads)

    def after_lookup(self, step: int, data: list[torch.Tensor],
                     ids_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Between a step's lookup and its backward
        (tests/worker/embedding/dynamic/test_dynamic_prefetch.py)."""

    @property
    def dynamic(self) -> DynamicIds:
        assert self.emb.dynamic is not None
        return self.emb.dynamic

    def by_id(self) -> dict[int, tuple[torch.Tensor, ...]]:
        """Every live id's (row, then its optimizer state by name: Adam's m, v), on a slot
        or paged out."""
        slots = self.dynamic.tables[self.name].slots
        state = self.source.state[self.name]
        names = sorted(state)
        weight = self.emb.weights[self.name].data
        out = {}
        used = np.flatnonzero(slots.seen >= 0)
        for s in used.tolist():
            out[int(slots.slot_id[s])] = (weight[s].clone(),
                                          *(state[n][s].clone() for n in names))
        stored = self.source.paged[self.name].entries()
        assert sorted(stored.state) == names
        for i, ident in enumerate(stored.ids.tolist()):
            assert ident not in out
            out[ident] = (stored.rows[i], *(stored.state[n][i] for n in names))
        return out


def dynamic_table(capacity: int, **spec: object) -> TableConfig:
    return TableConfig("user", capacity, DIM, DynamicSpec(**spec))  # type: ignore[arg-type]


@pytest.mark.parametrize("staleness", [0, 2])
def test_with_room_for_every_id_it_trains_like_a_static_table(staleness: int) -> None:
    """Capacity >= distinct ids: slot k is the k-th id first touched, and the dynamic table
    trains bitwise like a static table fed those k (started from the same rows)."""
    data = batches(25, 8)
    dyn = Run(dynamic_table(64), staleness)
    dyn.train(data)
    order: dict[int, int] = {}
    for ids in data:
        for i in ids.tolist():
            order.setdefault(i, len(order))
    static = Run(TableConfig("user", 64, DIM), staleness)
    first = torch.tensor(list(order), dtype=torch.int64)
    with torch.no_grad():
        static.emb.weights["user"].data.zero_()
        static.emb.weights["user"].data[:first.numel()] = initial_rows(
            first, DIM, seed=SEED, table_index=0, init_std=0.5)
    static.train(data, lambda ids: torch.tensor([order[i] for i in ids.tolist()]))
    n = len(order)
    assert torch.equal(dyn.emb.weights["user"].data[:n], static.emb.weights["user"].data[:n])
    for got, want in zip(dyn.source.moments["user"], static.source.moments["user"],
                         strict=True):
        assert got is not None and want is not None
        assert torch.equal(got[:n], want[:n])
    slots = dyn.dynamic.tables["user"].slots
    assert slots.slot_id[:n].tolist() == list(order)
    assert slots.stats.evictions == 0


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("staleness", "eviction"), [(0, "lru"), (2, "lru"), (2, "lfu")])
def test_eviction_and_page_in_are_bitwise(staleness: int, eviction: str, fused: bool) -> None:
    """24 slots for 60 ids: rows and their Adam state go to the paged store and come back;
    every id ends bitwise where a table with room for all of them ends. At K=2 the capacity
    (24 = the distinct ids of 3 steps) has slots reused as soon as the pin rule lets them
    go (LFU would pick the newest ids' slots, pending updates and all): an update computed
    for a slot never lands on its next id. Both paths: the fused native step
    (worker/embedding/dynamic/fused.py) and the Python steps it follows."""
    if fused and not NATIVE:
        pytest.skip("the native extension is not built")
    data = batches(40, 8)
    small = Run(dynamic_table(24, eviction=eviction), staleness)
    large = Run(dynamic_table(64, eviction=eviction), staleness)
    small.dynamic.fused = large.dynamic.fused = fused
    reuse_at_edge = 0
    slots = small.dynamic.tables["user"].slots
    dynamic = small.dynamic
    serve = dynamic._serve

    def watch(name: str, ids_U: np.ndarray, train: bool, at: tuple[int, int],
              expire_later: Expiry | None = None) -> tuple[np.ndarray, torch.Tensor | None]:
        nonlocal reuse_at_edge
        before_id, before_seen = slots.slot_id.copy(), slots.seen.copy()
        out = serve(name, ids_U, train, at, expire_later)
        reused = (before_seen >= 0) & (slots.slot_id != before_id)
        reuse_at_edge += int((before_seen[reused] == at[1]).sum())
        return out

    dynamic._serve = watch  # type: ignore[method-assign]
    small.train(data)
    large.train(data)
    stats = slots.stats
    assert stats.evictions > 20 and stats.page_ins > 10
    assert stats.refused_capacity == 0
    if staleness:
        assert reuse_at_edge > 0  # slots reused at the first step the window allows
    got, want = small.by_id(), large.by_id()
    assert set(got) == set(want)
    for ident, parts in want.items():
        for a, b in zip(got[ident], parts, strict=True):
            assert torch.equal(a, b), ident


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "partial_rowwise_adam", "adagrad",
                                  "sgd"])
def test_eviction_and_page_in_are_bitwise_for_every_optimizer(kind: str) -> None:
    """The same round trip with each optimizer's own per-row state (hybridps/optim_kinds.py:
    one sum a row, m per element with v per row, ...): it pages out and back by name."""
    data = batches(40, 8)
    small = Run(dynamic_table(24, eviction="lru"), 2, kind)
    large = Run(dynamic_table(64, eviction="lru"), 2, kind)
    small.train(data)
    large.train(data)
    assert small.dynamic.tables["user"].slots.stats.page_ins > 10
    got, want = small.by_id(), large.by_id()
    assert set(got) == set(want)
    widths = dict(OptimizerSpec(kind=kind).state_widths(DIM))
    for ident, parts in want.items():
        assert len(parts) == 1 + len(widths)
        for a, b in zip(got[ident], parts, strict=True):
            assert torch.equal(a, b), ident


def test_without_the_pin_rule_updates_land_on_the_wrong_id(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the test above: letting the slots of pending updates be evicted
    (as if every update were applied) changes the rows, at K=2."""
    data = batches(40, 8)

    def no_pins(self: DynamicIds, step: int, applied_through: int) -> None:
        self.step, self.applied_through = step, step - 1

    monkeypatch.setattr(DynamicIds, "begin_step", no_pins)
    small = Run(dynamic_table(24, eviction="lfu"), 2)
    large = Run(dynamic_table(64, eviction="lfu"), 2)
    small.train(data)
    large.train(data)
    got, want = small.by_id(), large.by_id()
    assert any(not torch.equal(got[i][0], want[i][0]) for i in want)


def test_refused_ids_read_zeros_and_get_no_update() -> None:
    run = Run(dynamic_table(16, admission="threshold", threshold=2), 0)
    ids = torch.tensor([5, -9, 5, 11], dtype=torch.int64)
    run.window.before_step(0)
    rows = run.emb.lookup("user", ids)  # first sighting: every id refused
    assert torch.equal(rows, torch.zeros(4, DIM))
    rows.sum().backward()
    grads = run.emb.pop_grads()
    assert grads["user"][0].numel() == 0  # no row gets a gradient
    run.source.push(0, grads)
    run.window.before_step(1)
    rows = run.emb.lookup("user", torch.tensor([5, 12], dtype=torch.int64))
    assert torch.equal(rows[0], initial_rows(torch.tensor([5]), DIM, seed=SEED,
                                             table_index=0, init_std=0.5)[0])
    assert torch.equal(rows[1], torch.zeros(DIM))  # 12: its first sighting
    stats = run.dynamic.tables["user"].slots.stats
    assert (stats.admissions, stats.refused_filter) == (1, 4)


def test_bags_mean_over_refused_zeros() -> None:
    """A bag holding a refused id pools a zero row for it (mean: over the whole bag)."""
    run = Run(dynamic_table(2), 0)  # two slots: the third new id of the step is refused
    run.window.before_step(0)
    ids = torch.tensor([1, 2, 3, 1], dtype=torch.int64)
    offsets = torch.tensor([0, 2], dtype=torch.int64)
    bags = run.emb.lookup_bag("user", ids, offsets, mode="mean")
    r = initial_rows(torch.tensor([1, 2]), DIM, seed=SEED, table_index=0, init_std=0.5)
    assert torch.allclose(bags[0], (r[0] + r[1]) / 2)
    assert torch.allclose(bags[1], (torch.zeros(DIM) + r[0]) / 2)


def test_evaluation_changes_nothing_and_reads_paged_rows() -> None:
    data = batches(30, 8)
    run = Run(dynamic_table(12), 0)
    run.train(data)
    slots = run.dynamic.tables["user"].slots
    paged_id = int(run.source.paged["user"].entries().ids[0])
    before = (slots.stats.as_dict(), slots.map.items()[0].tolist())
    with torch.no_grad():
        rows = run.emb.lookup("user", torch.tensor([paged_id, 424242], dtype=torch.int64))
    assert torch.equal(rows[0], run.by_id()[paged_id][0])
    assert torch.equal(rows[1], torch.zeros(DIM))
    assert (slots.stats.as_dict(), slots.map.items()[0].tolist()) == before
