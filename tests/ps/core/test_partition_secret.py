"""The per-partition secret: only the process a Register answered may
speak for a partition.

Unit (the store): the secret's size, the constant-time check, and the takeover rule (who
may register a partition the server holds). Against a real server: every call after
Register without the partition's secret (or with another's) is PERMISSION_DENIED with
nothing changed, GetShardStats never shows it, and a third party that reads run id,
rank, incarnation and step from GetShardStats cannot inject a push into a live run: the
run ends bitwise equal to an undisturbed one.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.message import Message

from hybridps.admin import get_shard_stats
from hybridps.errors import WrongSecret
from hybridps.partition_secret import partition_metadata
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from tests.testing.grpc_helpers import (
    ADAM,
    open_channel,
    push_messages,
    register,
    shard_stub,
    table,
)
from tests.testing.helpers import PsServer, start_ps_server
from tests.worker.checkpoint.test_checkpoint import (
    COMMON,
    GLOBAL_BATCH,
    REPO,
    _env,
    assert_states,
    worker_cmd,
)
from worker.runtime.faults import FAULT_ENV

EMB = TableSpec("emb", 20, 4, 0, 20)
OPT = {"kind": "adam", "lr": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def _push(store: Store, run_id: str, step: int, incarnation: int = 1) -> None:
    chunk = PushChunk(run_id, 0, incarnation, step, "emb", torch.tensor([1, 2]),
                      torch.ones(2, 4), 0, 1)
    assert store.open_session().feed(chunk) is not None


# -- unit: the store --------------------------------------------------------------------


def test_each_partition_gets_its_own_128_bit_secret() -> None:
    store = Store()
    a = store.register_partition("a", 0, 1, 1, [EMB], OPT)[1]
    b = store.register_partition("b", 0, 1, 1, [EMB], OPT)[1]
    assert len(a) == 32 and int(a, 16) >= 0 and a != b  # 16 random bytes, hex
    assert store.check_secret("a", 0, a, "t").run_id == "a"
    for wrong in ("", b, a[:-1], a + "0", a.upper() if a != a.upper() else "x" * 32):
        with pytest.raises(WrongSecret):
            store.check_secret("a", 0, wrong, "t")
    with pytest.raises(WrongSecret):  # another run's secret opens nothing here
        store.authorize("a", [], b, "checkpoint")


def test_the_takeover_rule() -> None:
    """A re-Register with the secret keeps it; without it, a partition with pushes applied
    or a Sync connection bound is refused with nothing changed; one without pushes and
    without a connection is taken over with a new secret."""
    store = Store()
    secret = store.register_partition("r", 0, 1, 1, [EMB], OPT)[1]
    again = store.register_partition("r", 0, 1, 1, [EMB], OPT, secret=secret)[1]
    assert again == secret  # a reconnect of the same process
    binding = store.bind("r", 0, secret, "sync")
    with pytest.raises(WrongSecret, match="Sync connection"):
        store.register_partition("r", 0, 1, 2, [EMB], OPT)
    store.unbind(binding)
    taken = store.register_partition("r", 0, 1, 2, [EMB], OPT)[1]  # nothing pushed yet
    part = store.partition("r", 0)
    assert part is not None and part.incarnation == 2 and taken not in (secret, "")
    _push(store, "r", 0, incarnation=2)
    with pytest.raises(WrongSecret, match="through step 0"):
        store.register_partition("r", 0, 1, 3, [EMB], OPT)
    with pytest.raises(WrongSecret):
        store.register_partition("r", 0, 1, 3, [EMB], OPT, secret=secret)  # the old one
    assert store.partition("r", 0) is part
    assert part.incarnation == 2 and part.tables["emb"].last_step == 0
    assert store.secret("r", 0) == taken
    newer = store.register_partition("r", 0, 1, 3, [EMB], OPT, secret=taken)[1]
    assert newer != taken and part.incarnation == 3  # a newer incarnation: a new secret


def test_stats_never_show_a_secret() -> None:
    store = Store()
    secret = store.register_partition("s", 0, 1, 1, [EMB], OPT)[1]
    _push(store, "s", 0)
    assert secret not in repr(store.stats())


# -- against a real server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    srv = start_ps_server(tmp_path_factory.mktemp("secret-ps"))
    yield srv
    srv.terminate()


def _code(call: Any, *args: Any, **kwargs: Any) -> grpc.StatusCode:
    """The status code `call` was refused with (a stream is read to its end)."""
    try:
        result = call(*args, **kwargs)
        if not isinstance(result, Message):
            list(result)  # a stream: read to its status
    except grpc.RpcError as exc:
        return exc.code()
    raise AssertionError(f"{call} with {args} {kwargs} was not refused")


@pytest.mark.e2e
def test_calls_without_the_secret_are_refused_and_change_nothing(server: PsServer,
                                                                  tmp_path: Path) -> None:
    spec = [table("emb", 20, 4, 0, 20)]
    with open_channel(server.address) as owner_ch, \
            open_channel(server.address, carry_secrets=False) as other_ch:
        owner, other = shard_stub(owner_ch), shard_stub(other_ch)
        victim = register(owner, "victim", spec)
        list(owner.Sync(iter(push_messages("victim", 0, "emb", torch.tensor([1]),
                                           torch.ones(1, 4))), timeout=30))
        mine = register(other, "mine", spec).partition_secret  # a secret, of another run
        before = get_shard_stats(server.address, run_id="victim").partitions[0]
        push = push_messages("victim", 1, "emb", torch.tensor([2]), torch.ones(1, 4))
        for metadata in ((), partition_metadata("victim", 0, ""),
                         partition_metadata("victim", 0, mine),
                         partition_metadata("victim", 0, "f" * 32),
                         partition_metadata("mine", 0, mine)):  # bound to its own
            assert _code(other.Sync, iter(push), timeout=30,
                         metadata=metadata) == grpc.StatusCode.PERMISSION_DENIED, metadata
            calls = [
                (other.Flush, shard_pb2.FlushRequest(run_id="victim", rank=0, step=0)),
                (other.Flush, shard_pb2.FlushRequest(run_id="victim", rank=-1, step=0)),
                (other.Checkpoint, shard_pb2.CheckpointRequest(
                    run_id="victim", step=0, directory=str(tmp_path / "ck"))),
                (other.Finish, shard_pb2.FinishRequest(run_id="victim", rank=0,
                                                       last_step=0)),
                (other.SeedRows, shard_pb2.SeedRowsRequest(run_id="victim", rank=0,
                                                           table="emb", row_start=0)),
                (other.Register, shard_pb2.RegisterRequest(  # a takeover: pushes applied
                    run_id="victim", rank=0, world_size=1, incarnation=5, tables=spec,
                    optimizer=ADAM)),
            ]
            for fn, request in calls:
                assert _code(fn, request, timeout=30, metadata=metadata) == \
                    grpc.StatusCode.PERMISSION_DENIED, (fn, metadata)
        after = get_shard_stats(server.address, run_id="victim")
        row = after.partitions[0]
        assert (row.incarnation, row.last_step, row.pushes_applied) == \
            (before.incarnation, before.last_step, before.pushes_applied)
        assert after.refusals["wrong_secret"] >= 30
        assert not (tmp_path / "ck").exists()
        # The owner carries on; the stats (in any form) never show a secret.
        assert owner.Flush(shard_pb2.FlushRequest(run_id="victim", rank=0, step=0),
                           timeout=30).applied
        raw = admin_pb2_grpc.AdminServiceStub(other_ch).GetShardStats(
            admin_pb2.ShardStatsRequest(), timeout=30).SerializeToString()
        assert victim.partition_secret.encode() not in raw and mine.encode() not in raw


def _intrude(address: str, run_id: str, stop: threading.Event, tries: list[str]) -> None:
    """What a third party can do with GetShardStats: push step last+1 of every partition
    of the run (as an unbound stream, and bound with a guessed secret), take it over,
    Flush, Checkpoint and Finish it. Every refusal's code is recorded."""
    with open_channel(address, carry_secrets=False) as channel:
        stub = shard_stub(channel)
        while not stop.is_set():
            for row in get_shard_stats(address, run_id=run_id).partitions:
                push = push_messages(run_id, row.last_step + 1, row.table,
                                     torch.tensor([0, 1]), torch.full((2, 8), 1e3),
                                     rank=row.rank, incarnation=row.incarnation)
                for metadata in ((), partition_metadata(run_id, row.rank, "0" * 32)):
                    try:
                        list(stub.Sync(iter(push), timeout=10, metadata=metadata))
                        tries.append("ACCEPTED")
                    except grpc.RpcError as exc:
                        tries.append(exc.code().name)
                for fn, request in (
                        (stub.Register, shard_pb2.RegisterRequest(
                            run_id=run_id, rank=row.rank, world_size=2,
                            incarnation=row.incarnation + 1,
                            tables=[table(row.table, 2000, 8, row.row_start, row.row_end)],
                            optimizer=ADAM)),
                        (stub.Finish, shard_pb2.FinishRequest(run_id=run_id, rank=row.rank,
                                                              last_step=row.last_step)),
                        (stub.Flush, shard_pb2.FlushRequest(run_id=run_id, rank=-1,
                                                            step=row.last_step))):
                    try:
                        fn(request, timeout=10)
                        tries.append("ACCEPTED")
                    except grpc.RpcError as exc:
                        tries.append(exc.code().name)
            time.sleep(0.01)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_third_party_cannot_inject_into_a_live_run(server: PsServer, tmp_path: Path) -> None:
    """A third party's injection, with the inline Sync stream (--same-node off, where a push of
    step L+1 sent first used to be applied and the real one answered as its duplicate):
    refused every time, and the run ends rc 0 bitwise equal to an undisturbed run."""
    args = [*COMMON, "--batch-size", str(GLOBAL_BATCH // 2), "--ps", server.address,
            "--steps", "20", "--same-node", "off", "--checkpoint-every", "10"]
    straight = subprocess.run(
        worker_cmd([*args, "--run-id", "inject-straight", "--checkpoint-dir",
                    str(tmp_path / "ck0"), "--dump-state", str(tmp_path / "straight.pt")], 2),
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert straight.returncode == 0, straight.stderr[-6000:]
    stop = threading.Event()
    tries: list[str] = []
    # Every rank pauses 2 s at the start of the step-9 checkpoint: the intruder acts on a
    # live run whatever the machine's speed.
    proc = subprocess.Popen(
        worker_cmd([*args, "--run-id", "inject", "--checkpoint-dir", str(tmp_path / "ck1"),
                    "--dump-state", str(tmp_path / "intruded.pt")], 2),
        cwd=REPO, env=_env({FAULT_ENV: "9:start:sleep=2"}), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    while not get_shard_stats(server.address, run_id="inject").partitions:
        assert proc.poll() is None, proc.communicate()[1][-6000:]
        time.sleep(0.05)
    intruder = threading.Thread(target=_intrude,
                                args=(server.address, "inject", stop, tries))
    intruder.start()
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        stop.set()
        intruder.join(60)
    assert proc.returncode == 0, err[-6000:]
    assert len(tries) >= 20 and "ACCEPTED" not in tries, tries[:50]
    assert set(tries) <= {"PERMISSION_DENIED", "FAILED_PRECONDITION"}, set(tries)
    assert "PERMISSION_DENIED" in tries
    assert_states(tmp_path / "straight.pt", tmp_path / "intruded.pt", exact=True)
