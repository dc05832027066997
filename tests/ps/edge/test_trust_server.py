"""What the server trusts, over gRPC against a real server: status codes of undecodable requests,
non-finite timeouts, names, the checkpoint root, damaged restores, the state budget;
starting without a token on a non-loopback address; the generated token file; DropRun
and the retention of finished runs in stats."""

from __future__ import annotations

import math
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hybridps.checkpoint import optim_file, step_dir, write_manifest
from hybridps.partition_secret import run_secret_metadata
from hybridps.run_secret import claim_directory
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2
from tests.ps.core.test_trust_core import flip_tensor_bytes
from tests.testing.grpc_helpers import (
    ADAM,
    open_channel,
    push_messages,
    register,
    shard_stub,
    table,
)
from tests.testing.helpers import REPO, PsServer, start_ps_server

ADMIN_TOKEN = "admin-token-0123456789abcdef"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    base = tmp_path_factory.mktemp("trust")
    root = base / "root"
    root.mkdir()
    srv = start_ps_server(base, "--checkpoint-root", str(root), "--max-state-bytes",
                          str(1 << 20), "--finished-run-retention-s", "1", "--stats-without-token",
                          env={"HYBRIDPS_ADMIN_TOKEN": ADMIN_TOKEN})
    yield srv
    srv.terminate()


def _root(server: PsServer) -> Path:
    return server.directory.parent / "root"


def _raw(channel: grpc.Channel, method: str, data: bytes) -> grpc.RpcError:
    call = channel.unary_unary(method, request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as info:
        call(data, timeout=10, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),))
    return info.value


@pytest.mark.parametrize("method", ["/hybridps.v1.ShardService/Register",
                                    "/hybridps.v1.AdminService/GetShardStats",
                                    "/hybridps.v1.ShardService/Flush"])
