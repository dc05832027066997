"""A server partition's checkpoint is a snapshot of its step (ps/core/checkpoint.py
`snapshot_partition`): the state is copied under the partition's lock and written without
it, so a push of the next step applies while the files are written and never reaches them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import read_shard
from hybridps.optim import OptimizerSpec
from ps.core.checkpoint import PartitionSnapshot, snapshot_partition
from ps.core.partition import PushChunk, TableSpec
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
