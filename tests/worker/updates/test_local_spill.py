"""--local-memory-budget-mb (worker/updates/local_spill.py): the local optimizer's state
bounded in memory, the rest paged to disk, bitwise the unbounded run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import write_manifest
from hybridps.locked_dirs import LOCK_NAME
from hybridps.optim import OptimizerSpec
from hybridps.page_file import HEADER_BYTES, PageCorrupt
from hybridps.spilled_rows import (
    HeldRows,
    SpilledRows,
    frame_bytes,
    spilled_bookkeeping_bytes,
)
from tests.worker.embedding.dynamic.test_dynamic_train import DIM as DYNAMIC_DIM
from tests.worker.embedding.dynamic.test_dynamic_train import (
    SEED,
    Run,
    batches,
    dynamic_table,
)
from worker.config.train_config import TrainConfig
from worker.embedding.rows import TableConfig
from worker.embedding.sharded import ShardedEmbedding
from worker.updates.local_spill import LocalBudget, SpillDir, held_bytes, plan_frames
from worker.updates.local_state import local_state_rows
from worker.updates.source import (
    LocalSparseOptimizer,
    RowUpdate,
    SavedFiles,
    StalenessWindow,
)
from worker.updates.staleness import RowPredictor

ROWS, DIM = 3000, 8
# a page of 16 rows of adam's m and v (8 + 8 floats) and a budget of 24 pages: after the
# bookkeeping of the rank's 2000 units (hybridps/spilled_rows.py), a page each in memory
PAGE_BYTES = 16 * 16 * 4
SMALL = 24 * PAGE_BYTES


def _emb(row_dtype: torch.dtype = torch.float32) -> ShardedEmbedding:
    tables = [TableConfig("a", ROWS, DIM), TableConfig("b", ROWS // 3, DIM)]
    return ShardedEmbedding(tables, rank=0, world_size=1, seed=4, init_std=0.1,
                            row_dtype=row_dtype, group_tables=False)


def _pushes(emb: ShardedEmbedding, steps: int, seed: int = 0
            ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Zipf-ish ids (a hot head and a uniform tail) per unit, unique per push."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        grads = {}
        for name, unit in emb.units.items():
            head = torch.randint(0, 40, (60,), generator=gen)
            tail = torch.randint(0, unit.rows, (60,), generator=gen)
            ids = torch.unique(torch.cat([head, tail])) + unit.start
            grads[name] = (ids, torch.randn(ids.numel(), DIM, generator=gen))
        out.append(grads)
    return out


def _budget(tmp: Path, memory: int = SMALL) -> LocalBudget:
    return LocalBudget(memory, str(tmp / "spill"), 0, PAGE_BYTES)


def _run(local: LocalSparseOptimizer, pushes: list[dict[str, tuple[torch.Tensor,
         torch.Tensor]]], first: int = 0) -> list[RowUpdate]:
    for step, grads in enumerate(pushes, start=first):
        local.push(step, grads)
    updates, _ = local.take(first + len(pushes) - 1)
    return updates


def _assert_same_updates(a: list[RowUpdate], b: list[RowUpdate]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert (x.step, x.table, x.decay, x.rows) == (y.step, y.table, y.decay, y.rows)
        assert torch.equal(x.ids_U, y.ids_U)
        assert torch.equal(x.delta_UD, y.delta_UD), (x.step, x.table)


def _state(local: LocalSparseOptimizer) -> dict[str, dict[str, torch.Tensor]]:
    return {n: {k: t.clone() for k, t in c.read(0, c.rows).items()}
            for n, c in local.columns.items()}


def _assert_same_state(a: LocalSparseOptimizer, b: LocalSparseOptimizer) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for unit in sa:
        assert sa[unit].keys() == sb[unit].keys()
        for name in sa[unit]:
            assert torch.equal(sa[unit][name], sb[unit][name]), (unit, name)


@pytest.mark.parametrize("kind,row_dtype", [("adam", torch.float32),
                                            ("adam", torch.bfloat16),
                                            ("partial_rowwise_adam", torch.float32),
                                            ("adagrad", torch.float32)])
def test_a_bounded_optimizer_is_bitwise_the_unbounded_one(tmp_path: Path, kind: str,
                                                          row_dtype: torch.dtype) -> None:
    spec = OptimizerSpec(kind=kind, lr=0.05)
    free = LocalSparseOptimizer(_emb(row_dtype), spec)
    emb = _emb(row_dtype)
    bounded = LocalSparseOptimizer(emb, spec, budget=_budget(tmp_path))
    assert all(isinstance(c, SpilledRows) for c in bounded.columns.values())
    assert not bounded.state and not bounded.masters
    pushes = _pushes(emb, 30)
    _assert_same_updates(_run(free, pushes), _run(bounded, pushes))
    _assert_same_state(free, bounded)
    memory = bounded.stats.local_memory
    assert memory["spills"] > 0 and memory["fills"] > 0 and memory["disk_bytes"] > 0
    assert memory["budget_bytes"] == SMALL
    assert (memory["master_bytes"] > 0) == (row_dtype != torch.float32)
    bounded.close()


def test_the_budget_is_split_in_proportion_and_fits_stay_in_memory(tmp_path: Path) -> None:
    layout = [("m", 8), ("v", 8)]
    units = [("big", 3000, layout), ("small", 1000, layout), ("none", 0, layout)]
    page_rows = LocalBudget(page_bytes=PAGE_BYTES).page_rows(layout)
    page = frame_bytes(layout, page_rows)
    # the spilled units' bookkeeping (their units' places, their logs' per-page figures)
    bookkeeping = sum(spilled_bookkeeping_bytes(layout, rows, page_rows) for rows in (3000, 1000))
    for memory in (SMALL, 4 * SMALL):
        budget = _budget(tmp_path, memory)
        frames = plan_frames(units, budget, "rank 0")
        left = memory - bookkeeping  # the budget less the bookkeeping, split 3:1
        assert frames == {"big": max(1, left * 3 // 4 // page),
                          "small": max(1, left // 4 // page), "none": 0}
    assert frames["small"] > 1 and frames["big"] >= 3 * frames["small"]
    # what they hold: the frames and the bookkeeping, within the budget
    held = sum(held_bytes(rows, lay, frames[name], budget) for name, rows, lay in units)
    assert 4 * SMALL - 2 * page < held <= 4 * SMALL
    roomy = LocalBudget(4000 * 64, "", 0, PAGE_BYTES)  # every byte fits: nothing spills
    assert plan_frames(units, roomy, "rank 0") == {"big": 0, "small": 0, "none": 0}
    assert plan_frames(units, LocalBudget(), "rank 0") == {"big": 0, "small": 0, "none": 0}
    tiny = LocalBudget(1, str(tmp_path), 0, PAGE_BYTES)  # at least one page each
    assert plan_frames(units, tiny, "rank 0") == {"big": 1, "small": 1, "none": 0}
    local = LocalSparseOptimizer(_emb(), OptimizerSpec(), budget=LocalBudget(
        10 << 20, str(tmp_path / "spill"), 0, PAGE_BYTES))
    assert all(isinstance(c, HeldRows) for c in local.columns.values())
    local.close()


def test_the_spilled_columns_hold_no_more_than_the_budget(tmp_path: Path) -> None:
    """After every push of a run that spills, the memory the spilled columns hold (their
    slots and bookkeeping: SpilledRows.memory_bytes) is within the budget; a budget whose
    slots hold a push's rows (a push needing more brings them all in for its call)."""
    memory = 4 * SMALL
    emb = _emb()
    local = LocalSparseOptimizer(emb, OptimizerSpec(lr=0.05), budget=_budget(tmp_path, memory))
    assert all(isinstance(c, SpilledRows) for c in local.columns.values())
    held = []
    for step, grads in enumerate(_pushes(emb, 30)):
        local.push(step, grads)
        held.append(sum(c.memory_bytes for c in local.columns.values()))
    stats = local.stats.local_memory
    assert stats["spills"] > 0 and stats["fills"] > 0
    assert max(held) <= memory
    assert stats["state_bytes"] == held[-1]  # the report counts the same bytes
    local.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_on_a_device_step_their_spilled_state_there_bitwise(tmp_path: Path) -> None:
    """Spilled frames are on the host: a push's rows are stepped on the rows' device as a
    gathered copy, bitwise the state held on the device."""
    tables = [TableConfig("a", ROWS, DIM)]
    spec = OptimizerSpec(lr=0.05)
    free = LocalSparseOptimizer(ShardedEmbedding(tables, device="cuda", seed=4), spec)
    emb = ShardedEmbedding(tables, device="cuda", seed=4)
    bounded = LocalSparseOptimizer(emb, spec, budget=_budget(tmp_path))
    pushes = [{n: (ids.cuda(), g.cuda()) for n, (ids, g) in p.items()}
              for p in _pushes(emb, 20)]
    _assert_same_updates(_run(free, pushes), _run(bounded, pushes))
    got = _state(bounded)
    for unit, by_name in _state(free).items():
        for name, t in by_name.items():
            assert torch.equal(t.cpu(), got[unit][name]), (unit, name)
    assert bounded.stats.local_memory["fills"] > 0
    bounded.close()


