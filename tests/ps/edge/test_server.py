"""The shard server over real gRPC: a `python -m ps` subprocess on a free port."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from hybridps import errors, wire
from hybridps.errors import FlushTimeout, NotFound, OutOfOrder, RowOutOfRange
from hybridps.optim import OptimizerSpec
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from ps.edge.status import status_for
from tests.testing.grpc_helpers import (
    assemble,
    open_channel,
    push_messages,
    register,
    shard_stub,
    sync,
    table,
)
from tests.testing.helpers import PsServer, launch_ps, start_ps_server

MAX_MSG = 64 * 1024  # small, so that pushes and answers of a few hundred rows are chunked
DIM = 64
ROWS = 2000
_runs = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    ps = start_ps_server(tmp_path_factory.mktemp("ps"), "--max-message-bytes", str(MAX_MSG),
                         "--update-threads", "2")
    try:
        yield ps
    finally:
        ps.terminate()


@pytest.fixture(scope="module")
def channel(server: PsServer) -> Iterator[grpc.Channel]:
    ch = open_channel(server.address, max_message_bytes=4 * MAX_MSG)
    yield ch
    ch.close()


def details(info: pytest.ExceptionInfo[grpc.RpcError]) -> str:
    return str(info.value.details())  # type: ignore[attr-defined]


def new_run() -> str:
    return f"run-{next(_runs)}-{time.monotonic_ns()}"


class Rank:
    """One registered rank (rank 0 of 1, rows [0, ROWS) of "emb") plus an in-process reference."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = shard_stub(channel)
        self.run = new_run()
        self.reg = register(self.stub, self.run, [table("emb", ROWS, DIM, 0, ROWS)])
        self.reference = Store()
        self.reference.register(self.run, 0, 1, 0, [TableSpec("emb", ROWS, DIM, 0, ROWS)],
                                OptimizerSpec("adam", lr=0.05))
        self.ref_session = self.reference.open_session()

    def grads(self, step: int, ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids_t = torch.as_tensor(ids, dtype=torch.int64)
        gen = torch.Generator().manual_seed(1000 + step)
        return ids_t, torch.randn(int(ids_t.shape[0]), DIM, generator=gen)

    def push(self, step: int, ids: list[int] | torch.Tensor,
             **kwargs: Any) -> list[shard_pb2.SyncRequest]:
        ids_t, grads = self.grads(step, ids)
        kwargs.setdefault("max_message_bytes", MAX_MSG)
        return push_messages(self.run, step, "emb", ids_t, grads, **kwargs)

    def expect(self, step: int, ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, float]:
        ids_t, grads = self.grads(step, ids)
        answer = self.ref_session.feed(PushChunk(self.run, 0, 0, step, "emb", ids_t, grads))
        assert answer is not None
        return answer.delta, answer.decay

    def check(self, step: int, ids: list[int] | torch.Tensor, **kwargs: Any) -> None:
        """Push `step` over gRPC; its answer must equal the reference's, bitwise."""
        (got,) = assemble(sync(self.stub, self.push(step, ids, **kwargs)))
        delta, decay = self.expect(step, ids)
        assert got[0] == step and got[1] == "emb" and not got[5]
        assert torch.equal(got[2], torch.as_tensor(ids, dtype=torch.int64))
        assert torch.equal(got[3], delta) and got[4] == decay


@pytest.mark.e2e
def test_register_and_sync_round_trip_with_chunking(channel: grpc.Channel) -> None:
    rank = Rank(channel)
    assert rank.reg.max_message_bytes == MAX_MSG and rank.reg.server_id
    assert [(t.name, t.rows_held, t.last_step, t.created) for t in rank.reg.tables] == [
        ("emb", ROWS, -1, True)]
    ids = torch.randperm(ROWS, generator=torch.Generator().manual_seed(0))[:900]
    pushes = rank.push(0, ids)
    assert len(pushes) >= 3  # the push is chunked ...
    updates = sync(rank.stub, pushes)
    assert len(updates) >= 3  # ... and so is the answer
    assert all(u.ByteSize() <= MAX_MSG for u in updates)
    assert [u.update.chunk.index for u in updates] == list(range(len(updates)))
    ((step, name, got_ids, delta, decay, dup),) = assemble(updates)
    ref_delta, ref_decay = rank.expect(0, ids)
    assert (step, name, dup, decay) == (0, "emb", False, ref_decay)
    assert torch.equal(got_ids, ids) and torch.equal(delta, ref_delta)
    # Several pushes on one stream are answered in order.
    batch = [*rank.push(1, [5, 7]), *rank.push(2, []), *rank.push(3, ids[:400])]
    answers = assemble(sync(rank.stub, batch))
    assert [a[0] for a in answers] == [1, 2, 3]
    sent: list[list[int] | torch.Tensor] = [[5, 7], [], ids[:400]]
    for (step, _, _, delta, _, _), ids_in in zip(answers, sent, strict=True):
        assert torch.equal(delta, rank.expect(step, ids_in)[0])
    # Re-registering reports where the partition is.
    again = register(rank.stub, rank.run, [table("emb", ROWS, DIM, 0, ROWS)], incarnation=1)
    assert [(t.last_step, t.created) for t in again.tables] == [(3, False)]


@pytest.mark.e2e
def test_empty_push_gets_an_empty_answer(channel: grpc.Channel) -> None:
    rank = Rank(channel)
    (response,) = sync(rank.stub, rank.push(0, []))
    update = response.update
    assert (update.step, update.table, update.chunk.index, update.chunk.count) == (0, "emb", 0, 1)
    assert list(update.chunk.ids.shape) == [0] and list(update.chunk.delta.shape) == [0, DIM]
    assert not update.duplicate
    rank.expect(0, [])
    rank.check(1, [3])  # the step count advanced: kernel step 2


@pytest.mark.e2e
def test_duplicates_over_the_wire(channel: grpc.Channel) -> None:
    rank = Rank(channel)
    first = sync(rank.stub, [*rank.push(0, list(range(300))), *rank.push(1, [1, 2])])
    replay = sync(rank.stub, [*rank.push(0, list(range(300))), *rank.push(1, [1, 2])])
    assert len(first) == len(replay) > 2
    for a, b in zip(first, replay, strict=True):
        assert not a.update.duplicate and b.update.duplicate
        b.update.duplicate = False
        assert a == b  # the same bytes
    rank.expect(0, list(range(300)))
    rank.expect(1, [1, 2])
    rank.check(2, [4])  # replays changed nothing


def _mutate_ids(msg: shard_pb2.Push, ids: list[int]) -> None:
    wire.encode(torch.tensor(ids, dtype=torch.int64), msg.chunk.ids)


def _nan(msg: shard_pb2.Push) -> None:
    g = wire.decode(msg.chunk.grads).clone()
    g[1, 3] = float("nan")
    wire.encode(g, msg.chunk.grads)


BAD: list[tuple[str, Callable[[shard_pb2.Push], object], grpc.StatusCode, str]] = [
    ("unknown table", lambda m: setattr(m, "table", "nope"), grpc.StatusCode.NOT_FOUND,
     "table 'nope' is not registered"),
    ("id out of range", lambda m: _mutate_ids(m, [1, ROWS]), grpc.StatusCode.INVALID_ARGUMENT,
     f"id {ROWS} at position 1 is outside the rows [0, {ROWS})"),
    ("negative id", lambda m: _mutate_ids(m, [-5, 1]), grpc.StatusCode.INVALID_ARGUMENT,
     "id -5"),
    ("duplicate ids", lambda m: _mutate_ids(m, [9, 9]), grpc.StatusCode.INVALID_ARGUMENT,
     "id 9 appears more than once"),
    ("nan", _nan, grpc.StatusCode.INVALID_ARGUMENT, "is nan"),
    # float16/bfloat16 grads are valid (--wire-dtype); integers are not.
    ("grads dtype", lambda m: wire.encode(torch.zeros(2, DIM, dtype=torch.int32),
                                          m.chunk.grads),
     grpc.StatusCode.INVALID_ARGUMENT, "grads must be float32 (or bfloat16/float16 on the "
     "wire), got torch.int32"),
    ("grads dim", lambda m: wire.encode(torch.zeros(2, DIM + 1), m.chunk.grads),
     grpc.StatusCode.INVALID_ARGUMENT, f"must be [U, dim] = [2, {DIM}]"),
    ("truncated bytes", lambda m: setattr(m.chunk.grads, "data", m.chunk.grads.data[:-4]),
     grpc.StatusCode.INVALID_ARGUMENT, f"grads: {2 * DIM * 4 - 4} bytes do not match shape"),
    ("unspecified dtype", lambda m: m.chunk.ids.ClearField("dtype"),
     grpc.StatusCode.INVALID_ARGUMENT,
     "ids: unsupported dtype DTYPE_UNSPECIFIED"),
    ("out of order", lambda m: setattr(m, "step", 5), grpc.StatusCode.FAILED_PRECONDITION,
     "step 5 skips ahead"),
    ("unregistered run", lambda m: setattr(m, "run_id", "ghost"),
     grpc.StatusCode.FAILED_PRECONDITION, "run 'ghost' rank 0 is not registered"),
    ("newer incarnation", lambda m: setattr(m, "incarnation", 7),
     grpc.StatusCode.FAILED_PRECONDITION, "register first"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("case", "mutate", "code", "named"), BAD, ids=[b[0] for b in BAD])
def test_bad_push_aborts_the_stream_and_changes_nothing(
        channel: grpc.Channel, case: str, mutate: Callable[[shard_pb2.Push], object],
        code: grpc.StatusCode, named: str) -> None:
    rank = Rank(channel)
    rank.check(0, [1, 2])
    (bad,) = rank.push(1, [1, 2])
    mutate(bad.push)
    # The good push before the bad one on the same stream is answered, then the stream ends.
    good_first = rank.push(1, [3])
    received: list[shard_pb2.Update] = []
    with pytest.raises(grpc.RpcError) as info:
        for response in rank.stub.Sync(iter([*good_first, bad]), timeout=30):
            received.append(response.update)
    assert info.value.code() == code, details(info)
    assert named in details(info)
    assert [u.step for u in received] == [1]
    rank.expect(1, [3])
    rank.check(2, [1, 2])  # state as if the bad push had never been sent


@pytest.mark.e2e
def test_stale_incarnation_and_refusals_are_counted(channel: grpc.Channel) -> None:
    rank = Rank(channel)
    rank.check(0, [1])
    register(rank.stub, rank.run, [table("emb", ROWS, DIM, 0, ROWS)], incarnation=2)
    with pytest.raises(grpc.RpcError) as info:
        sync(rank.stub, rank.push(1, [1], incarnation=1))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incarnation 1 is older than the registered incarnation 2" in details(info)
    stats = admin_pb2_grpc.AdminServiceStub(channel).GetShardStats(
        admin_pb2.ShardStatsRequest(run_id=rank.run), timeout=10)
    (part,) = stats.partitions
    assert dict(part.refusals) == {"stale_incarnation": 1}
    assert (part.incarnation, part.last_step, part.pushes_applied) == (2, 0, 1)


@pytest.mark.e2e
def test_bad_chunk_drops_the_buffered_chunks(channel: grpc.Channel) -> None:
    rank = Rank(channel)
    ids = list(range(100, 900))
    pushes = rank.push(0, ids)
    assert len(pushes) >= 3
    _nan(pushes[-1].push)
    with pytest.raises(grpc.RpcError) as info:
        sync(rank.stub, pushes)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"chunk {len(pushes) - 1} of {len(pushes)}" in details(info)
    rank.check(0, ids)  # the whole push is applied once, when sent intact


@pytest.mark.e2e
def test_message_over_the_server_limit_is_refused(server: PsServer) -> None:
    big = open_channel(server.address, max_message_bytes=8 * MAX_MSG)
    try:
        rank = Rank(big)
        unchunked = rank.push(0, list(range(1000)), max_message_bytes=None)
        assert unchunked[0].ByteSize() > MAX_MSG
        with pytest.raises(grpc.RpcError) as info:
            sync(rank.stub, unchunked)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        rank.check(0, [1, 2])
    finally:
        big.close()


@pytest.mark.e2e
@pytest.mark.parametrize(("request_kwargs", "code", "named"), [
    ({"rank": 3, "world_size": 2}, grpc.StatusCode.INVALID_ARGUMENT, "rank=3"),
    ({"tables": [table("emb", 10, 4, 5, 11)]}, grpc.StatusCode.INVALID_ARGUMENT, r"\[5, 11\)"),
    ({"optimizer": shard_pb2.OptimizerConfig(lr=0.1)}, grpc.StatusCode.INVALID_ARGUMENT,
     "kind 'unspecified'"),
    ({"optimizer": shard_pb2.OptimizerConfig(kind=shard_pb2.OptimizerConfig.ADAM, lr=0.1,
                                             beta1=1.5)},
     grpc.StatusCode.INVALID_ARGUMENT, "beta1=1.5"),
])
def test_register_errors(channel: grpc.Channel, request_kwargs: dict[str, Any],
                         code: grpc.StatusCode, named: str) -> None:
    args: dict[str, Any] = {"tables": [table("emb", 10, 4, 0, 10)], **request_kwargs}
    with pytest.raises(grpc.RpcError) as info:
        register(shard_stub(channel), new_run(), **args)
    assert info.value.code() == code
    assert re.search(named, details(info)), details(info)


@pytest.mark.e2e
def test_register_conflict(channel: grpc.Channel) -> None:
    rank = Rank(channel)
    with pytest.raises(grpc.RpcError) as info:
        register(rank.stub, rank.run, [table("emb", ROWS, DIM + 1, 0, ROWS)], incarnation=1)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"dim={DIM + 1}" in details(info)


@pytest.mark.e2e
def test_flush(channel: grpc.Channel) -> None:
    rank = Rank(channel)
    rank.check(0, [1])
    ok = rank.stub.Flush(shard_pb2.FlushRequest(run_id=rank.run, rank=-1, step=0), timeout=10)
    assert [(a.rank, a.table, a.last_step) for a in ok.applied] == [(0, "emb", 0)]
    with pytest.raises(grpc.RpcError) as info:
        rank.stub.Flush(shard_pb2.FlushRequest(run_id=rank.run, rank=0, step=3, timeout_s=0.2),
                        timeout=10)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "rank 0 table 'emb' at step 0" in details(info)
    with pytest.raises(grpc.RpcError) as info:
        rank.stub.Flush(shard_pb2.FlushRequest(run_id="ghost", rank=-1, step=0), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # A Flush waiting for step 1 returns once another stream applies it.
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(rank.stub.Flush(
        shard_pb2.FlushRequest(run_id=rank.run, rank=-1, step=1, timeout_s=20), timeout=30)))
    waiter.start()
    time.sleep(0.2)
    rank.check(1, [2])
    waiter.join(30)
    assert [a.last_step for a in result[0].applied] == [1]


@pytest.mark.e2e
def test_ranks_push_concurrently(channel: grpc.Channel) -> None:
    """Four ranks stream at once (updates run in parallel threads); each matches its reference."""
    ranks = [Rank(channel) for _ in range(4)]
    errors: list[BaseException] = []

    def work(rank: Rank, seed: int) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            steps = [torch.randperm(ROWS, generator=gen)[:500] for _ in range(6)]
            pushes = [m for step, ids in enumerate(steps) for m in rank.push(step, ids)]
            answers = assemble(sync(rank.stub, pushes))
            for step, ids in enumerate(steps):
                assert torch.equal(answers[step][3], rank.expect(step, ids)[0])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r, i)) for i, r in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.e2e
