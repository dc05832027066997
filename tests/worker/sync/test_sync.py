"""The shard client's bookkeeping against fake transports: no server, no network.

`FakeShard` answers pushes the way the shard server does where exactly-once is
concerned (a push applied once, a re-sent one answered from a cache, answers in chunks);
`FakeTransport` carries messages to it and can break; `FakeRpc` stands in for the calls.
ShardClient (worker/sync/client.py) and SyncLedger (worker/sync/ledger.py) run unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from hybridps import wire
from hybridps.optim import OptimizerSpec
from hybridps.v1 import shard_pb2
from worker.embedding.rows import TableConfig
from worker.sync.arena import ArenaPlacement
from worker.sync.client import ServerRefused, ServerUnavailable, ShardClient
from worker.sync.ledger import SyncLedger
from worker.sync.messages import InlinePush, Outgoing, PushEncoder, serialized
from worker.sync.transport import (
    Response,
    SyncTransport,
    TransportError,
    TransportRefused,
    TransportRetryable,
    decode_response,
)
from worker.updates.source import SyncStats

pytestmark = pytest.mark.timeout(60)

DIM = 4
TABLES = [TableConfig("a", 100, DIM), TableConfig("b", 50, DIM)]
UPDATE_IDS, UPDATE_DELTA = ("update", "chunk", "ids"), ("update", "chunk", "delta")


class FakeShard:
    """Per table: the last step applied and the answers so far; deltas are -grads * step
    so every answer is distinct. Answers of more than `rows_per_chunk` rows come in
    several chunks."""

    def __init__(self, rows_per_chunk: int = 3) -> None:
        self.rows_per_chunk = rows_per_chunk
        self.last_step: dict[str, int] = {}
        self.answers: dict[tuple[int, str], list[bytes]] = {}
        self.applied: list[tuple[int, str]] = []
        self._parts: dict[tuple[int, str], list[shard_pb2.Push]] = {}
        self._tensors: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def handle(self, message: bytes) -> list[bytes]:
        framed = wire.decode_framed(shard_pb2.SyncRequest, message,
                                    (("push", "chunk", "ids"), ("push", "chunk", "grads")))
        assert framed.error is None, framed.error
        push = framed.message.push
        key = (push.step, push.table)
        self._tensors.setdefault(key, []).append((framed.tensor("ids", "p").clone(),
                                                  framed.tensor("grads", "p").clone()))
        if push.chunk.index + 1 < push.chunk.count:
            return []
        parts = self._tensors.pop(key)
        if key in self.answers:  # applied before: the saved answer, marked duplicate
            return [self._duplicate(m) for m in self.answers[key]]
        assert push.step == self.last_step.get(push.table, -1) + 1, f"{key} out of order"
        self.last_step[push.table] = push.step
        self.applied.append(key)
        ids = torch.cat([i for i, _ in parts])
        delta = -torch.cat([g for _, g in parts]).float() * (push.step + 1)
        out = []
        bounds = list(wire.chunk_bounds(int(ids.shape[0]), self.rows_per_chunk))
        for index, (lo, hi) in enumerate(bounds):
            update = shard_pb2.Update(step=push.step, table=push.table, decay=1.0,
                                      chunk=shard_pb2.InlineAnswer(index=index,
                                                                   count=len(bounds)))
            out.append(wire.encode_framed(shard_pb2.SyncResponse(update=update),
                                          [(UPDATE_IDS, ids[lo:hi]),
                                           (UPDATE_DELTA, delta[lo:hi])]))
        self.answers[key] = out
        return out

    @staticmethod
    def _duplicate(message: bytes) -> bytes:
        response = decode_response(message)
        update = response.message.update
        update.duplicate = True
        return wire.encode_framed(shard_pb2.SyncResponse(update=update),
                                  [(UPDATE_IDS, response.tensor("ids", "u")),
                                   (UPDATE_DELTA, response.tensor("delta", "u"))])


class FakeTransport(SyncTransport):
    """Delivers each message to the shard at once; `fail` decides, per call, to break
    (before a send, or before a receive: the answers not yet read are lost)."""

    name = "stream"

    def __init__(self, shard: FakeShard, fail: Callable[[str], TransportError | None]) -> None:
        self.shard, self.fail = shard, fail
        self.inbox: list[bytes] = []
        self.attempted: list[bytes] = []  # every message handed to send, delivered or not
        self.closed = False

    def send(self, messages: Sequence[Outgoing]) -> None:
        for message in serialized(messages):
            self.attempted.append(message)
            error = self.fail("send")
            if error is not None:
                raise error
            self.inbox += self.shard.handle(message)

    def receive(self, wait_s: float) -> list[Response]:
        error = self.fail("receive")
        if error is not None:
            self.inbox.clear()
            raise error
        out, self.inbox = self.inbox, []
        return [decode_response(m) for m in out]

    def close(self) -> None:
        self.closed = True


class FakeRpc:
    """ShardRpc's surface: Register answers from the shard's state; every call recorded."""

    def __init__(self, shard: FakeShard, fail: Callable[[str], TransportError | None],
                 register_fail: Callable[[int], TransportError | None] | None = None,
                 lose_state_after: int | None = None) -> None:
        self.shard, self.fail = shard, fail
        self.register_fail = register_fail or (lambda n: None)
        self.lose_state_after = lose_state_after  # registers after which the state is gone
        self.calls: list[str] = []
        self.transports: list[FakeTransport] = []
        self.registers = 0
        self.running = False
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.partition: tuple[str, int, str] | None = None
        self.max_receive_bytes = 1 << 20

    def bind_partition(self, run_id: str, rank: int, secret: str) -> None:
        self.partition = (run_id, rank, secret)

    def start(self) -> None:
        self.running = True

    def close(self, timeout_s: float = 0.0) -> None:
        self.running = False

    def call(self, method: str, request: Any, timeout_s: float,
             wait_for_ready: bool = False) -> Any:
        self.calls.append(method)
        if method == "Register":
            self.registers += 1
            error = self.register_fail(self.registers)
            if error is not None:
                raise error
            if self.lose_state_after is not None and self.registers > self.lose_state_after:
                self.shard.__init__(self.shard.rows_per_chunk)  # type: ignore[misc]
            response = shard_pb2.RegisterResponse(server_id="fake", max_message_bytes=1 << 20)
            for t in request.tables:
                last = self.shard.last_step.get(t.name, -1)
                response.tables.add(name=t.name, rows_held=t.row_end - t.row_start,
                                    last_step=last, created=last < 0)
            return response
        if method == "Finish":
            return shard_pb2.FinishResponse(ranks_registered=1, ranks_finished=1)
        if method == "Checkpoint":
            return shard_pb2.CheckpointResponse()
        if method == "CheckpointDone":
            return shard_pb2.CheckpointResponse()
        return shard_pb2.FlushResponse()

    call_any = call

    def open_stream(self) -> FakeTransport:
        self.calls.append("Sync")
        transport = FakeTransport(self.shard, self.fail)
        self.transports.append(transport)
        return transport


def never(where: str) -> TransportError | None:
    return None


def break_at(*moments: tuple[str, int]) -> Callable[[str], TransportError | None]:
    """Break the connection at the n-th send / receive (counted over the whole run)."""
    counts = {"send": 0, "receive": 0}

    def fail(where: str) -> TransportError | None:
        counts[where] += 1
        if (where, counts[where]) in moments:
            return TransportRetryable("UNAVAILABLE", f"cut at {where} {counts[where]}")
        return None

    return fail


def client(rpc: FakeRpc, timeout_s: float = 10.0) -> ShardClient:
    return ShardClient("fake:1", run_id="r", rank=0, world_size=1, tables=TABLES,
                       ranges={"a": (0, 100), "b": (0, 50)}, optimizer=OptimizerSpec(),
                       timeout_s=timeout_s, max_chunk_bytes=1 << 20, incarnation=1,
                       rpc=rpc)  # type: ignore[arg-type]


def steps(n: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        out.append({t.name: ((ids := torch.randperm(t.num_rows, generator=g)[:7].sort().values),
                             torch.randn(len(ids), DIM, generator=g)) for t in TABLES})
    return out


def train(rpc: FakeRpc, n: int = 6, staleness: int = 1, timeout_s: float = 10.0
          ) -> tuple[ShardClient, list[tuple[int, str, torch.Tensor, torch.Tensor]]]:
    """Push n steps, taking each step's updates `staleness` steps later, like the window."""
    c = client(rpc, timeout_s)
    c.start()
    got = []
    try:
        for step, grads in enumerate(steps(n)):
            c.push(step, grads)
            if step >= staleness:
                updates, _ = c.take(step - staleness)
                got += [(u.step, u.table, u.ids_U.clone(), u.delta_UD.clone()) for u in updates]
        updates, _ = c.take(n - 1)
        got += [(u.step, u.table, u.ids_U.clone(), u.delta_UD.clone()) for u in updates]
    finally:
        c.close()
    return c, got


