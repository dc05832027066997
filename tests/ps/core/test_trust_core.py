"""What the transport-free server core trusts: names, the checkpoint root, damaged
checkpoints refused with nothing changed, the state budget and impossible shapes, the
partition secret, freeing runs, the run rules under torchrun restarts, the arena sweep."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import optim_file, step_dir
from hybridps.errors import (
    CorruptCheckpoint,
    InvalidArgument,
    NotRegistered,
    PermissionDenied,
    ResourceExhausted,
    WrongSecret,
)
from hybridps.run_secret import claim_directory
from ps.core.lifecycle import RunTracker
from ps.core.maintenance import RunReaper, sweep_dead_arenas
from ps.core.partition import TableSpec
from ps.core.shard_core import ShardCore
from ps.core.store import Store
from tests.ps.core.test_partition import (
    ADAM,
    DIM,
    EMB,
    RUN,
    SMALL,
    assert_same_state,
    feed,
    push,
    state,
)

# -- names ------------------------------------------------------------------------------

BAD_NAMES = ["../../evil", "a/b", "a\\b", ".hidden", "..", "-flag", "x" * 129, "sp ace",
             "nul\x00", "é"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_run_ids_and_table_names_are_refused_naming_them(name: str) -> None:
    store = Store()
    with pytest.raises(InvalidArgument, match="run_id") as info:
        store.register(name, 0, 1, 0, [EMB], ADAM)
    assert repr(name)[:40] in str(info.value)
    with pytest.raises(InvalidArgument, match="table name") as info:
        store.register(RUN, 0, 1, 0, [TableSpec(name, 20, DIM, 0, 20)], ADAM)
    assert repr(name)[:40] in str(info.value)
    assert store.partitions() == []
    from ps.core.lifecycle import check_finish

    for call in (lambda: feed(store, push(0, [1], run=name)),
                 lambda: store.flush_status(name, 0, 0),
                 lambda: store.checkpoint(name, [], 0, "ck"),
                 lambda: check_finish(store, name, 0, 0, -1, True),
                 lambda: store.drop_run(name, "test")):
        with pytest.raises(InvalidArgument, match="run_id"):
            call()


def test_a_push_naming_a_bad_table_is_invalid_not_unknown() -> None:
    store = Store()
    store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM)
    with pytest.raises(InvalidArgument, match=r"table name '\.\./x'"):
        feed(store, push(0, [11], table="../x"))


# -- the checkpoint root ----------------------------------------------------------------

SECRET = "5e" * 32  # the run secret of RUN (hybridps/run_secret.py)


def _trained(tmp_path: Path, **kwargs: object) -> Store:
    store = Store(checkpoint_root=tmp_path / "root", **kwargs)  # type: ignore[arg-type]
    store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM, run_secret=SECRET)
    for step in range(3):
        feed(store, push(step, [11, 15]))
        feed(store, push(step, [0, 2], table="small", dim=2))
    return store


def test_checkpoints_only_inside_the_root(tmp_path: Path) -> None:
    store = _trained(tmp_path)
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    (root).mkdir()
    (root / "link").symlink_to(outside)
    for claimed in ("run-a", "abs"):  # the run's workers claim their directories
        claim_directory(root / claimed, prefer=SECRET)
    for directory in (str(outside), "../outside", "link/step-0000000002", str(root / "link"),
                      "/etc", str(root) + "/../outside"):
        with pytest.raises(PermissionDenied, match="outside this server's --checkpoint-root"):
            store.checkpoint(RUN, [], 2, directory)
    assert not any(outside.iterdir())
    files = store.checkpoint(RUN, [], 2, "run-a/step-0000000002")  # relative: under the root
    assert (root / "run-a" / "step-0000000002" / files[0][1].file).is_file()
    store.checkpoint(RUN, [], 2, str(root / "abs" / "step-0000000002"))  # absolute inside
    assert (root / "abs" / "step-0000000002" / "optim").is_dir()
    with pytest.raises(PermissionDenied):
        store.register(RUN, 1, 2, 1, [EMB, SMALL], ADAM, restore=(str(outside), 2))


# -- damaged checkpoints are refused, nothing changes ------------------------------------

@pytest.fixture
def saved(tmp_path: Path) -> tuple[Store, Path]:
    """Ranks 0 and 1 of a run at step 2, checkpointed to root/ck (both ranks' files), then
    rank 1 trains on to step 4."""
    from hybridps.checkpoint import write_manifest

    root = tmp_path / "root"
    store = Store(checkpoint_root=root)
    emb0, small0 = TableSpec("emb", 20, DIM, 0, 10), TableSpec("small", 5, 2, 3, 5)
    store.register(RUN, 0, 2, 0, [emb0, small0], ADAM, run_secret=SECRET)
    store.register(RUN, 1, 2, 0, [EMB, SMALL], ADAM, run_secret=SECRET)
    claim_directory(root / "ck", prefer=SECRET)
    for step in range(3):
        for rank, ids, small in ((0, [1, 4], [3]), (1, [11, 15], [0, 2])):
            feed(store, push(step, ids, rank=rank))
            feed(store, push(step, small, rank=rank, table="small", dim=2))
    directory = step_dir(root / "ck", 2)
    files = store.checkpoint(RUN, [], 2, str(directory))
    tables: dict[str, dict[str, object]] = {}
    for name, num_rows, dim in (("emb", 20, DIM), ("small", 5, 2)):
        shards = []
        for rank, info in files:
            if info.table == name:
                entry = {"file": info.file, "bytes": info.bytes, "crc32": info.crc32}
                shards.append({"rank": rank, "row_start": info.row_start,
                               "row_end": info.row_end, "rows": entry, "optim": entry})
        tables[name] = {"num_rows": num_rows, "dim": dim, "shards": shards}
    write_manifest(directory, {"step": 2, "world_size": 2, "tables": tables})
    for step in (3, 4):
        feed(store, push(step, [12, 19]))
        feed(store, push(step, [1], table="small", dim=2))
    return store, directory


def test_an_intact_checkpoint_restores(saved: tuple[Store, Path]) -> None:
    store, directory = saved
    tables = store.register(RUN, 1, 2, 1, [EMB, SMALL], ADAM, restore=(str(directory), 2),
                       run_secret=SECRET)
    assert {t.name: t.last_step for t in tables} == {"emb": 2, "small": 2}


def flip_tensor_bytes(path: Path, name: str = "v", n: int = 64) -> None:
    """Flip n bytes inside tensor `name`'s data of a shard file: same size, the zip
    still reads (its records are not checksummed on load), only the values change."""
    data = bytearray(path.read_bytes())
    tensor = torch.load(path, weights_only=True)["tensors"][name]
    raw = tensor.contiguous().numpy().tobytes()
    at = data.find(raw)
    assert at >= 0, "tensor bytes not found in the file"
    n = min(n, len(raw))
    data[at:at + n] = bytes(b ^ 0x5A for b in data[at:at + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "garbage"])
def test_a_damaged_optim_file_is_refused_and_nothing_changes(
        saved: tuple[Store, Path], damage: str) -> None:
    store, directory = saved
    victim = directory / optim_file("small", 1)
    if damage == "flip":  # same size, manifest intact: only the crc32 tells
        flip_tensor_bytes(victim)
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
    elif damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(os.urandom(victim.stat().st_size))
    before = state(store)
    incarnation = store.partition(RUN, 1).incarnation  # type: ignore[union-attr]
    with pytest.raises(CorruptCheckpoint, match=str(victim)):
        store.register(RUN, 1, 2, 5, [EMB, SMALL], ADAM, restore=(str(directory), 2),
                       run_secret=SECRET)
    assert_same_state(before, state(store))
    assert store.partition(RUN, 1).incarnation == incarnation  # type: ignore[union-attr]
    assert store.stats().refusals.get("corrupt_checkpoint") == 1


def test_a_damaged_file_of_another_rank_read_for_a_reshard_is_refused(
        saved: tuple[Store, Path]) -> None:
    """World 1 re-shards: rank 0 reads both ranks' files; a flip in rank 1's is caught
    before the run's partitions are dropped."""
    store, directory = saved
    flip_tensor_bytes(directory / optim_file("emb", 1))
    whole = [TableSpec("emb", 20, DIM, 0, 20), TableSpec("small", 5, 2, 0, 5)]
    with pytest.raises(CorruptCheckpoint, match=r"emb\.r00001\.pt"):
        store.register(RUN, 0, 1, 7, whole, ADAM, restore=(str(directory), 2),
                       run_secret=SECRET)
    assert {p.rank for p in store.partitions()} == {0, 1}  # nothing dropped


def test_a_damaged_manifest_is_refused(saved: tuple[Store, Path]) -> None:
    store, directory = saved
    manifest = directory / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"row_end": 10', '"row_end": 11', 1))  # still JSON
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        store.register(RUN, 1, 2, 5, [EMB, SMALL], ADAM, restore=(str(directory), 2),
                       run_secret=SECRET)


# -- the state budget and impossible shapes --------------------------------------------

def test_max_state_bytes_refuses_with_the_sizes_and_allocates_nothing() -> None:
    per_row = 2 + 8 * DIM  # m, v; the touched and changed flags
    store = Store(max_state_bytes=15 * per_row)
    store.register(RUN, 1, 2, 0, [EMB], ADAM)  # 10 rows
    with pytest.raises(ResourceExhausted) as info:
        store.register("other", 0, 1, 0, [TableSpec("emb", 6, DIM, 0, 6)], ADAM)
    text = str(info.value)
    assert f"needs {6 * per_row} bytes" in text and f"{10 * per_row} bytes" in text
    assert f"limit of {15 * per_row} bytes" in text and "--max-state-bytes" in text
    assert [p.run_id for p in store.partitions()] == [RUN]
    store.register("other", 0, 1, 0, [TableSpec("emb", 5, DIM, 0, 5)], ADAM)  # fits exactly
    assert store.stats().max_state_bytes == 15 * per_row


@pytest.mark.parametrize("spec", [
    TableSpec("emb", 2**62, DIM, 0, 2**62),
    TableSpec("emb", 2**62, DIM, 0, 10),
    TableSpec("emb", 20, -4, 0, 20),
    TableSpec("emb", 20, 2**40, 0, 20),
    TableSpec("emb", 20, DIM, 10, 30),
    TableSpec("emb", 20, DIM, -5, 5),
    TableSpec("emb", -20, DIM, 0, 0),
])
def test_impossible_shapes_are_invalid_not_internal(spec: TableSpec) -> None:
    store = Store(max_state_bytes=2**40)
    with pytest.raises(InvalidArgument, match="emb"):
        store.register(RUN, 0, 1, 0, [spec], ADAM)
    assert store.partitions() == []


def test_a_huge_but_possible_table_is_resource_exhausted() -> None:
    store = Store(max_state_bytes=2**30)
    with pytest.raises(ResourceExhausted, match="nothing was allocated"):
        store.register(RUN, 0, 1, 0, [TableSpec("emb", 2**40, 128, 0, 2**40)], ADAM)


# -- the partition secret (round 2 wires it into the messages) --------------------------

def test_each_register_hands_out_a_new_secret_checked_in_constant_time() -> None:
    store = Store()
    store.register(RUN, 1, 2, 0, [EMB], ADAM)
    first = store.secret(RUN, 1)
    assert len(first) >= 32  # 128 bits, hex
    assert store.check_secret(RUN, 1, first, "push") is store.partition(RUN, 1)
    for wrong in ("", first[:-1] + ("0" if first[-1] != "0" else "1"), "x" * 32):
        with pytest.raises(WrongSecret):
            store.check_secret(RUN, 1, wrong, "push")
    store.register(RUN, 1, 2, 1, [EMB], ADAM)  # a restarted process registers again
    assert store.secret(RUN, 1) != first
    with pytest.raises(WrongSecret):
        store.check_secret(RUN, 1, first, "push")
    with pytest.raises(NotRegistered):
        store.check_secret(RUN, 0, first, "push")


# -- freeing runs ------------------------------------------------------------------------

def test_runs_over_are_freed_after_the_retention_and_counted() -> None:
    now = [0.0]
    store = Store(clock=lambda: now[0])
    tracker = RunTracker(clock=lambda: now[0], abort_grace_s=60)
    reaper = RunReaper(store, tracker, retention_s=600)
    for run in ("done", "live"):
        store.register(run, 0, 1, 0, [TableSpec("emb", 20, DIM, 0, 20)], ADAM)
        tracker.registered(run, 0)
    tracker.finish("done", 0, -1, False, "")
    now[0] = 599
    reaper.tick()
    assert {p.run_id for p in store.partitions()} == {"done", "live"}
    now[0] = 600
    reaper.tick()
    assert {p.run_id for p in store.partitions()} == {"live"}
    stats = store.stats()
    assert (stats.runs_freed, stats.partitions_freed) == (1, 1)
    assert reaper.drop("live", "admin") == (1, 20 * (2 + 8 * DIM))
    assert store.stats().runs_freed == 2 and store.partitions() == []
    assert tracker.snapshot() == []


def test_an_aborted_finish_does_not_end_a_run_torchrun_restarts() -> None:
    """Rank 1 fails (Finish aborted), torchrun SIGTERMs rank 0 (aborted too) and starts
    both again: they register within the grace, so the run is never over."""
    over: list[str] = []
    now = [0.0]
    tracker = RunTracker(lambda run, why: over.append(why), clock=lambda: now[0],
                         abort_grace_s=60)
    for rank in (0, 1):
        tracker.registered("r", rank)
        tracker.stream_opened("r", rank)
    tracker.stream_closed("r", 1)
    assert tracker.finish("r", 1, 12, True, "error")[2] is False
    tracker.stream_closed("r", 0)
    assert tracker.finish("r", 0, 12, True, "SIGTERM")[2] is False  # every rank aborted
    now[0] = 40.0
    tracker.recheck("r")
    assert over == []
    for rank in (0, 1):  # the restarted ranks
        tracker.registered("r", rank)
    now[0] = 90.0  # 60 s after the aborts, but only 50 s after the new Registers
    tracker.recheck("r")
    assert over == [] and tracker.status("r").state == "active"  # type: ignore[union-attr]
    now[0] = 150.0  # they never streamed nor finished: 60 s after their Register
    tracker.recheck("r")
    assert over == []  # no rank aborted in this incarnation: the abandoned rule's job
    tracker.finish("r", 0, 19, False, "")
    tracker.finish("r", 1, 19, False, "")
    assert over == ["every rank finished"]


def test_an_aborted_run_nobody_restarts_is_over_after_the_grace() -> None:
    over: list[str] = []
    now = [0.0]
    tracker = RunTracker(lambda run, why: over.append(why), clock=lambda: now[0],
                         abort_grace_s=60)
    tracker.registered("r", 0)
    tracker.finish("r", 0, 3, True, "error")
    now[0] = 59.0
    tracker.recheck("r")
    assert over == []
    now[0] = 60.0
    tracker.recheck("r")
    assert len(over) == 1 and "no rank registered again within 60s" in over[0]
    assert tracker.status("r").state == "aborted"  # type: ignore[union-attr]


# -- Flush timeouts -----------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 1e9])
def test_flush_timeout_must_be_finite(timeout: float) -> None:
    async def go() -> None:
        store = Store()
        store.register(RUN, 1, 2, 0, [EMB], ADAM)
        core = ShardCore(store, update_threads=1)
        try:
            with pytest.raises(InvalidArgument, match="timeout_s"):
                await core.flush(RUN, 1, 5, timeout)
        finally:
            core.shutdown()

    asyncio.run(go())


# -- the arena sweep ----------------------------------------------------------------------

def test_sweep_removes_only_old_arenas_of_dead_creators_of_this_user(tmp_path: Path) -> None:
    dead, live = 999_999_999, os.getpid()
    old = time.time() + 3600  # "now" an hour later: every file is old enough
    names = {
        "dead": f"hybridps-{dead}-r0-0123456789abcdef.arena",
        "live": f"hybridps-{live}-r1-0123456789abcdef.arena",
        "other": f"something-{dead}-r0-0123456789abcdef.arena",
        "dead2": f"hybridps-{dead}-r3-fedcba9876543210.arena",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 64)
    (tmp_path / f"hybridps-{dead}-r5-00.arena").symlink_to(tmp_path / names["live"])
    removed = sweep_dead_arenas(str(tmp_path), now=old)
    assert sorted(Path(p).name for p in removed) == sorted([names["dead"], names["dead2"]])
    assert (tmp_path / names["live"]).exists() and (tmp_path / names["other"]).exists()
    assert (tmp_path / f"hybridps-{dead}-r5-00.arena").is_symlink()  # never follows links
    young = tmp_path / names["dead"]
    young.write_bytes(b"\0")
    assert sweep_dead_arenas(str(tmp_path)) == []  # just created: its Register may be on
    assert sweep_dead_arenas(str(tmp_path), uid=os.getuid() + 1, now=old) == []  # not ours
    assert [Path(p).name for p in sweep_dead_arenas(str(tmp_path), now=old)] == [names["dead"]]


# -- a finite gradient whose update overflows ---------------------------------------------

@pytest.fixture(params=["native", "torch"])
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    import hybridps.optim as optim
    from hybridps import native

    if request.param == "native" and native.ext is None:
        pytest.skip(f"native kernels not built: {native.load_error}")
    previous = optim.kernel_name()
    optim.set_kernel(request.param)
    yield request.param
    optim.set_kernel(previous)


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_a_push_whose_update_overflows_is_refused_with_nothing_changed(
        kernel: str, kind: str, row_dtype: torch.dtype) -> None:
    from hybridps.errors import NonFiniteUpdate
    from hybridps.optim import OptimizerSpec

    spec = OptimizerSpec(kind, lr=1e30 if kind == "sgd" else 0.1)
    store = Store()
    store.register(RUN, 1, 2, 0, [EMB], spec, row_dtype=row_dtype)
    if row_dtype != torch.float32:
        store.seed_rows(RUN, 1, 0, "emb", 10, torch.randn(10, DIM))
    for step in range(2):
        feed(store, push(step, list(range(10, 20))))
    before = state(store)
    part = store.partition(RUN, 1)
    assert part is not None
    master = None if part.tables["emb"].master is None else part.tables["emb"].master.clone()
    grads = torch.randn(3, DIM)
    grads[1, 2] = 3e38  # finite; its square is not (sgd: lr 1e30 times it is not)
    with pytest.raises(NonFiniteUpdate, match="refused, nothing changed"):
        feed(store, push(2, [11, 14, 17], grads=grads))
    assert_same_state(before, state(store))
    if master is not None:
        assert torch.equal(master, part.tables["emb"].master)  # type: ignore[arg-type]
    assert store.stats().refusals == {"non_finite_update": 1}
    answer = feed(store, push(2, [11, 14, 17]))  # the same step, sane: applied
    assert answer is not None and bool(torch.isfinite(answer.delta.float()).all())


def test_master_rows_that_would_overflow_are_refused(kernel: str) -> None:
    """m, v and the delta stay finite; master + delta does not: everything is put back."""
    from hybridps.errors import NonFiniteUpdate
    from hybridps.optim import OptimizerSpec

    store = Store()
    store.register(RUN, 1, 2, 0, [EMB], OptimizerSpec("sgd", lr=1.0), row_dtype=torch.bfloat16)
    store.seed_rows(RUN, 1, 0, "emb", 10, torch.full((10, DIM), 3e38))
    before = state(store)
    part = store.partition(RUN, 1)
    assert part is not None and part.tables["emb"].master is not None
    master = part.tables["emb"].master.clone()
    with pytest.raises(NonFiniteUpdate, match="master rows"):
        feed(store, push(0, [12], grads=torch.full((1, DIM), -3e38)))
    assert_same_state(before, state(store))
    assert torch.equal(master, part.tables["emb"].master)
