"""The disk tier of the server's state (ps/core/spill.py, hybridps/spilled_rows.py through
ps/core/store.py): a partition over its share spills pages and is bitwise the same
partition held in memory (pushes, Page calls, checkpoints and a restore), damage fails
loudly, --spill-max-gb refuses a Register naming the sizes, and spill files go with their
run and with a dead server."""

from __future__ import annotations

import fcntl
import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridps.checkpoint import write_manifest
from hybridps.errors import CorruptSpill, ResourceExhausted
from hybridps.locked_dirs import LOCK_NAME
from hybridps.optim import OptimizerSpec
from hybridps.paged_rows import PagedOut
from hybridps.run_secret import claim_directory
from hybridps.step_dirs import step_dir
from ps.core.paging import PageCall
from ps.core.partition import PushChunk, TableSpec
from ps.core.spill import SpillTier
from ps.core.store import Store

RUN, SECRET = "spill-run", "5e" * 32
DIM = 4
TABLES = [TableSpec("emb", 200, DIM, 0, 200), TableSpec("u", 100, DIM, 0, 50, dynamic=True)]
PAGE_BYTES = 256  # a few rows a page: many pages for small tables
# the run's share on this server: a quarter of the rank's fixed state (spilled)
BUDGET = 12_000
# wide rows (their payload is most of an entry) and a run share whose memory holds about a
# third of the paged-out rows of `u`, a quarter of the static state
WIDE = [TableSpec("emb", 200, 32, 0, 200), TableSpec("u", 100, 32, 0, 50, dynamic=True)]
PAGED_BUDGET = 24_000
STATIC_BUDGET = 4_000  # that of a partition of the static table alone (Adam): half spills


def _store(tmp_path: Path, spill: bool, name: str, budget: int = BUDGET,
           disk: int = 0) -> Store:
    root = tmp_path / "root"
    tier = SpillTier(tmp_path / "spill", disk, page_bytes=PAGE_BYTES) if spill else None
    return Store(checkpoint_root=root, max_state_bytes=budget if spill else 0,
                 run_shares=1, spill=tier, server_id=name)


def _push(step: int, table: str, rows: int, seed: int, dim: int = DIM) -> PushChunk:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, rows // 2, (1,), generator=g))
    ids = torch.randperm(rows, generator=g)[:n].sort().values
    return PushChunk(RUN, 0, 0, step, table, ids, torch.randn(n, dim, generator=g) * 3, 0, 1)


def _page(step: int, slots: list[int], out_ids: list[int], in_ids: list[int],
          in_slots: list[int], dim: int = DIM) -> PageCall:
    g = torch.Generator().manual_seed(1000 + step)
    n, i64 = len(out_ids), torch.int64
    return PageCall(step, step, 0, PagedOut(
        torch.tensor(out_ids, dtype=i64), torch.randn(n, dim, generator=g), {},
        torch.full((n,), step, dtype=i64), torch.ones(n, dtype=i64)),
        torch.tensor(slots, dtype=i64), torch.tensor(in_ids, dtype=i64),
        torch.tensor(in_slots, dtype=i64))


def _train(store: Store, steps: range, tables: list[TableSpec],
           may_drop: bool = False) -> list[Any]:
    answers: list[Any] = []
    for step in steps:
        for k, spec in enumerate(tables):
            answer = store.open_session().feed(_push(step, spec.name, spec.rows_held,
                                                     10 * step + k, spec.dim))
            assert answer is not None
            answers.append((answer.ids, answer.delta, answer.decay))
        if len(tables) < 2:
            continue
        # the dynamic table moves slot state out and back in: slots step%50.., ids by step
        slot = [(3 * step) % 50, (3 * step + 1) % 50]
        back = [1_000_000 + step - 4] if step >= 4 else []
        result = store.page(RUN, 0, 0, "u", _page(step + 1, slot, [1_000_000 + step,
                                                                   2_000_000 + step],
                                                   back, [(3 * step + 2) % 50][:len(back)],
                                                   tables[1].dim))
        answers.append((result.found, result.got.rows, result.dropped))
        assert may_drop or result.dropped.size == 0  # the paged rows fit: as unbounded
    return answers