def test_bad_budgets_fail_in_one_line_before_any_work(tmp_path: Path) -> None:
    units = [("a", 3000, [("m", 8), ("v", 8)])]
    with pytest.raises(ValueError, match=r"take 0\.2 MiB, more than "
                       r"--local-memory-budget-mb 0; give --local-spill-dir"):
        plan_frames(units, LocalBudget(SMALL, "", 0, PAGE_BYTES), "rank 0")
    with pytest.raises(ValueError, match=r"spill files need up to .* GiB, more than "
                       r"--local-spill-max-gb"):
        plan_frames(units, LocalBudget(SMALL, str(tmp_path), 1000, PAGE_BYTES), "rank 0")
    with pytest.raises(ValueError, match=r"--local-memory-budget-mb -1 must be >= 0"):
        LocalBudget(-1 << 20)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match=r"--local-spill-dir .*file.*: cannot create it"):
        SpillDir(not_a_dir, 0)
    with pytest.raises(ValueError, match="local_memory_budget_mb=-1 must be >= 0"):
        TrainConfig.of(local_optimizer=True, local_memory_budget_mb=-1)
    with pytest.raises(ValueError, match="bound --local-optimizer's state"):
        TrainConfig.of(ps="127.0.0.1:1", local_memory_budget_mb=8)
    with pytest.raises(ValueError, match="without --local-memory-budget-mb"):
        TrainConfig.of(local_optimizer=True, local_spill_dir=str(tmp_path))
    with pytest.raises(ValueError, match="local_spill_max_gb=-1"):
        TrainConfig.of(local_optimizer=True, local_spill_max_gb=-1.0)
    cfg = TrainConfig.of(local_optimizer=True, local_memory_budget_mb=8,
                         local_spill_dir=str(tmp_path), local_spill_page_kb=4)
    assert LocalBudget.from_flags(cfg.sync.local_memory_budget_mb, cfg.sync.local_spill_dir,
                                  cfg.sync.local_spill_max_gb,
                                  cfg.sync.local_spill_page_kb) == LocalBudget(
        8 << 20, str(tmp_path), 0, 4096)