def _push_key(message: bytes) -> tuple[int, str]:
    push = shard_pb2.SyncRequest.FromString(message).push
    return push.step, push.table


def same(a: list[tuple[int, str, torch.Tensor, torch.Tensor]],
         b: list[tuple[int, str, torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2] and torch.equal(x[2], y[2]) and torch.equal(x[3], y[3])
        for x, y in zip(a, b, strict=True))


# -- the client over fake transports -------------------------------------------------------

def test_unbroken_run_answers_every_push_once_in_order() -> None:
    shard = FakeShard()
    c, got = train(FakeRpc(shard, never))
    assert [(s, t) for s, t, _, _ in got] == [(s, t) for s in range(6) for t in ("a", "b")]
    assert shard.applied == [(s, t) for s in range(6) for t in ("a", "b")]
    assert c.stats.reconnects == 0 and c.stats.registers == 1
    assert c.stats.update_chunks == 6 * 2 * 3, "answers of 7 rows came in chunks of 3"


@pytest.mark.parametrize("moment", [("send", 5), ("send", 8), ("receive", 1), ("receive", 2)])
def test_broken_connection_resends_and_answers_equal_an_unbroken_run(
        moment: tuple[str, int]) -> None:
    """Cut before a push is sent or while answers are awaited (those in flight are lost):
    re-Register, re-send every unanswered push, the same answers in the same order; the
    shard applied each push once."""
    _, expected = train(FakeRpc(FakeShard(), never))
    shard = FakeShard()
    rpc = FakeRpc(shard, break_at(moment))
    c, got = train(rpc)
    assert same(got, expected)
    assert shard.applied == [(s, t) for s in range(6) for t in ("a", "b")]
    assert c.stats.reconnects == 1 and c.stats.registers == 2
    assert rpc.transports[0].closed and len(rpc.transports) == 2
    # A re-sent push is the bytes sent before (pushes are kept encoded).
    first, second = rpc.transports
    before = {_push_key(m): m for m in first.attempted}
    resent = [m for m in second.attempted if _push_key(m) in before]
    assert resent and all(m == before[_push_key(m)] for m in resent)


def test_partial_chunked_answer_is_dropped_on_reconnect() -> None:
    """A break in the middle of a chunked answer: the client drops the chunks it has and
    takes the whole re-sent answer (a duplicate from the shard's cache)."""
    shard = FakeShard(rows_per_chunk=3)
    rpc = FakeRpc(shard, never)
    c = client(rpc)
    c.start()
    try:
        c.push(0, steps(1)[0])
        transport = rpc.transports[0]
        transport.inbox = transport.inbox[:2]  # 2 of the 3 chunks of step 0 table a arrive
        c._pump(-1)  # nothing due yet: no read
        for response in transport.receive(0.0):
            c.ledger.on_response(response)  # the partial answer is held
        c._recover(TransportRetryable("UNAVAILABLE", "cut mid-answer"))
        (a, b), _ = c.take(0)
    finally:
        c.close()
    assert (a.table, b.table) == ("a", "b") and a.duplicate and b.duplicate
    assert c.stats.duplicates == 2 and shard.applied == [(0, "a"), (0, "b")]


def test_refusal_is_raised_at_once_naming_server_code_and_step() -> None:
    def refuse(where: str) -> TransportError | None:
        return (TransportRefused("INVALID_ARGUMENT", "grads are non-finite")
                if where == "receive" else None)

    rpc = FakeRpc(FakeShard(), refuse)
    c = client(rpc)
    c.start()
    try:
        c.push(0, steps(1)[0])
        with pytest.raises(ServerRefused) as caught:
            c.take(0)
    finally:
        c.close()
    text = str(caught.value)
    assert "fake:1" in text and "INVALID_ARGUMENT: grads are non-finite" in text
    assert "around step 0" in text
    assert rpc.registers == 1, "a refusal is not retried"


def test_server_down_past_the_deadline_is_unavailable() -> None:
    """The connection breaks and every re-Register fails: ServerUnavailable after
    --ps-timeout, naming the unanswered pushes."""
    rpc = FakeRpc(FakeShard(), break_at(("receive", 1)),
                  register_fail=lambda n: (TransportRetryable("UNAVAILABLE", "connection refused")
                                           if n > 1 else None))
    c = client(rpc, timeout_s=0.5)
    c.start()
    try:
        c.push(0, steps(1)[0])
        with pytest.raises(ServerUnavailable, match=r"unreachable for 0.5s .*connection "
                                                    r"refused.*2 pushes unanswered from step 0"):
            c.take(0)
    finally:
        c.close()
    assert rpc.registers > 2, "re-Register was retried with backoff"


def test_a_stop_signal_cuts_the_reconnect_wait_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Told to stop (SIGTERM) while the server is unreachable: ServerUnavailable after
    STOP_RECONNECT_S, not --ps-timeout (torchrun would SIGKILL the rank first)."""
    import worker.sync.client as sync_module
    from worker.runtime.lifecycle import STOP

    monkeypatch.setattr(sync_module, "STOP_RECONNECT_S", 0.3)
    rpc = FakeRpc(FakeShard(), break_at(("receive", 1)),
                  register_fail=lambda n: (TransportRetryable("UNAVAILABLE", "connection refused")
                                           if n > 1 else None))
    c = client(rpc, timeout_s=60.0)
    c.start()
    STOP.request("SIGTERM")
    try:
        c.push(0, steps(1)[0])
        start = time.monotonic()
        with pytest.raises(ServerUnavailable, match=r"told to stop \(SIGTERM\) while shard "
                                                    r"server fake:1 is unreachable .*connection "
                                                    r"refused.*2 pushes unanswered from step 0"):
            c.take(0)
        assert time.monotonic() - start < 10.0
    finally:
        STOP.clear()
        c.close()


def test_reregister_that_finds_the_state_lost_is_refused() -> None:
    """A restarted server (its state gone) answers the re-Register with created tables:
    the rank cannot go on (its answered pushes are lost)."""
    shard = FakeShard()
    rpc = FakeRpc(shard, break_at(("receive", 2)), lose_state_after=1)
    with pytest.raises(ServerRefused, match=r"lost the optimizer state .* was it restarted"):
        train(rpc)


def test_first_register_with_state_already_there_is_refused() -> None:
    shard = FakeShard()
    shard.last_step = {"a": 4, "b": 4}
    with pytest.raises(ServerRefused, match=r"already holds optimizer state .* step 4"):
        client(FakeRpc(shard, never)).start()


def test_every_call_goes_through_the_rpc() -> None:
    """Register, Sync, Flush, Checkpoint, CheckpointDone and Finish all go through the one
    ShardRpc (where the credentials are attached)."""
    rpc = FakeRpc(FakeShard(), never)
    c = client(rpc)
    c.start()
    try:
        c.push(0, steps(1)[0])
        c.take(0)
        c.checkpoint(0, "/ck")
        c.checkpoint(0, "/ck", deferred=True)
        c.checkpoint_done(0, "/ck")
        c.finish(0)
        assert c.end_run(0)
    finally:
        c.close()
    assert rpc.calls == ["Register", "Sync", "Checkpoint", "Checkpoint", "CheckpointDone",
                         "Flush", "Finish"]


# -- the ledger alone --------------------------------------------------------------------------

def _ledger() -> tuple[SyncLedger, PushEncoder, SyncStats]:
    stats = SyncStats()
    ledger = SyncLedger(["a", "b"], {"a": DIM, "b": DIM}, torch.float32, stats, "rank 0: x")
    return ledger, PushEncoder("r", 0, 1, torch.float32, torch.float32), stats


def _inline(encoder: PushEncoder, step: int, table: str, rows: int) -> InlinePush:
    return InlinePush(lambda: encoder.inline(step, table, torch.arange(rows),
                                             torch.ones(rows, DIM), 1 << 20))


def _answer(step: int, table: str, ids: torch.Tensor, index: int = 0, count: int = 1,
            dim: int = DIM) -> Response:
    update = shard_pb2.Update(step=step, table=table, decay=1.0,
                              chunk=shard_pb2.InlineAnswer(index=index, count=count))
    return decode_response(wire.encode_framed(
        shard_pb2.SyncResponse(update=update),
        [(UPDATE_IDS, ids), (UPDATE_DELTA, torch.ones(len(ids), dim))]))


def test_ledger_resends_the_unanswered_pushes_as_the_same_bytes_in_order() -> None:
    ledger, encoder, _ = _ledger()
    sent = {}
    for step in range(3):
        pushes = [(t, _inline(encoder, step, t, 2)) for t in ("a", "b")]
        for t, push in pushes:
            sent[(step, t)] = push.messages()
        assert serialized(ledger.add_step(step, pushes, epoch=0)) == [
            m for _, push in pushes for m in push.messages()]
    (done,) = ledger.on_response(_answer(0, "a", torch.arange(2)))
    assert done[0].step == 0 and done[1] is None
    assert ledger.oldest_step() == 0 and len(ledger) == 5
    assert serialized(ledger.resend(epoch=0)) == [
        m for key in [(0, "b"), (1, "a"), (1, "b"), (2, "a"), (2, "b")] for m in sent[key]]


def test_ledger_ignores_a_second_answer_and_refuses_broken_ones() -> None:
    ledger, encoder, _ = _ledger()
    ledger.add_step(0, [(t, _inline(encoder, 0, t, 4)) for t in ("a", "b")], epoch=0)
    assert ledger.on_response(_answer(0, "a", torch.arange(2), 0, 2)) == []  # chunk 0 of 2
    with pytest.raises(ServerRefused, match="chunk 0 arrived, expected 1"):
        ledger.on_response(_answer(0, "a", torch.arange(2), 0, 2))
    with pytest.raises(ServerRefused, match="do not fit a table of dim 4"):
        ledger.on_response(_answer(0, "b", torch.arange(2), dim=DIM + 1))
    with pytest.raises(ServerRefused, match="unknown table 'z'"):
        ledger.on_response(_answer(0, "z", torch.arange(2)))
    ledger2, encoder2, stats2 = _ledger()
    ledger2.add_step(0, [("a", _inline(encoder2, 0, "a", 2))], epoch=0)
    assert len(ledger2.on_response(_answer(0, "a", torch.arange(2)))) == 1
    assert ledger2.on_response(_answer(0, "a", torch.arange(2))) == []  # a re-sent push's
    assert stats2.ignored_updates == 1 and stats2.updates == 1


def test_ledger_refuses_an_answer_by_the_wrong_route() -> None:
    """A push sent by shared memory answered inline (or the reverse) is a protocol error."""
    ledger, encoder, _ = _ledger()
    ledger.add_step(0, [("a", _inline(encoder, 0, "a", 2))], epoch=0)
    shm = shard_pb2.SyncResponse(update=shard_pb2.Update(step=0, table="a",
                                                         shm=shard_pb2.ShmAnswer()))
    with pytest.raises(ServerRefused, match="a push sent inline was answered by shared memory"):
        ledger.on_response(decode_response(shm.SerializeToString()))


# -- shared-memory placement -----------------------------------------------------------------

def test_placement_frees_a_region_at_the_take_after_its_update_was_taken() -> None:
    placement = ArenaPlacement("on", 1 << 20, rank=0, address="x")
    offer = placement.offer(first=True)
    assert offer is not None and placement.arena is not None
    try:
        assert placement.accept(shard_pb2.SharedMemoryStatus(accepted=True, epoch=3), first=True)
        ring = placement.arena.ring
        slot = placement.place(torch.arange(10), torch.ones(10, DIM), torch.float32,
                               torch.float32, "step 0")
        assert slot is not None and placement.epoch == 3
        used = ring.used
        assert used > 0
        placement.answered(0, "a", slot)
        placement.before_take()
        placement.after_take([(0, "a")])  # handed out: its views are valid until next take
        assert ring.used == used
        placement.before_take()
        assert ring.used == 0
    finally:
        placement.close()


def test_placement_refused_by_the_server_falls_back_or_fails() -> None:
    auto = ArenaPlacement("auto", 1 << 20, rank=0, address="x")
    assert auto.offer(first=True) is not None
    assert not auto.accept(shard_pb2.SharedMemoryStatus(accepted=False, reason="no"), True)
    assert auto.status == "inline: no" and auto.arena is None
    assert auto.place(torch.arange(2), torch.ones(2, DIM), torch.float32, torch.float32,
                      "s") is None
    strict = ArenaPlacement("on", 1 << 20, rank=0, address="x")
    assert strict.offer(first=True) is not None
    try:
        with pytest.raises(ServerRefused,
                           match="--same-node require, but shard server x did not accept"):
            strict.accept(shard_pb2.SharedMemoryStatus(accepted=False, reason="no"), True)
    finally:
        strict.close()
    with pytest.raises(ValueError, match="shm='sometimes'"):
        ArenaPlacement("sometimes", 1 << 20, rank=0, address="x")


def test_inline_push_is_encoded_once_whoever_asks_first() -> None:
    """The gRPC stream's loop thread encodes an inline push when it sends it; a re-send
    (from the training thread) gets the same bytes, and the count runs once."""
    import threading

    calls: list[int] = []
    counted: list[int] = []
    encoder = PushEncoder("r", 0, 1, torch.float32, torch.float32)

    def encode() -> list[bytes]:
        calls.append(1)
        return encoder.inline(0, "a", torch.arange(50), torch.ones(50, DIM), 1 << 20)

    push = InlinePush(encode, lambda messages: counted.append(len(messages)))
    got: list[list[bytes]] = []
    threads = [threading.Thread(target=lambda: got.append(push.messages())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1] and counted == [1]
    assert all(m is got[0] for m in got) and push.messages() is got[0]