def _state(store: Store) -> dict[str, torch.Tensor]:
    part = store.partition(RUN, 0)
    assert part is not None
    out = {}
    for name, t in part.tables.items():
        for col, values in t.columns.read(0, t.spec.rows_held).items():
            out[f"{name}/{col}"] = values.clone()
    return out


def _same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, v)
            else:
                assert (u == v).all() if hasattr(u, "all") else u == v


# (optimizer, row dtype, tables, the run's budget, that of a partition of the static
# table alone): each spills about half its state
CASES = [("adam", torch.float32, TABLES, BUDGET, STATIC_BUDGET),
         ("rowwise_adagrad", torch.float32, TABLES[:1], 900, 900),
         ("adagrad", torch.bfloat16, TABLES[:1], 4_000, 4_000)]


@pytest.mark.parametrize("kind,row_dtype,tables,budget,static_budget", CASES)
def test_a_spilled_partition_is_bitwise_the_one_in_memory(
        tmp_path: Path, kind: str, row_dtype: torch.dtype, tables: list[TableSpec],
        budget: int, static_budget: int) -> None:
    opt = OptimizerSpec(kind=kind, lr=0.05)
    stores = {"mem": _store(tmp_path / "m", False, "mem"),
              "spill": _store(tmp_path / "s", True, "spill", budget)}
    answers = {}
    for name, store in stores.items():
        store.register(RUN, 0, 1, 0, tables, opt, row_dtype=row_dtype, run_secret=SECRET)
        if row_dtype != torch.float32:
            for spec in tables:
                rows = torch.randn(spec.rows_held, DIM, generator=torch.Generator()
                                   .manual_seed(7))
                store.seed_rows(RUN, 0, 0, spec.name, spec.row_start, rows)
        answers[name] = _train(store, range(12), tables)
    _same(answers["mem"], answers["spill"])
    want, got = _state(stores["mem"]), _state(stores["spill"])
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    row = {r.table: r for r in stores["spill"].stats().partitions}
    assert row["emb"].spill_disk_bytes > 0 and row["emb"].spill_spills > 0
    assert row["emb"].spill_fills > 0 and 0 < row["emb"].spill_hit_rate < 1
    held = stores["spill"].partition(RUN, 0)
    assert held is not None and held.disk_bytes > 0
    frames = held.tables["emb"].columns.counters()["frames"]
    # a push may bring in more pages than the frames (it applies whole); the next one
    # goes back to them, within the budget, the rest on disk
    assert held.state_bytes <= budget + frames * PAGE_BYTES

    # a checkpoint holds the spilled state (read back), bitwise the one in memory; a
    # restore into a spilling server trains on bitwise like the one in memory
    for name, store in stores.items():
        claim_directory(tmp_path / name[0] / "root" / "ck", prefer=SECRET)
        store.checkpoint(RUN, [], 11, str(step_dir(tmp_path / name[0] / "root" / "ck", 11)))
    for rel in sorted(p.relative_to(tmp_path / "m" / "root" / "ck")
                      for p in (tmp_path / "m" / "root" / "ck").rglob("*.pt")):
        a = torch.load(tmp_path / "m" / "root" / "ck" / rel)
        b = torch.load(tmp_path / "s" / "root" / "ck" / rel)
        _same_payload(a, b, str(rel))
    directory = step_dir(tmp_path / "s" / "root" / "ck", 11)
    _write_manifest(directory, sorted(directory.rglob("emb*.pt")), 11)
    restored = _store(tmp_path / "r", True, "restored", static_budget)
    restored.checkpoint_root = stores["spill"].checkpoint_root
    restored.register(RUN, 0, 1, 1, TABLES[:1], opt, row_dtype=row_dtype, run_secret=SECRET,
                      restore=(str(directory), 11))
    restored_part = restored.partition(RUN, 0)
    assert restored_part is not None
    restored_part.incarnation = 0
    for step in range(12, 20):  # the static table trains on, bitwise
        a = stores["mem"].open_session().feed(_push(step, "emb", 200, 10 * step))
        b = restored.open_session().feed(_push(step, "emb", 200, 10 * step))
        assert a is not None and b is not None
        assert torch.equal(a.delta, b.delta) and a.decay == b.decay
    assert restored_part.disk_bytes > 0
    want, got = _state(stores["mem"]), _state(restored)
    for key in got:
        assert torch.equal(want[key], got[key]), key