def test_a_damaged_page_fails_loudly_naming_its_file(tmp_path: Path) -> None:
    emb = _emb()
    local = LocalSparseOptimizer(emb, OptimizerSpec(lr=0.05), budget=_budget(tmp_path))
    pushes = _pushes(emb, 10)
    _run(local, pushes)
    columns = local.columns["a"]
    assert isinstance(columns, SpilledRows)
    unit = int(next(u for u in range(columns.units) if columns.where[u] >= 0))  # on disk only
    page = int(columns.where[unit]) // columns.page_units
    with open(columns.file.path, "r+b") as f:  # flip a byte of the page's payload
        f.seek(page * columns.file.stride + HEADER_BYTES + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    ids = torch.tensor([unit * columns.unit_rows], dtype=torch.int64) + emb.units["a"].start
    with pytest.raises(PageCorrupt, match=rf"{columns.file.path}.*page {page}"):
        local.push(10, {**pushes[0], "a": (ids, torch.ones(1, DIM))})
    local.close()


def test_a_checkpoint_holds_the_spilled_state_and_resumes_bitwise(tmp_path: Path) -> None:
    spec = OptimizerSpec(lr=0.05)
    emb = _emb()
    pushes = _pushes(emb, 24)
    straight = LocalSparseOptimizer(_emb(), spec)
    want = _run(straight, pushes)
    first = LocalSparseOptimizer(emb, spec, budget=_budget(tmp_path))
    _run(first, pushes[:12])
    ck = tmp_path / "ck"
    ck.mkdir()
    _write_manifest(ck, emb, first.snapshot_to(ck, 11, lambda x: x)(), 11)
    first.close()
    for budget in (_budget(tmp_path), None):  # back into pages, or into memory
        resumed = LocalSparseOptimizer(_emb(), spec, budget=budget)
        resumed.restore_from(ck, 11)
        resumed.buffer.start_at(11)
        _assert_same_updates(want[2 * 12:], _run(resumed, pushes[12:], first=12))
        _assert_same_state(straight, resumed)
        resumed.close()


def _write_manifest(directory: Path, emb: ShardedEmbedding, files: SavedFiles,
                    step: int) -> None:
    """The checkpointer's part (worker/checkpoint/): a manifest of the optim files."""
    tables = {}
    for name, table in emb.tables.items():
        info = files[name]["optim"]
        entry = {"file": info.file, "bytes": info.bytes, "crc32": info.crc32}
        tables[name] = {"num_rows": table.num_rows, "dim": table.dim, "shards": [{
            "rank": 0, "row_start": info.row_start, "row_end": info.row_end,
            "rows": entry, "optim": entry}]}
    write_manifest(directory, {"step": step, "world_size": 1, "tables": tables})


def test_a_delta_reads_the_changed_rows_from_the_pages(tmp_path: Path) -> None:
    spec = OptimizerSpec(lr=0.05)
    emb = _emb()
    pushes = _pushes(emb, 12)
    free = LocalSparseOptimizer(_emb(), spec)
    bounded = LocalSparseOptimizer(emb, spec, budget=_budget(tmp_path))
    for local in (free, bounded):
        _run(local, pushes)
    rows = [local_state_rows(emb=emb, columns=local.columns, dynamic=(),
                             changed=local.changed) for local in (free, bounded)]
    for name in emb.tables:
        (ids_a, state_a, _), (ids_b, state_b, _) = rows[0][name], rows[1][name]
        assert ids_a is not None and ids_b is not None and ids_a.numel() > 0
        assert torch.equal(ids_a, ids_b)
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key]), (name, key)
    bounded.close()


