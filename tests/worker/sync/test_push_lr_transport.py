"""Push.lr through the transport layers: a push's own learning rate travels in every message
of it (inline chunks, shared-memory headers, PushBatch entries), survives a re-send after a
reconnect (inline and by reference, and a by-reference push demoted to inline), and the
server applies push t with it (tests/worker/tasks/kge/test_kge_push_lr.py checks the math in the
core).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from hybridps.errors import InvalidArgument
from hybridps.optim import OptimizerSpec, apply_rows_torch_
from hybridps.v1 import shard_pb2
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from ps.edge.sync_codec import decode_request, request_chunks
from tests.testing.helpers import start_ps_server
from tests.worker.sync.test_sync import FakeRpc, FakeShard, break_at, client, steps
from worker.embedding.rows import TableConfig
from worker.sync.arena import ArenaPlacement
from worker.sync.client import ShardClient
from worker.sync.ledger import SyncLedger
from worker.sync.messages import InlinePush, PushEncoder, serialized
from worker.updates.source import SyncStats

ROWS, DIM = 600, 16
SPEC = OptimizerSpec("adam", lr=1e-2)
SCHEDULE = [0.001, 0.004, 0.01, 0.03, 0.03, 0.003, 0.0, 0.02]  # warm-up, cuts, a zero


def _lrs_of(messages: list[bytes]) -> list[tuple[int, str, float | None]]:
    """(step, table, lr) of every push in serialized SyncRequests (batch entries too)."""
    out = []
    for message in messages:
        request = shard_pb2.SyncRequest.FromString(message)
        pushes = (list(request.batch.pushes) if request.WhichOneof("kind") == "batch"
                  else [request.push])
        out += [(p.step, p.table, p.lr if p.HasField("lr") else None) for p in pushes]
    return out


# -- the worker's messages and ledger ---------------------------------------------------------

def test_every_chunk_of_an_inline_push_carries_its_lr() -> None:
    encoder = PushEncoder("r", 0, 1, torch.float32, torch.float32)
    messages = encoder.inline(3, "a", torch.arange(40), torch.ones(40, 8), 400, lr=0.25)
    assert len(messages) > 1
    assert _lrs_of(messages) == [(3, "a", 0.25)] * len(messages)
    unset = encoder.inline(3, "a", torch.arange(40), torch.ones(40, 8), 400)
    assert _lrs_of(unset) == [(3, "a", None)] * len(unset), "no lr: unset (the registered lr)"


def test_a_by_reference_push_keeps_its_lr_on_resend_and_when_demoted() -> None:
    """Sent in a PushBatch, re-sent stamped with a new epoch, then demoted to inline
    messages (the server lost the arena): the lr is the one it was pushed with."""
    placement = ArenaPlacement("on", 1 << 20, rank=0, address="x")
    assert placement.offer(first=True) is not None
    try:
        assert placement.accept(shard_pb2.SharedMemoryStatus(accepted=True, epoch=2), True)
        encoder = PushEncoder("r", 0, 1, torch.float32, torch.float32)
        ledger = SyncLedger(["a", "b"], {"a": DIM, "b": DIM}, torch.float32, SyncStats(), "x")
        for step, lr in ((0, 0.5), (1, None)):
            pushes = []
            for table in ("a", "b"):
                slot = placement.place(torch.arange(5), torch.ones(5, DIM), torch.float32,
                                       torch.float32, f"step {step}")
                assert slot is not None
                pushes.append((table, encoder.by_reference(step, table, slot, lr)))
            sent = ledger.add_step(step, pushes, placement.epoch)
            assert _lrs_of(serialized(sent)) == [(step, "a", lr), (step, "b", lr)]
        expected = [(0, "a", 0.5), (0, "b", 0.5), (1, "a", None), (1, "b", None)]
        resent = serialized(ledger.resend(epoch=7))
        assert _lrs_of(resent) == expected
        assert {shard_pb2.SyncRequest.FromString(m).push.shm.epoch for m in resent} == {7}

        def encode(step: int, table: str, ids: torch.Tensor, grads: torch.Tensor,
                   lr: float | None) -> InlinePush:
            return InlinePush(lambda: encoder.inline(step, table, ids, grads, 1 << 20, lr))

        ledger.demote(encode)
        demoted = serialized(ledger.resend(epoch=0))
        assert _lrs_of(demoted) == expected
        assert all(shard_pb2.SyncRequest.FromString(m).push.WhichOneof("data") == "chunk"
                   for m in demoted)
    finally:
        placement.close()


class LrShard(FakeShard):
    """A FakeShard that records the lr of every push message it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.lrs: list[tuple[int, str, float | None]] = []

    def handle(self, message: bytes) -> list[bytes]:
        self.lrs += _lrs_of([message])
        return super().handle(message)


