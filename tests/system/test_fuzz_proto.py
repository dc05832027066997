"""Hypothesis-generated messages against a live server while a
healthy run trains alongside. Every answer is OK or a clear status (never INTERNAL or
UNKNOWN), the server keeps serving, and the healthy run's answers are bitwise those of
the same pushes on a server of its own (an in-process Store).

This runs a few hundred messages of every unary kind (Page, every optimizer kind,
dynamic tables) plus raw bytes, in about a minute;
`test_short_fuzz_covers_every_rpc_kind_and_table_mode` runs fuzz/fuzz_proto.py alone
for seconds and checks its coverage (every RPC of the proto services, every optimizer
kind of hybridps/optim_kinds.py registered and pushed to, static and dynamic tables,
Page calls applied and peeks) and that the server survives it (no INTERNAL/UNKNOWN,
SERVING, valid calls of every kind answered right after);
`test_fuzz_campaign_2000_messages` runs it with 2,000 messages (field mutations of valid
messages of every kind, Sync streams included, and raw bytes) beside a real 2-rank
training run, which must end bitwise equal to the same run alone. The
100,000-message campaign is `python fuzz/fuzz_proto.py` (figures: docs/reliability.md).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridps import wire
from hybridps.optim import OptimizerSpec
from hybridps.optim_kinds import KINDS
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2, shard_pb2_grpc
from ps.core.partition import PushChunk, TableSpec
from ps.core.store import Store
from tests.testing.grpc_helpers import ADAM, assemble, open_channel, push_messages, register, table
from tests.testing.helpers import PsServer, start_ps_server

HEALTHY = "healthy-run"
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.one_of(st.integers(-3, 40), st.integers(-(2**63), 2**63 - 1))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -0.0, 1e-300, 1e300, math.nan, math.inf, -1.0]))
NAMES = st.one_of(st.sampled_from(["emb", "fuzz", "", "..", "../x", "a/b", "x" * 300]),
                  st.text(max_size=40))
RUNS = NAMES.filter(lambda r: r != HEALTHY)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    srv = start_ps_server(tmp_path_factory.mktemp("fuzz"), "--max-state-bytes",
                          str(64 << 20), "--stats-without-token")
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def channel(server: PsServer) -> Iterator[grpc.Channel]:
    with open_channel(server.address) as ch:
        yield ch


def _call(fn: object, request: object) -> None:
    try:
        fn(request, timeout=20)  # type: ignore[operator]
    except grpc.RpcError as exc:
        assert exc.code() not in BAD_CODES, (exc.code(), exc.details(), request)


tensors = st.builds(
    lambda dtype, shape, n: shard_pb2.Tensor(dtype=dtype, shape=shape, data=bytes(n)),
    st.integers(0, 12), st.lists(st.integers(-2, 2**40), max_size=3), st.integers(0, 256))
specs = st.builds(shard_pb2.TableSpec, name=NAMES, num_rows=INT64, dim=INT64,
                  row_start=INT64, row_end=INT64, dynamic=st.booleans())
KIND_NUMBERS = shard_pb2.OptimizerConfig.Kind.values()
# every kind of the proto's enum, and one number past it
optimizers = st.builds(shard_pb2.OptimizerConfig, kind=st.integers(0, max(KIND_NUMBERS) + 1),
                       lr=FLOATS, beta1=FLOATS, beta2=FLOATS, eps=FLOATS,
                       weight_decay=FLOATS)
id_tensors = st.one_of(st.builds(lambda v: wire.encode(torch.tensor(v, dtype=torch.int64)),
                                 st.lists(INT64, max_size=6)), tensors)
requests = st.one_of(
    st.tuples(st.just("Register"), st.builds(
        shard_pb2.RegisterRequest, run_id=RUNS, rank=INT32, world_size=INT32,
        incarnation=INT64, tables=st.lists(specs, max_size=3), optimizer=optimizers,
        row_dtype=st.integers(0, 12))),
    st.tuples(st.just("Flush"), st.builds(shard_pb2.FlushRequest, run_id=RUNS, rank=INT32,
                                          step=INT64, timeout_s=st.sampled_from(
                                              [0.0, 0.01, -1.0, math.nan, math.inf, 1e300]))),
    st.tuples(st.just("Checkpoint"), st.builds(
        shard_pb2.CheckpointRequest, run_id=RUNS, step=INT64, directory=NAMES,
        ranks=st.lists(INT32, max_size=3),
        timeout_s=st.sampled_from([0.0, 0.01, -1.0, math.nan, math.inf]),
        deferred=st.booleans())),
    st.tuples(st.just("CheckpointDone"), st.builds(
        shard_pb2.CheckpointDoneRequest, run_id=RUNS, step=INT64, directory=NAMES,
        ranks=st.lists(INT32, max_size=3))),
    st.tuples(st.just("Finish"), st.builds(shard_pb2.FinishRequest, run_id=RUNS, rank=INT32,
                                           incarnation=INT64, last_step=INT64,
                                           aborted=st.booleans(), reason=st.text(max_size=20))),
    st.tuples(st.just("SeedRows"), st.builds(shard_pb2.SeedRowsRequest, run_id=RUNS,
                                             rank=INT32, incarnation=INT64, table=NAMES,
                                             row_start=INT64, rows=tensors)),
    st.tuples(st.just("Page"), st.builds(
        shard_pb2.PageRequest, run_id=RUNS, rank=INT32, incarnation=INT64, table=NAMES,
        step=INT64, seq=INT64, expire_steps=INT64, out_ids=id_tensors, out_slots=id_tensors,
        out_rows=tensors, out_seen=id_tensors, out_freq=id_tensors, in_ids=id_tensors,
        in_slots=id_tensors, peek=st.booleans())),
    st.tuples(st.just("GetShardStats"), st.builds(admin_pb2.ShardStatsRequest, run_id=NAMES)),
    st.tuples(st.just("raw"), st.binary(max_size=200)),
)


def _healthy_push(stub: shard_pb2_grpc.ShardServiceStub, step: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randperm(50, generator=gen)[:8].sort().values
    grads = torch.randn(8, 4, generator=gen)
    (answer,) = assemble(list(stub.Sync(iter(push_messages(HEALTHY, step, "emb", ids, grads)),
                                        timeout=30)))
    return ids, grads, answer[3]


def test_fuzzed_messages_beside_a_healthy_run(channel: grpc.Channel) -> None:
    shard = shard_pb2_grpc.ShardServiceStub(channel)
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    register(shard, HEALTHY, [table("emb", 50, 4, 0, 50)])
    solo = Store()
    solo.register(HEALTHY, 0, 1, 0, [TableSpec("emb", 50, 4, 0, 50)],
                  OptimizerSpec("adam", lr=ADAM.lr, beta1=ADAM.beta1, beta2=ADAM.beta2,
                                eps=ADAM.eps))
    step = [0]
    raw = {name: channel.unary_unary(f"/hybridps.v1.{svc}/{name}",
                                     request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
           for svc, name in (("ShardService", "Register"), ("ShardService", "Flush"),
                             ("ShardService", "Page"), ("AdminService", "GetShardStats"))}

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests)
    def fuzz(item: tuple[str, object]) -> None:
        kind, request = item
        if kind == "raw":
            for call in raw.values():
                _call(call, request)
        elif kind == "GetShardStats":
            _call(admin.GetShardStats, request)
        else:
            _call(getattr(shard, kind), request)
        # the healthy run pushes a step now and then, interleaved with the fuzz
        if step[0] < 40:
            ids, grads, delta = _healthy_push(shard, step[0])
            mine = solo.open_session().feed(PushChunk(HEALTHY, 0, 0, step[0], "emb", ids,
                                                      grads))
            assert mine is not None and torch.equal(mine.delta, delta), step[0]
            step[0] += 1

    fuzz()
    assert step[0] == 40
    stats = admin.GetShardStats(admin_pb2.ShardStatsRequest(run_id=HEALTHY), timeout=10)
    assert [p.last_step for p in stats.partitions] == [39]
    assert wire is not None  # the helpers encode with it


@pytest.mark.timeout(300)
def test_short_fuzz_covers_every_rpc_kind_and_table_mode(tmp_path: Path) -> None:
    """The fuzzer reaches Page, dynamic tables and every optimizer kind,
    and fails on a kind or an RPC it never exercised; the server survives its barrage."""
    out = tmp_path / "fuzz.json"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(repo / "fuzz" / "fuzz_proto.py"), "--messages",
                           "800", "--seed", "11", "--without-healthy-runs",
                           "--dir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=repo, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["failures"] == [] and figures["generator_errors"] == [], proc.stdout
    # survival: clean statuses only, the server SERVING, valid calls right after
    assert not set(figures["codes"]) & {"INTERNAL", "UNKNOWN"}, proc.stdout
    assert figures["server_alive"] and figures["health"] == "SERVING"
    assert figures["after_fuzz_problems"] == [], figures["after_fuzz_problems"]
    # coverage, against the registry and the proto here (not the fuzzer's own list)
    sent, ok = figures["coverage"]["sent"], figures["coverage"]["ok"]
    methods = [m.name for pb, svc in ((shard_pb2, "ShardService"), (admin_pb2, "AdminService"))
               for m in pb.DESCRIPTOR.services_by_name[svc].methods]
    assert "Page" in methods and len(methods) >= 10
    assert not [m for m in methods if not sent.get(f"rpc {m}")], sent
    for rpc in ("Register", "Sync", "Page"):
        assert ok.get(f"rpc {rpc}"), (rpc, ok)
    kinds = set(KINDS) | {shard_pb2.OptimizerConfig.Kind.Name(n).lower()
                          for n in KIND_NUMBERS if n}
    assert {"adagrad", "rowwise_adagrad", "partial_rowwise_adam"} <= kinds
    assert not [k for k in kinds if not ok.get(f"register {k}") or not ok.get(f"push {k}")], ok
    for label in ("register table static", "register table dynamic", "push table dynamic",
                  "page move", "page peek"):
        assert ok.get(label), (label, ok)
    # Page calls got past the first checks to the paging core's own refusals
    assert figures["by_method"].get("Page INVALID_ARGUMENT", 0) > 0, figures["by_method"]
    assert figures["by_method"].get("Page OK", 0) >= 10, figures["by_method"]


@pytest.mark.timeout(900)
def test_fuzz_campaign_2000_messages(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(repo / "fuzz" / "fuzz_proto.py"), "--messages",
                           "2000", "--dir", str(tmp_path / "work"), "--json", str(out)],
                          cwd=repo, capture_output=True, text=True, timeout=850, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["failures"] == [] and figures["messages"] >= 2000, proc.stdout
    assert not set(figures["codes"]) & {"INTERNAL", "UNKNOWN"}, proc.stdout
    assert figures["server_alive"] and figures["health"] == "SERVING"
    assert figures["healthy_runs"] and all(h["bitwise_equal"] for h in figures["healthy_runs"])
    assert figures["codes"].get("OK", 0) > 0, "nothing the fuzzer sent was accepted"
    # the fuzzer sends each partition's secret: without it every Sync is PERMISSION_DENIED
    assert figures["pushes_applied"] > 0, proc.stdout
    assert figures["by_method"].get("Sync OK", 0) > 0, proc.stdout


def test_refused_admin_calls_with_undecodable_bytes_are_refused_cleanly(
        channel: grpc.Channel) -> None:
    """Found by fuzz/fuzz_proto.py: a call the auth interceptor refuses (Shutdown and
    DropRun on a server without an admin token) whose bytes are no message was answered
    UNKNOWN with a DecodeError traceback in the server log: the refusing handler decoded
    the request it never needs."""
    for name in ("Shutdown", "DropRun"):
        call = channel.unary_unary(f"/hybridps.v1.AdminService/{name}",
                                   request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\xff\xff\xff", timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, (
            name, refused.value.code(), refused.value.details())

