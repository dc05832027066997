"""The same-node shared-memory protocol spoken by hand (the generated code) against a real
server: bad references, duplicates, batches and epochs (tests/worker/sync/test_shm.py has the
rest)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import grpc
import pytest
import torch

from hybridps import arena_layout as layout
from hybridps.admin import get_shard_stats
from hybridps.partition_secret import partition_metadata
from hybridps.v1 import shard_pb2, shard_pb2_grpc
from tests.worker.sync.test_wire_fast import SPEC
from worker.sync.arena import ClientArena, place
from worker.sync.messages import optimizer_message

ROWS, DIM = 2000, 32


# -- raw pushes: bad references, duplicates, epochs -----------------------------------------

class RawRank:
    """A rank speaking the protocol by hand (the generated code) with an arena."""

    def __init__(self, address: str, run_id: str) -> None:
        self.run_id = run_id
        self.arena = ClientArena(2 << 20, rank=0)
        self.channel = grpc.insecure_channel(address)
        self.stub = shard_pb2_grpc.ShardServiceStub(self.channel)
        self.epoch = 0
        self.secret = ""  # the partition's, from the latest Register

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return partition_metadata(self.run_id, 0, self.secret)

    def register_with(self, request: shard_pb2.RegisterRequest) -> shard_pb2.RegisterResponse:
        response = self.stub.Register(request, timeout=30, metadata=self.metadata)
        self.secret = response.partition_secret
        return response

    def register(self, nonce: bytes | None = None) -> shard_pb2.RegisterResponse:
        offer = self.arena.offer()
        if nonce is not None:
            offer.nonce = nonce
        request = shard_pb2.RegisterRequest(
            run_id=self.run_id, rank=0, world_size=1, incarnation=1,
            tables=[shard_pb2.TableSpec(name="t", num_rows=ROWS, dim=DIM, row_start=0,
                                        row_end=ROWS)],
            optimizer=optimizer_message(SPEC), shm=offer)
        response = self.register_with(request)
        self.epoch = response.shm.epoch
        return response

    def push(self, step: int, rows: int = 10) -> tuple[shard_pb2.Push, torch.Tensor]:
        ids = torch.arange(0, 2 * rows, 2)
        grads = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(step))
        slot = place(self.arena, ids, grads, torch.float32, torch.float32)
        assert slot is not None
        head = shard_pb2.Push(run_id=self.run_id, rank=0, incarnation=1, step=step,
                              table="t", shm=shard_pb2.ShmRefs(
                                  epoch=self.epoch, ids=slot.refs[0], grads=slot.refs[1],
                                  answer=slot.refs[2]))
        return head, slot.answer

    def sync(self, *pushes: shard_pb2.Push | shard_pb2.PushBatch
             ) -> list[shard_pb2.SyncResponse]:
        """One SyncRequest each (a push, or a batch of them)."""
        requests = [shard_pb2.SyncRequest(batch=p) if isinstance(p, shard_pb2.PushBatch)
                    else shard_pb2.SyncRequest(push=p) for p in pushes]
        return list(self.stub.Sync(iter(requests), timeout=30, metadata=self.metadata))

    def close(self) -> None:
        self.channel.close()
        self.arena.close()


@pytest.fixture
def raw_rank(ps_address: str, request: pytest.FixtureRequest) -> Iterator[RawRank]:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:80]  # a valid run id
    rank = RawRank(ps_address, f"raw-{safe}-{os.urandom(3).hex()}")
    try:
        yield rank
    finally:
        rank.close()


def _edit(push: shard_pb2.Push, field: str, **changes: object) -> shard_pb2.Push:
    bad = shard_pb2.Push()
    bad.CopyFrom(push)
    ref = getattr(bad.shm, field)
    for key, value in changes.items():
        if key == "shape":
            ref.shape[:] = value  # type: ignore[index]
        else:
            setattr(ref, key, value)
    return bad


@pytest.mark.e2e
@pytest.mark.parametrize(("field", "changes", "message"), [
    ("grads", {"offset": 1 << 30}, "shm grads (offset 1073741824"),
    ("grads", {"offset": 4100}, "offset 4100 is not a multiple of 64"),
    ("grads", {"length": 12}, "length 12 does not match shape [10, 32] of FLOAT32"),
    ("ids", {"dtype": shard_pb2.INT32, "length": 40}, "must be INT64 [U]"),
    ("answer", {"dtype": shard_pb2.BFLOAT16, "length": 640},
     "the answer of this push is torch.float32, not BFLOAT16"),
    ("answer", {"shape": [5, 32], "length": 640}, "must have the shape of the gradients"),
    ("answer", {"offset": layout.HEADER_BYTES + 128}, "overlaps shm grads"),
])
def test_bad_shm_reference_is_refused_and_changes_nothing(
        raw_rank: RawRank, ps_address: str, field: str, changes: dict[str, object],
        message: str) -> None:
    assert raw_rank.register().shm.accepted
    good, answer = raw_rank.push(0)
    with pytest.raises(grpc.RpcError) as info:
        raw_rank.sync(_edit(good, field, **changes))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(info.value.details()), info.value.details()
    assert "step=0" in str(info.value.details())
    stats = get_shard_stats(ps_address, run_id=raw_rank.run_id).partitions[0]
    assert stats.last_step == -1 and stats.pushes_applied == 0
    assert stats.refusals["bad_shm_reference"] == 1
    (response,) = raw_rank.sync(good)  # the partition takes the good push as step 0
    update = response.update
    assert update.HasField("shm") and update.step == 0 and not update.HasField("chunk")
    assert float(answer.abs().sum()) > 0


@pytest.mark.e2e
def test_a_push_by_reference_needs_the_partition_secret(raw_rank: RawRank,
                                                        ps_address: str) -> None:
    """A Sync stream is bound to the partition (and secret) its metadata names: a push by
    reference into a rank's arena on a stream without its secret, with a wrong one, or
    bound to another partition (with that one's secret) is PERMISSION_DENIED before any
    of it is read: the server neither applies it nor writes into the arena."""
    assert raw_rank.register().shm.accepted
    good, answer = raw_rank.push(0)
    other = RawRank(ps_address, f"{raw_rank.run_id}-other")
    try:
        assert other.register().shm.accepted
        for metadata in ((), partition_metadata(raw_rank.run_id, 0, ""),
                         partition_metadata(raw_rank.run_id, 0, "0" * 32),
                         partition_metadata(raw_rank.run_id, 0, raw_rank.secret[:-1] + "x"),
                         partition_metadata(raw_rank.run_id, 0, other.secret),
                         other.metadata):
            with pytest.raises(grpc.RpcError) as info:
                list(raw_rank.stub.Sync(iter([shard_pb2.SyncRequest(push=good)]),
                                        timeout=30, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, metadata
    finally:
        other.close()
    assert float(answer.abs().sum()) == 0, "the server wrote into the arena"
    stats = get_shard_stats(ps_address, run_id=raw_rank.run_id).partitions[0]
    assert stats.last_step == -1 and stats.pushes_applied == 0
    assert stats.refusals["wrong_secret"] >= 1
    (response,) = raw_rank.sync(good)  # the rank's own stream, with its secret
    assert response.update.step == 0 and float(answer.abs().sum()) > 0


@pytest.mark.e2e
def test_shm_push_without_an_accepted_arena_is_refused(raw_rank: RawRank) -> None:
    request = shard_pb2.RegisterRequest(
        run_id=raw_rank.run_id, rank=0, world_size=1, incarnation=1,
        tables=[shard_pb2.TableSpec(name="t", num_rows=ROWS, dim=DIM, row_start=0,
                                    row_end=ROWS)],
        optimizer=optimizer_message(SPEC))  # no arena offered
    raw_rank.register_with(request)
    push, _ = raw_rank.push(0)
    with pytest.raises(grpc.RpcError) as info:
        raw_rank.sync(push)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has no shared-memory arena accepted on this server" in str(info.value.details())


@pytest.mark.e2e
def test_wrong_nonce_is_not_accepted(raw_rank: RawRank) -> None:
    response = raw_rank.register(nonce=b"\0" * 32)
    assert not response.shm.accepted
    assert "header does not match" in response.shm.reason
    assert [t.name for t in response.tables] == ["t"], "the Register itself succeeded"


@pytest.mark.e2e
def test_duplicate_push_is_answered_in_its_region_and_into_another(
        raw_rank: RawRank) -> None:
    """A re-sent push (its answer was lost, so the rank left the region alone) gets the
    saved answer: in its own region as it stands, or copied into another region it
    names; the state does not move."""
    assert raw_rank.register().shm.accepted
    push, answer = raw_rank.push(0)
    (first,) = (r.update for r in raw_rank.sync(push))
    saved = answer.clone()
    (again,) = (r.update for r in raw_rank.sync(push))
    assert not first.duplicate and again.duplicate and again.HasField("shm")
    assert torch.equal(answer, saved) and float(saved.abs().sum()) > 0
    elsewhere, region = raw_rank.push(0)  # the same ids and grads, a new answer region
    region.zero_()
    (third,) = (r.update for r in raw_rank.sync(elsewhere))
    assert third.duplicate and torch.equal(region, saved)
    nxt, next_answer = raw_rank.push(1)
    (fourth,) = (r.update for r in raw_rank.sync(nxt))
    assert not fourth.duplicate and fourth.step == 1 and float(next_answer.abs().sum()) > 0


def _batch(*pushes: shard_pb2.Push) -> shard_pb2.PushBatch:
    return shard_pb2.PushBatch(pushes=list(pushes))


@pytest.mark.e2e
def test_batch_push_is_answered_in_one_update_like_separate_pushes(
        raw_rank: RawRank, ps_address: str) -> None:
    alone = RawRank(ps_address, f"{raw_rank.run_id}-alone")
    try:
        assert raw_rank.register().shm.accepted and alone.register().shm.accepted
        batched = [raw_rank.push(step) for step in range(3)]
        separate = [alone.push(step) for step in range(3)]
        (response,) = raw_rank.sync(_batch(*(p for p, _ in batched)))
        answers = [r.update for p, _ in separate for r in alone.sync(p)]
    finally:
        alone.close()
    assert response.HasField("batch")
    assert [u.step for u in response.batch.updates] == [0, 1, 2]
    assert all(u.HasField("shm") and not u.duplicate for u in response.batch.updates)
    assert [u.step for u in answers] == [0, 1, 2]
    for (_, got), (_, want) in zip(batched, separate, strict=True):
        assert torch.equal(got, want) and float(got.abs().sum()) > 0
    stats = get_shard_stats(ps_address, run_id=raw_rank.run_id).partitions[0]
    assert stats.last_step == 2 and stats.pushes_applied == 3


@pytest.mark.e2e
@pytest.mark.parametrize(("case", "message"), [
    ("inline", "entry 1 (step=1 table='t') is not a shared-memory push"),
    ("empty", "entry 1 (step=1 table='t') is not a shared-memory push"),
    ("rank", "entry 1 (step=1 table='t') is of run="),
])
def test_bad_batch_is_refused_whole(raw_rank: RawRank, ps_address: str, case: str,
                                    message: str) -> None:
    assert raw_rank.register().shm.accepted
    first, first_answer = raw_rank.push(0)
    second, _ = raw_rank.push(1)
    if case == "inline":
        second = shard_pb2.Push(run_id=raw_rank.run_id, rank=0, incarnation=1, step=1,
                                table="t", chunk=shard_pb2.InlineChunk(index=0, count=1))
    elif case == "empty":  # neither inline nor by reference
        second = shard_pb2.Push(run_id=raw_rank.run_id, rank=0, incarnation=1, step=1,
                                table="t")
    elif case == "rank":
        second.run_id = "another-run"
    batch = _batch(first, second)
    with pytest.raises(grpc.RpcError) as info:
        raw_rank.sync(batch)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in str(info.value.details()), info.value.details()
    stats = get_shard_stats(ps_address, run_id=raw_rank.run_id).partitions[0]
    assert stats.last_step == -1 and stats.pushes_applied == 0, "part of the batch applied"
    assert float(first_answer.abs().sum()) == 0


@pytest.mark.e2e
def test_push_of_an_old_epoch_is_aborted(raw_rank: RawRank) -> None:
    assert raw_rank.register().shm.accepted
    old = raw_rank.epoch
    push, answer = raw_rank.push(0)
    second = raw_rank.register()  # a reconnect: the same arena, a new epoch
    assert second.shm.accepted and second.shm.epoch > old
    with pytest.raises(grpc.RpcError) as info:
        raw_rank.sync(push)  # still stamped with the old epoch
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert f"shm epoch {old} is not the arena's current epoch" in str(info.value.details())
    assert float(answer.abs().sum()) == 0, "a stale stream wrote into the arena"