@pytest.mark.parametrize("moment", [("send", 5), ("receive", 2)])
def test_pushes_resent_after_a_reconnect_carry_their_lr(moment: tuple[str, int]) -> None:
    shard = LrShard()
    rpc = FakeRpc(shard, break_at(moment))
    c = client(rpc)
    c.start()
    try:
        for step, grads in enumerate(steps(6)):
            c.push(step, grads, lr=SCHEDULE[step])
            if step:
                c.take(step - 1)
        c.take(5)
    finally:
        c.close()
    assert c.stats.reconnects == 1
    second = rpc.transports[1].attempted
    assert second, "something was re-sent on the new connection"
    assert all(lr == SCHEDULE[step] for step, _, lr in _lrs_of(second))
    assert shard.lrs and all(lr == SCHEDULE[step] for step, _, lr in shard.lrs)
    assert {(step, table) for step, table, _ in shard.lrs} == {
        (step, table) for step in range(6) for table in ("a", "b")}


# -- the server's decoding and assembly --------------------------------------------------------

def test_the_server_decodes_push_lr_and_unset_is_the_registered_lr() -> None:
    encoder = PushEncoder("r", 0, 1, torch.float32, torch.float32)
    for lr in (0.125, None):
        (message,) = encoder.inline(0, "a", torch.arange(3), torch.ones(3, 4), 1 << 20, lr)
        framed = decode_request(message)
        assert framed.error is None
        (chunk,) = request_chunks(framed)
        assert chunk.lr == lr


def _store() -> Store:
    store = Store(server_id="test")
    store.register("run", 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)], SPEC)
    return store


def test_chunks_of_one_push_must_carry_the_same_lr() -> None:
    """A chunked push is applied at once with its lr; a chunk whose lr differs from chunk
    0's refuses the push, which changes nothing."""
    ids, grads = torch.arange(10), torch.ones(10, DIM)
    store = _store()
    session = store.open_session()
    assert session.feed(PushChunk("run", 0, 0, 0, "emb", ids[:5], grads[:5], 0, 2,
                                  lr=0.5)) is None
    with pytest.raises(InvalidArgument, match=r"lr=None differs from lr=0.5 of chunk 0"):
        session.feed(PushChunk("run", 0, 0, 0, "emb", ids[5:], grads[5:], 1, 2))
    session = store.open_session()
    assert session.feed(PushChunk("run", 0, 0, 0, "emb", ids[:5], grads[:5], 0, 2,
                                  lr=0.5)) is None
    answer = session.feed(PushChunk("run", 0, 0, 0, "emb", ids[5:], grads[5:], 1, 2, lr=0.5))
    assert answer is not None and answer.step == 0, "the refused push applied nothing"
    m, v = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    ref, _ = apply_rows_torch_(dataclasses.replace(SPEC, lr=0.5), m, v, ids, grads, 1)
    torch.testing.assert_close(answer.delta, ref, rtol=1e-6, atol=1e-9)


# -- against a real server ----------------------------------------------------------------------