def _write_manifest(directory: Path, files: list[Path], step: int) -> None:
    """The worker's part of a checkpoint: a manifest, here of the static table alone."""
    spec = TABLES[0]
    assert len(files) == 1
    data = files[0].read_bytes()
    entry = {"file": str(files[0].relative_to(directory)), "bytes": len(data),
             "crc32": f"{zlib.crc32(data):08x}"}
    shard = {"rank": 0, "row_start": spec.row_start, "row_end": spec.row_end,
             "rows": entry, "optim": entry}
    write_manifest(directory, {"step": step, "world_size": 1, "tables": {
        spec.name: {"num_rows": spec.num_rows, "dim": spec.dim, "shards": [shard]}}})


def _same_payload(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same_payload(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_payload(x, y, f"{where}/{i}")


def test_a_damaged_spill_page_fails_the_push_and_names_it(tmp_path: Path) -> None:
    store = _store(tmp_path, True, "s", STATIC_BUDGET)
    store.register(RUN, 0, 1, 0, TABLES[:1], OptimizerSpec(kind="adam", lr=0.1))
    for step in range(6):
        store.open_session().feed(_push(step, "emb", 200, step))
    files = list((tmp_path / "spill").glob("ps-*/*.pages"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    data = bytearray(files[0].read_bytes())
    for at in range(4096 + 100, len(data), 4096):  # every page but the first
        data[at] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with pytest.raises(CorruptSpill, match=r"t\d+\.pages: page \d+"):
        for step in range(6, 30):
            store.open_session().feed(_push(step, "emb", 200, step))


def test_the_spill_limit_refuses_a_register_naming_the_sizes(tmp_path: Path) -> None:
    tier = SpillTier(tmp_path / "spill", max_bytes=10_000, page_bytes=PAGE_BYTES)
    store = Store(max_state_bytes=STATIC_BUDGET, run_shares=1, spill=tier)
    with pytest.raises(ResourceExhausted, match=r"spill files need up to .*--spill-max-gb"):
        store.register(RUN, 0, 1, 0, TABLES[:1], OptimizerSpec(kind="adam", lr=0.1))
    assert store.partition(RUN, 0) is None and tier.reserved_bytes == 0
    assert not list((tmp_path / "spill").glob("ps-*/*.pages"))


def test_spill_files_go_with_their_run_and_a_dead_servers_at_start(tmp_path: Path) -> None:
    store = _store(tmp_path, True, "s", STATIC_BUDGET)
    store.register(RUN, 0, 1, 0, TABLES[:1], OptimizerSpec(kind="adam", lr=0.1))
    for step in range(4):
        store.open_session().feed(_push(step, "emb", 200, step))
    own = store.spill.directory
    assert own is not None and list(own.glob("*.pages"))
    assert store.spill.reserved_bytes > 0
    store.drop_run(RUN, "test")
    assert not list(own.glob("*.pages")) and store.spill.reserved_bytes == 0

    dead = tmp_path / "spill" / "ps-1-dead"  # a server killed with kill -9: no lock held
    dead.mkdir()
    (dead / LOCK_NAME).write_text("")
    (dead / "t0.pages").write_bytes(b"x" * 100)
    other = tmp_path / "spill" / "unrelated"
    other.mkdir()
    second = SpillTier(tmp_path / "spill", page_bytes=PAGE_BYTES)
    assert not dead.exists() and other.exists() and second.removed_stale == 1
    assert own.exists()  # a live server's directory (its lock held) is kept
    fd = os.open(own / LOCK_NAME, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    second.close()
    store.spill.close()
    assert not own.exists()


def test_the_stats_show_the_tier_per_table_and_run(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from hybridps.admin import format_shard_stats, message_dict
    from ps.edge.metrics import LatencyRecorder, StoreCollector
    from ps.edge.sync_codec import stats_message

    now = [100.0]
    root = tmp_path / "root"
    store = Store(checkpoint_root=root, max_state_bytes=STATIC_BUDGET, run_shares=1,
                  spill=SpillTier(tmp_path / "spill", 0, page_bytes=PAGE_BYTES),
                  server_id="s", clock=lambda: now[0], rate_window_s=10.0)
    store.register(RUN, 0, 1, 0, TABLES[:1], OptimizerSpec(kind="adam", lr=0.1))
    for step in range(6):
        store.open_session().feed(_push(step, "emb", 200, step))
    now[0] += 2.0  # six pushes in 2 s: their pages a second
    row = store.stats().partitions[0]
    assert row.spill_fills_per_second == row.spill_fills / 2.0 > 0
    assert row.spill_spills_per_second == row.spill_spills / 2.0 > 0
    now[0] += 20.0  # nothing since: the window holds the last reading only
    assert store.stats().partitions[0].spill_fills_per_second == 0.0
    pages = -(-200 // store.spill.page_rows([("m", DIM), ("v", DIM)]))  # the state in pages
    assert row.spilled and row.spill_frames < row.spill_pages == pages
    assert row.spill_hits + row.spill_misses > 0 and row.spill_spills > 0
    assert row.spill_hit_rate == row.spill_hits / (row.spill_hits + row.spill_misses)
    msg = stats_message(store.stats())
    assert msg.spill_enabled and msg.spill_disk_bytes_total == row.spill_disk_bytes > 0
    text = format_shard_stats(msg, width=200)
    assert f"spill run {RUN}: in memory" in text and "hit rate" in text
    assert f"spill {RUN} rank 0 emb: pages {row.spill_frames}/{pages} in memory" in text
    assert f"spills {row.spill_spills} (0/s)  fills {row.spill_fills} (0/s)" in text
    assert message_dict(msg)["partitions"][0]["spill_fills"] == row.spill_fills  # --json
    assert message_dict(msg)["partitions"][0]["spill_fills_per_second"] == 0.0
    families = {f.name: f for f in StoreCollector(store, LatencyRecorder(
        CollectorRegistry())).collect()}
    assert families["hybridps_partition_spill_spills"].samples[0].value == row.spill_spills
    assert families["hybridps_partition_spill_disk_bytes"].samples[0].value == \
        row.spill_disk_bytes
    assert "hybridps_partition_spill_hit_rate" in families


def test_paged_out_rows_spill_and_are_dropped_only_beyond_the_disk(tmp_path: Path) -> None:
    """A run share whose memory holds a few paged-out rows: without --spill-max-gb they
    are dropped beyond it; with it they spill, none is dropped, and the run is bitwise the
    one in memory."""
    opt = OptimizerSpec(kind="adam", lr=0.05)
    stores = {"mem": _store(tmp_path / "m", False, "mem"),
              "drop": _store(tmp_path / "d", True, "drop", PAGED_BUDGET),
              "disk": _store(tmp_path / "k", True, "disk", PAGED_BUDGET, disk=8 << 20)}
    answers = {}
    for name, store in stores.items():
        store.register(RUN, 0, 1, 0, WIDE, opt, run_secret=SECRET)
        answers[name] = _train(store, range(40), WIDE, may_drop=name == "drop")
    rows = {name: {r.table: r for r in store.stats().partitions}
            for name, store in stores.items()}
    assert rows["drop"]["u"].dynamic_dropped > 0  # the memory alone does not hold them
    assert rows["disk"]["u"].dynamic_dropped == 0
    assert rows["disk"]["u"].dynamic_paged_rows == rows["mem"]["u"].dynamic_paged_rows
    _same(answers["mem"], answers["disk"])
    want, got = _state(stores["mem"]), _state(stores["disk"])
    for key in want:
        assert torch.equal(want[key], got[key]), key
    table = stores["disk"].partition(RUN, 0).tables["u"]  # type: ignore[union-attr]
    assert table.paging is not None and table.paging.store.spilled is not None
    assert table.paging.store.spilled.disk_bytes > 0
    a = stores["mem"].partition(RUN, 0).tables["u"].paging.store.state_dict()  # type: ignore
    b = table.paging.store.state_dict()
    for key in ("ids", "rows", "seen", "freq"):
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a["state"]["m"], b["state"]["m"])
    stores["disk"].drop_run(RUN, "test")
    assert stores["disk"].spill.reserved_bytes == 0
    assert not list((tmp_path / "k" / "spill").glob("ps-*/*.pages"))