def test_health_serving_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "hybridps.v1.ShardService", "hybridps.v1.AdminService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"hybridps.v1.ShardService", "hybridps.v1.AdminService",
            "grpc.health.v1.Health"} <= services


def test_status_mapping() -> None:
    assert status_for(RowOutOfRange("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(wire.WireError("x"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(NotFound("x"))[0] == grpc.StatusCode.NOT_FOUND
    assert status_for(OutOfOrder("x"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(FlushTimeout("x"))[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    code, message = status_for(KeyError("boom"))
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in message
    assert status_for(errors.Unauthenticated("x"))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert status_for(errors.Unimplemented("x"))[0] == grpc.StatusCode.UNIMPLEMENTED
    code, message = status_for(errors.ShuttingDown())
    assert errors.is_shutting_down(code.name, message)


def test_every_core_error_has_a_status() -> None:
    """Each error of the core maps to its own code, not INTERNAL (the catch-all for bugs)."""
    kinds = [c for c in vars(errors).values() if isinstance(c, type)
             and issubclass(c, errors.ShardError) and c is not errors.ShardError]
    unmapped = [c.__name__ for c in kinds if status_for(c())[0] == grpc.StatusCode.INTERNAL]
    assert len(kinds) > 15 and not unmapped, unmapped


# -- process behaviour -------------------------------------------------------------------

@pytest.mark.e2e
def test_port_in_use_exits_nonzero_with_a_clear_message(server: PsServer, tmp_path: Path) -> None:
    proc, _ = launch_ps(tmp_path / "second", "--port", str(server.port))
    assert proc.wait(60) != 0
    err = (tmp_path / "second" / "stderr.log").read_text()
    assert f"cannot listen on 127.0.0.1:{server.port}: address already in use" in err
    assert (tmp_path / "second" / "stdout.log").read_text() == ""


@pytest.mark.e2e
def test_sigterm_stops_promptly_with_reflection_off_from_env(tmp_path: Path) -> None:
    ps = start_ps_server(tmp_path, "--grace-s", "1", env={"HYBRIDPS_REFLECTION": "false"})
    try:
        assert ps.stdout() == f"hybridps-ps listening on 127.0.0.1:{ps.port}\n"
        with open_channel(ps.address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                ProtoReflectionDescriptorDatabase(ch).get_services()
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            # An open Sync stream must not keep the server from stopping.
            stub = shard_stub(ch)
            register(stub, "r", [table("emb", 10, 4, 0, 10)])
            gate = threading.Event()

            def pushes() -> Iterator[shard_pb2.SyncRequest]:
                yield from push_messages("r", 0, "emb", torch.tensor([1]), torch.ones(1, 4))
                gate.wait(30)

            stream = stub.Sync(pushes(), timeout=30)
            assert next(stream).update.step == 0
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                          timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            start = time.monotonic()
            ps.proc.send_signal(signal.SIGTERM)
            # During the grace period health says NOT_SERVING.
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            code = ps.proc.wait(15)
            elapsed = time.monotonic() - start
            gate.set()
        assert code == 0, ps.stderr()
        assert elapsed < 8, elapsed
        assert "event=shutdown" in ps.stderr() and "event=stopped" in ps.stderr()
    finally:
        if ps.proc.poll() is None:
            ps.proc.kill()
            ps.proc.wait()


@pytest.mark.e2e
def test_bad_flag_exits_with_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*launch_args(), "--max-message-bytes", "10"], capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 2
    assert "--max-message-bytes 10 must be >=" in proc.stderr


def launch_args() -> list[str]:
    import sys

    return [sys.executable, "-m", "ps"]


@pytest.mark.e2e
@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux-only")
@pytest.mark.parametrize("flag", ["true", "false"])
def test_sched_batch_covers_every_server_thread(tmp_path: Path, flag: str) -> None:
    """--sched-batch (default true): the main thread and the threads it started later
    (gRPC, update pool, native kernel pool) all run under SCHED_BATCH; false: normal."""
    ps = start_ps_server(tmp_path, "--sched-batch", flag, "--log-level", "INFO")
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{ps.proc.pid}/task")]
        assert len(tids) > 1, "the server should have started threads by now"
        want = os.SCHED_BATCH if flag == "true" else os.SCHED_OTHER
        assert {os.sched_getscheduler(tid) for tid in tids} == {want}
        assert ("event=sched policy=batch" in ps.stderr()) == (flag == "true")
    finally:
        ps.terminate()