def test_spill_files_are_removed_at_close_and_stale_ones_at_start(tmp_path: Path) -> None:
    root = tmp_path / "spill"
    stale = root / "rank3-999999-dead"
    stale.mkdir(parents=True)
    (stale / LOCK_NAME).touch()
    (stale / "u0.pages").write_bytes(b"old")
    other = root / "not-ours"
    other.mkdir()
    emb = _emb()
    local = LocalSparseOptimizer(emb, OptimizerSpec(), budget=_budget(tmp_path))
    assert not stale.exists() and other.exists()
    assert local.spill_dir is not None and local.spill_dir.path is not None
    own = local.spill_dir.path
    live = SpillDir(root, 1)  # a live rank's directory is left alone
    assert own.exists() and sorted(p.name for p in own.iterdir()) == [
        LOCK_NAME, "u0.pages", "u1.pages"]
    _run(local, _pushes(emb, 4))
    local.close()
    local.close()  # twice is harmless
    assert not own.exists()
    assert live.path is not None and live.path.exists()
    live.close()
    assert sorted(p.name for p in root.iterdir()) == ["not-ours"]


class _DynamicRun(Run):
    """tests/worker/embedding/dynamic/test_dynamic_train.py's loop, its source bounded."""

    def __init__(self, budget: LocalBudget | None, fused: bool) -> None:
        table = dynamic_table(24, eviction="lru")
        # and a static table never looked up: with a dynamic table the columns get half the
        # budget (worker/updates/local_spill.py), so its state makes them spill while the
        # paged rows keep the other half
        self.emb = ShardedEmbedding([table, TableConfig("s", 1000, DYNAMIC_DIM)], seed=SEED,
                                    init_std=0.5)
        self.name = table.name
        self.source = LocalSparseOptimizer(self.emb, OptimizerSpec(lr=0.05), budget=budget)
        self.emb.set_pager(self.source)
        self.dynamic.fused = fused
        self.window = StalenessWindow(self.source, self.emb, 2, RowPredictor(self.emb, 2))
        self.w = torch.linspace(-1.0, 1.0, DYNAMIC_DIM)


@pytest.mark.parametrize("fused", [True, False])
def test_a_dynamic_table_pages_its_slots_spilled_state_bitwise(tmp_path: Path,
                                                               fused: bool) -> None:
    """24 slots for 60 ids at K=2: rows and state leave slots whose state is in spilled
    pages (the reference path: the fused step needs a tensor a row per slot) and come back,
    bitwise as with the state in memory on either path."""
    data = batches(40, 8)
    free = _DynamicRun(None, fused)
    budget = LocalBudget(24 << 10, str(tmp_path / "spill"), 0, 4 * 8 * 4)
    bounded = _DynamicRun(budget, fused)
    assert isinstance(bounded.source.columns["user"], SpilledRows)
    assert bounded.source.columns["user"].counters()["frames"] == 1
    assert bounded.source.local_store("user") is None
    free.train(data)
    bounded.train(data)
    assert bounded.dynamic.tables["user"].slots.stats.page_ins > 10
    assert bounded.dynamic.tables["user"].slots.stats.dropped_paged == 0  # within its share
    assert bounded.source.stats.local_memory["fills"] > 0
    assert torch.equal(free.emb.weights["user"].data, bounded.emb.weights["user"].data)
    _assert_same_state(free.source, bounded.source)
    a, b = free.source.paged["user"].entries(), bounded.source.paged["user"].entries()
    assert a.count > 0 and torch.equal(a.ids, b.ids) and torch.equal(a.rows, b.rows)
    for name in a.state:
        assert torch.equal(a.state[name], b.state[name]), name
    bounded.source.close()
