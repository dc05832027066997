"""A server partition's checkpoint is a snapshot of its step (ps/core/checkpoint.py
`snapshot_partition`): the state is copied under the partition's lock and written without
it, so a push of the next step applies while the files are written and never reaches them;
deferred (the two-step Checkpoint), the server answers at the copy and hands over the files,
or the write's error, once written (`ShardCore.checkpoint_done`)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import read_shard
from hybridps.errors import Conflict, InvalidArgument, NotFound, ShardError
from hybridps.optim import OptimizerSpec
from ps.core.checkpoint import PartitionSnapshot, snapshot_partition
from ps.core.faults import WRITE_FAULT_ENV, write_fault
from ps.core.partition import PushChunk, TableSpec
from ps.core.shard_core import ShardCore
from ps.core.store import Store


def _push(store: Store, step: int, ids: list[int]) -> None:
    gen = torch.Generator().manual_seed(step)
    grads = torch.randn(len(ids), 4, generator=gen)
    store.open_session().feed(PushChunk("run", 0, 0, step, "t", torch.tensor(ids), grads))


def _store() -> Store:
    store = Store()
    store.register("run", 0, 1, 0, [TableSpec("t", 10, 4, 0, 10)], OptimizerSpec())
    for step in range(3):
        _push(store, step, [1, 2, 7])
    return store


def _state(store: Store) -> tuple[torch.Tensor, torch.Tensor]:
    t = store.partition("run", 0).tables["t"]  # type: ignore[union-attr]
    assert t.m is not None and t.v is not None
    return t.m.clone(), t.v.clone()


def _saved(directory: Path) -> dict[str, object]:
    return read_shard(directory / "optim" / "t.r00000.pt")


def test_the_snapshot_is_the_step_it_was_taken_at(tmp_path: Path) -> None:
    store = _store()
    m2, v2 = _state(store)
    part = store.partition("run", 0)
    assert part is not None
    with part.lock:
        snapshot = snapshot_partition(part, 2)
    assert snapshot.nbytes == 2 * 10 * 4 * 4  # m and v of 10 rows x 4
    _push(store, 3, [2, 7])  # the next step applies
    assert not torch.equal(_state(store)[0], m2)
    snapshot.write(tmp_path)
    saved = _saved(tmp_path)
    assert torch.equal(saved["tensors"]["m"], m2) and torch.equal(saved["tensors"]["v"], v2)
    assert saved["meta"]["last_step"] == 2 and saved["meta"]["adam_step"] == 3


def test_a_push_applies_while_the_server_writes_a_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    m2, _ = _state(store)
    writing, release = threading.Event(), threading.Event()
    write = PartitionSnapshot.write

    def slow_write(self: PartitionSnapshot, *args: object, **kwargs: object) -> object:
        writing.set()
        assert release.wait(20)
        return write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PartitionSnapshot, "write", slow_write)
    saver = threading.Thread(target=store.checkpoint, args=("run", [0], 2, str(tmp_path)))
    saver.start()
    assert writing.wait(20)
    pusher = threading.Thread(target=_push, args=(store, 3, [1, 2]))
    pusher.start()
    pusher.join(10)
    assert not pusher.is_alive(), "the push waited for the checkpoint's write"
    release.set()
    saver.join(20)
    assert store.partition("run", 0).tables["t"].last_step == 3  # type: ignore[union-attr]
    assert torch.equal(_saved(tmp_path)["tensors"]["m"], m2)


# -- the two-step Checkpoint (ShardCore: `deferred`, then `checkpoint_done`) -----------------

def _blocked_write(monkeypatch: pytest.MonkeyPatch, fail: bool = False
                   ) -> tuple[threading.Event, threading.Event]:
    writing, release = threading.Event(), threading.Event()
    write = PartitionSnapshot.write

    def slow_write(self: PartitionSnapshot, *args: object, **kwargs: object) -> object:
        writing.set()
        assert release.wait(20)
        if fail:
            raise OSError(28, "No space left on device")
        return write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PartitionSnapshot, "write", slow_write)
    return writing, release


def test_a_deferred_checkpoint_answers_at_its_snapshot_and_confirms_the_files_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    m2, v2 = _state(store)
    writing, release = _blocked_write(monkeypatch)

    async def scenario() -> None:
        core = ShardCore(store, update_threads=2)
        try:
            files, snapshot_bytes = await asyncio.wait_for(
                core.checkpoint("run", [0], 2, str(tmp_path), deferred=True), 10)
            assert files == [] and snapshot_bytes == 2 * 10 * 4 * 4
            assert await asyncio.to_thread(writing.wait, 10)  # the write is in progress
            await asyncio.to_thread(_push, store, 3, [1, 2])  # the next step applies
            done = asyncio.ensure_future(core.checkpoint_done("run", [0], 2, str(tmp_path)))
            await asyncio.sleep(0.3)
            assert not done.done(), "confirmed before the files were written"
            assert not (tmp_path / "optim" / "t.r00000.pt").exists()
            release.set()
            saved = await asyncio.wait_for(done, 10)
            assert [(rank, info.table, info.file) for rank, info in saved] == [
                (0, "t", "optim/t.r00000.pt")]
            again = await core.checkpoint_done("run", [0], 2, str(tmp_path))  # a retry
            assert again == saved
            with pytest.raises(NotFound, match=r"step 1 .*its last one of these ranks: step 2"):
                await core.checkpoint_done("run", [0], 1, str(tmp_path))
        finally:
            release.set()
            core.shutdown()

    asyncio.run(scenario())
    saved = _saved(tmp_path)
    assert torch.equal(saved["tensors"]["m"], m2) and torch.equal(saved["tensors"]["v"], v2)
    assert saved["meta"]["last_step"] == 2
    assert store.partition("run", 0).tables["t"].last_step == 3  # type: ignore[union-attr]


def test_a_failed_deferred_write_is_the_answer_of_checkpoint_done_and_no_parent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    _, release = _blocked_write(monkeypatch, fail=True)
    release.set()

    async def scenario() -> None:
        core = ShardCore(store, update_threads=2)
        try:
            await core.checkpoint("run", [0], 2, str(tmp_path), deferred=True)
            with pytest.raises(ShardError, match="No space left on device"):
                await core.checkpoint_done("run", [0], 2, str(tmp_path))
            await asyncio.to_thread(_push, store, 3, [1, 2])
            with pytest.raises(Conflict, match="write a full one"):  # never a parent
                await core.checkpoint("run", [0], 3, str(tmp_path / "s3"), since=2,
                                      deferred=True)
        finally:
            core.shutdown()

    asyncio.run(scenario())
    assert not (tmp_path / "optim" / "t.r00000.pt").exists()


def test_the_write_fault_sleeps_or_fails_at_its_step_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRITE_FAULT_ENV, "3:fail")
    write_fault(2)
    with pytest.raises(OSError, match="injected"):
        write_fault(3)
    monkeypatch.setenv(WRITE_FAULT_ENV, "3:sleep=0.2")
    started = time.perf_counter()
    write_fault(3)
    assert time.perf_counter() - started >= 0.2
    monkeypatch.setenv(WRITE_FAULT_ENV, "3:slow")
    with pytest.raises(InvalidArgument, match="'3:slow'"):
        write_fault(3)


def test_the_first_checkpoint_takes_no_memory_its_register_was_not_granted() -> None:
    # The changed flags (one byte a row) are allocated at the first checkpoint; the Register
    # reserves them, so a server filled to its budget stays within it once checkpointed.
    spec = TableSpec("t", 1000, 4, 0, 1000)
    need = spec.state_bytes("adam", master=False)
    store = Store(max_state_bytes=need)
    store.register("run", 0, 1, 0, [spec], OptimizerSpec())
    part = store.partition("run", 0)
    assert part is not None
    before = part.state_bytes
    assert before == need == part.budget_bytes
    _push(store, 0, [1, 2, 7])
    with part.lock:
        snapshot_partition(part, 0)
    assert part.tables["t"].changed is not None  # allocated now, counted from the start
    assert part.state_bytes == before == part.budget_bytes <= need
    with pytest.raises(ShardError, match="state"):  # and the budget is full, exactly
        store.register("other", 0, 1, 0, [TableSpec("u", 1, 4, 0, 1)], OptimizerSpec())