def _steps(n: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(n):
        step = {}
        for name in ("t", "u"):
            ids = torch.randperm(ROWS, generator=g)[: ROWS // 2].sort().values
            step[name] = (ids, torch.randn(len(ids), DIM, generator=g))
        out.append(step)
    return out


def _reference(data: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
               lrs: list[float]) -> dict[tuple[int, str], torch.Tensor]:
    """fp32 sparse Adam, step t at lrs[t]."""
    out = {}
    for name in ("t", "u"):
        m, v = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
        for t, step in enumerate(data):
            ids, grads = step[name]
            spec = dataclasses.replace(SPEC, lr=lrs[t])
            out[(t, name)], _ = apply_rows_torch_(spec, m, v, ids, grads, t + 1)
    return out


def _client(address: str, **kwargs: object) -> ShardClient:
    kwargs.setdefault("shm_bytes", 8 << 20)
    kwargs.setdefault("max_chunk_bytes", 64 * 1024)
    return ShardClient(address, run_id=f"lr-{os.urandom(4).hex()}", rank=0, world_size=1,
                       tables=[TableConfig("t", ROWS, DIM), TableConfig("u", ROWS, DIM)],
                       ranges={"t": (0, ROWS), "u": (0, ROWS)}, optimizer=SPEC,
                       timeout_s=60.0, **kwargs)  # type: ignore[arg-type]


def _check_run(c: ShardClient) -> None:
    data = _steps(len(SCHEDULE))
    c.start()
    try:
        for step, grads in enumerate(data):
            c.push(step, grads, lr=SCHEDULE[step])
        updates, _ = c.take(len(SCHEDULE) - 1)
    finally:
        c.close()
    assert sorted((u.step, u.table) for u in updates) == sorted(_reference(data, SCHEDULE))
    ref, registered = _reference(data, SCHEDULE), _reference(data, [SPEC.lr] * len(SCHEDULE))
    for u in updates:
        key = (u.step, u.table)
        torch.testing.assert_close(u.delta_UD, ref[key], rtol=1e-5, atol=1e-9)
        if SCHEDULE[u.step] != SPEC.lr:
            assert not torch.allclose(u.delta_UD, registered[key]), "applied at its own lr"


@pytest.mark.e2e
@pytest.mark.parametrize(("route", "kwargs"), [
    ("stream", {}),
    ("stream", {"max_chunk_bytes": 8 * 1024}),  # every push in several chunks
    ("stream", {"shm": "on"}),  # by reference, in PushBatches
])
def test_the_server_applies_each_push_at_its_lr(ps_address: str, route: str,
                                                kwargs: dict[str, object]) -> None:
    c = _client(ps_address, **kwargs)
    _check_run(c)
    assert c.stats.transport == route
    if kwargs.get("shm") == "on":
        assert c.stats.shm_pushes == 2 * len(SCHEDULE) and c.stats.shm_batches > 0
    if "max_chunk_bytes" in kwargs:
        assert c.stats.push_chunks > 2 * len(SCHEDULE)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["off", "on"])
def test_pushes_resent_after_a_cut_are_applied_at_their_lr(tmp_path: Path, shm: str) -> None:
    """The connection is cut with pushes in flight: the re-sent ones the server had not
    applied are applied at their own lr (inline, and by reference into the arena)."""
    from tests.worker.train.test_worker_e2e import FaultProxy

    with start_ps_server(tmp_path) as server:
        # inline: ~40 kB a step; by reference: a few hundred bytes a step
        proxy = FaultProxy((server.host, server.port), after=100_000 if shm == "off" else 2_000,
                           mode="drop")
        try:
            c = _client(f"127.0.0.1:{proxy.port}", shm=shm)
            _check_run(c)
        finally:
            proxy.close()
    assert proxy.tripped, f"the proxy never cut ({proxy.forwarded} bytes forwarded)"
    assert c.stats.reconnects >= 1 and c.stats.shm == shm