def test_random_bytes_are_invalid_argument(server: PsServer, method: str) -> None:
    garbage = bytes([0x0A, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F]) + os.urandom(64)  # bad length
    with open_channel(server.address) as ch:
        err = _raw(ch, method, garbage)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert "not a valid" in (err.details() or "")
        stats = admin_pb2_grpc.AdminServiceStub(ch).GetShardStats(
            admin_pb2.ShardStatsRequest(), timeout=10)  # the server is fine
        assert stats.server_id


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 1e9])
def test_flush_with_a_non_finite_timeout_is_invalid_argument(server: PsServer,
                                                             timeout: float) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        register(stub, "flush-nan", [table("emb", 10, 4, 0, 10)])
        with pytest.raises(grpc.RpcError) as info:
            stub.Flush(shard_pb2.FlushRequest(run_id="flush-nan", rank=0, step=3,
                                              timeout_s=timeout), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "timeout_s" in (info.value.details() or "")


def test_bad_names_over_the_wire(server: PsServer) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        for run, name in (("../x", "emb"), ("ok", "../../evil")):
            with pytest.raises(grpc.RpcError) as info:
                register(stub, run, [table(name, 10, 4, 0, 10)])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "../" in (info.value.details() or "")


SECRET = "5e" * 32  # the run secret of the runs below (hybridps/run_secret.py)


def _trained_run(stub: Any, run: str, claim: Path | None = None) -> None:
    """Two steps of `run`; `claim`: its checkpoint directory, claimed with SECRET as the
    run's workers do."""
    if claim is not None:
        claim_directory(claim, prefer=SECRET)
    register(stub, run, [table("emb", 10, 4, 0, 10)], run_secret=SECRET)
    for step in range(2):
        list(stub.Sync(iter(push_messages(run, step, "emb", torch.tensor([1, 7]),
                                          torch.ones(2, 4))), timeout=30))


def test_checkpoint_outside_the_root_is_permission_denied(server: PsServer,
                                                          tmp_path: Path) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        _trained_run(stub, "root-run", _root(server) / "root-run")
        for directory in (str(tmp_path / "elsewhere"), "../escape", "/tmp"):
            with pytest.raises(grpc.RpcError) as info:
                stub.Checkpoint(shard_pb2.CheckpointRequest(run_id="root-run", step=1,
                                                            directory=directory), timeout=30)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
            assert "--checkpoint-root" in (info.value.details() or "")
        assert not (tmp_path / "elsewhere").exists()
        reply = stub.Checkpoint(shard_pb2.CheckpointRequest(
            run_id="root-run", step=1, directory="root-run/step-0000000001"), timeout=30)
        assert (_root(server) / "root-run" / "step-0000000001" / reply.files[0].file).is_file()


def test_checkpoint_directory_the_file_system_refuses_is_invalid_argument(
        server: PsServer) -> None:
    """Found by fuzz/fuzz_proto.py: a directory name of 300 characters was INTERNAL
    (OSError: File name too long); so was a path through a regular file."""
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        _trained_run(stub, "fs-run", _root(server) / "fs-run")
        a_file = _root(server) / "fs-run-file"
        a_file.write_text("not a directory")
        for directory in ("fs-run/" + "x" * 300, "fs-run-file/sub"):
            with pytest.raises(grpc.RpcError) as info:
                stub.Checkpoint(shard_pb2.CheckpointRequest(run_id="fs-run", step=1,
                                                            directory=directory), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert "cannot write into checkpoint directory" in (info.value.details() or "")
        assert a_file.read_text() == "not a directory"
        reply = stub.Checkpoint(shard_pb2.CheckpointRequest(
            run_id="fs-run", step=1, directory="fs-run/step-0000000001"), timeout=30)
        assert reply.files
    assert "internal_error" not in server.stderr()


def test_restore_of_a_damaged_checkpoint_is_data_loss_naming_the_file(
        server: PsServer) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        _trained_run(stub, "damaged", _root(server) / "damaged")
        directory = step_dir(_root(server) / "damaged", 1)
        reply = stub.Checkpoint(shard_pb2.CheckpointRequest(run_id="damaged", step=1,
                                                            directory=str(directory)),
                                timeout=30)
        f = reply.files[0]
        entry = {"file": f.file, "bytes": f.bytes, "crc32": f.crc32}
        write_manifest(directory, {"step": 1, "world_size": 1, "tables": {"emb": {
            "num_rows": 10, "dim": 4, "shards": [{"rank": 0, "row_start": 0, "row_end": 10,
                                                  "rows": entry, "optim": entry}]}}})
        victim = directory / optim_file("emb", 0)
        flip_tensor_bytes(victim, "m")
        request = shard_pb2.RegisterRequest(
            run_id="damaged", rank=0, world_size=1, incarnation=1,
            tables=[table("emb", 10, 4, 0, 10)], optimizer=ADAM,
            restore=shard_pb2.RestoreFrom(directory=str(directory), step=1))
        with pytest.raises(grpc.RpcError) as info:
            stub.Register(request, timeout=30, metadata=run_secret_metadata(SECRET))
        assert info.value.code() == grpc.StatusCode.DATA_LOSS, info.value
        assert str(victim) in (info.value.details() or "")
        stats = admin_pb2_grpc.AdminServiceStub(ch).GetShardStats(
            admin_pb2.ShardStatsRequest(run_id="damaged"), timeout=10)
        assert [(p.incarnation, p.last_step) for p in stats.partitions] == [(0, 1)]


def test_register_beyond_max_state_bytes_is_resource_exhausted(server: PsServer) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        with pytest.raises(grpc.RpcError) as info:
            register(stub, "too-big", [table("emb", 1 << 20, 16, 0, 1 << 20)])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-state-bytes" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            register(stub, "huge", [table("emb", 2**62, 16, 0, 2**62)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_finished_runs_are_freed_and_drop_run_frees_at_once(server: PsServer) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        admin = admin_pb2_grpc.AdminServiceStub(ch)
        for run in ("finished-run", "dropped-run"):
            _trained_run(stub, run)
        stub.Finish(shard_pb2.FinishRequest(run_id="finished-run", rank=0, last_step=1),
                    timeout=10)
        stats = admin.GetShardStats(admin_pb2.ShardStatsRequest(), timeout=10)
        states = {r.run_id: r.state for r in stats.runs}
        assert states["finished-run"] == "finished" and states["dropped-run"] == "active"
        freed_before = stats.runs_freed
        deadline = time.monotonic() + 20  # retention 1 s, checked every 2 s
        while time.monotonic() < deadline:
            stats = admin.GetShardStats(admin_pb2.ShardStatsRequest(), timeout=10)
            if not any(p.run_id == "finished-run" for p in stats.partitions):
                break
            time.sleep(0.3)
        assert not any(p.run_id == "finished-run" for p in stats.partitions)
        assert stats.runs_freed == freed_before + 1
        # drop-run: the admin token only
        cli = [sys.executable, "-m", "ps.admin", "drop-run", "--ps", server.address,
               "--run", "dropped-run"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
        refused = subprocess.run(cli, cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=60, check=False)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        done = subprocess.run(cli, cwd=REPO, env={**env, "HYBRIDPS_ADMIN_TOKEN": ADMIN_TOKEN},
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert "freed 1 partitions" in done.stdout
        stats = admin.GetShardStats(admin_pb2.ShardStatsRequest(), timeout=10)
        assert not any(p.run_id == "dropped-run" for p in stats.partitions)
        assert stats.runs_freed == freed_before + 2
        with pytest.raises(grpc.RpcError) as info:  # the run is gone: pushes are refused
            list(stub.Sync(iter(push_messages("dropped-run", 2, "emb", torch.tensor([1]),
                                              torch.ones(1, 4))), timeout=30))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _launch(tmp_path: Path, *args: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_AUTH")}
    return subprocess.run([sys.executable, "-m", "ps", "--port", "0", *args], cwd=REPO,
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_non_loopback_without_a_token_refuses_to_start(tmp_path: Path, host: str) -> None:
    proc = _launch(tmp_path, "--host", host)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hybridps-ps:")]
    assert len(lines) == 1 and "without a token" in lines[0]
    assert "--auth-token-file" in lines[0] and "--insecure" in lines[0]
    assert "Traceback" not in proc.stderr


def test_insecure_lets_it_start_with_a_warning(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path, "--host", "0.0.0.0", "--insecure")
    try:
        server.host = "127.0.0.1"  # reach it over loopback
        with open_channel(server.address) as ch:
            register(shard_stub(ch), "insecure", [table("emb", 10, 4, 0, 10)])
    finally:
        assert server.terminate() == 0
    assert "event=no_auth" in server.stderr()


def test_generated_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "volume" / "auth-token"
    server = start_ps_server(tmp_path, "--host", "0.0.0.0", "--auth-token-file",
                             str(token_file), "--generate-auth-token")
    try:
        mode = stat.S_IMODE(token_file.stat().st_mode)
        assert mode == 0o600, oct(mode)
        token = token_file.read_text().strip()
        assert len(token) >= 32
        server.host = "127.0.0.1"
        with open_channel(server.address) as ch:
            stub = shard_stub(ch)
            with pytest.raises(grpc.RpcError) as info:
                register(stub, "tok", [table("emb", 10, 4, 0, 10)])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.Register(shard_pb2.RegisterRequest(
                run_id="tok", rank=0, world_size=1, tables=[table("emb", 10, 4, 0, 10)],
                optimizer=ADAM), timeout=30, metadata=(("authorization", f"Bearer {token}"),))
    finally:
        server.terminate()
    # A second start keeps the file (workers already read it).
    again = start_ps_server(tmp_path, "--auth-token-file", str(token_file),
                            "--generate-auth-token")
    again.terminate()
    assert token_file.read_text().strip() == token


def test_a_long_finish_reason_is_clipped_in_the_log(server: PsServer) -> None:
    with open_channel(server.address) as ch:
        stub = shard_stub(ch)
        _trained_run(stub, "long-reason")
        stub.Finish(shard_pb2.FinishRequest(run_id="long-reason", rank=0, last_step=1,
                                            reason="why " * 50_000), timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "long-reason" not in server.stderr() + server.stdout():
        time.sleep(0.1)
    lines = [line for line in (server.stderr() + server.stdout()).splitlines()
             if "event=finish" in line and "long-reason" in line]
    assert lines, "no finish line for the run"
    assert "(200000 characters)" in lines[0]
    assert len(lines[0]) < 1000
