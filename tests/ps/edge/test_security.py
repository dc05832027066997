"""Token auth on every RPC, admin token for Shutdown, TLS and mutual TLS, end to end.

Real `python -m ps` subprocesses; throwaway certificates from tests/testing/certs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from hybridps.channel_options import channel_options
from hybridps.errors import ShardError
from hybridps.partition_secret import partition_metadata
from hybridps.security import ClientSecurity, SecurityError, client_security, open_channel
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2, shard_pb2_grpc
from ps.admin import get_shard_stats, health_status
from ps.edge.auth import AuthPolicy
from ps.edge.status import status_for
from tests.testing.certs import Pki, make_pki
from tests.testing.grpc_helpers import ADAM, push_messages, table
from tests.testing.helpers import REPO, start_ps_server

TOKEN = "worker-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"
MAIN = str(REPO / "worker" / "main.py")


def rpc_code(fn: object, *args: object, **kwargs: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, **kwargs)  # type: ignore[operator]
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    return info.value.code()


def register_request(run: str = "auth") -> shard_pb2.RegisterRequest:
    return shard_pb2.RegisterRequest(run_id=run, rank=0, world_size=1, incarnation=1,
                                     tables=[table("emb", 10, 4, 0, 10)], optimizer=ADAM)


def admin_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    return subprocess.run([sys.executable, "-m", "ps.admin", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=60, env={**full, **(env or {})},
                          check=False)


# -- the policy alone -----------------------------------------------------------------

def refused_code(refusal: ShardError | None) -> grpc.StatusCode | None:
    """The status a policy's refusal ends the call with (None: allowed)."""
    return None if refusal is None else status_for(refusal)[0]


def test_policy_table() -> None:
    p = AuthPolicy(TOKEN, ADMIN)
    shard, stats = "/hybridps.v1.ShardService/Register", "/hybridps.v1.AdminService/GetShardStats"
    stop, health = "/hybridps.v1.AdminService/Shutdown", "/grpc.health.v1.Health/Check"
    assert p.check(health, "") is None
    assert p.check(shard, TOKEN) is None
    assert refused_code(p.check(shard, "")) == grpc.StatusCode.UNAUTHENTICATED
    assert refused_code(p.check(shard, ADMIN)) == grpc.StatusCode.UNAUTHENTICATED
    assert p.check(stats, TOKEN) is None and p.check(stats, ADMIN) is None
    assert refused_code(p.check(stats, "x" * 20)) == grpc.StatusCode.UNAUTHENTICATED
    assert refused_code(p.check(stop, TOKEN)) == grpc.StatusCode.UNAUTHENTICATED
    assert p.check(stop, ADMIN) is None
    assert AuthPolicy(TOKEN, "", stats_without_token=True).check(stats, "") is None
    assert AuthPolicy().check(shard, "") is None  # no token configured: open
    assert refused_code(AuthPolicy(TOKEN).check(stop, TOKEN)) == grpc.StatusCode.PERMISSION_DENIED


def test_short_or_missing_token_files_are_refused(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(SecurityError, match="at least 16"):
        client_security(token_file=str(short))
    with pytest.raises(SecurityError, match="No such file"):
        client_security(token_file=str(tmp_path / "missing"))
    good = tmp_path / "good"
    good.write_text(TOKEN + "\n")
    assert client_security(token_file=str(good)).metadata == (
        ("authorization", f"Bearer {TOKEN}"),)


# -- a token-protected server -----------------------------------------------------------

@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("token-ps")
    token_file = directory / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    server = start_ps_server(directory, "--auth-token-file", str(token_file),
                             env={"HYBRIDPS_ADMIN_TOKEN": ADMIN})
    try:
        yield server.address
    finally:
        server.terminate()


@pytest.mark.e2e
def test_every_rpc_needs_the_token_and_a_refusal_changes_nothing(token_server: str) -> None:
    with open_channel(token_server, channel_options()) as ch:
        shard = shard_pb2_grpc.ShardServiceStub(ch)
        admin = admin_pb2_grpc.AdminServiceStub(ch)
        push = push_messages("auth", 0, "emb", torch.tensor([1]), torch.ones(1, 4),
                             incarnation=1)
        for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),),
                         (("authorization", TOKEN),)):  # no "Bearer ": not a token
            calls = [
                (shard.Register, register_request()),
                (shard.Sync, iter(push)),
                (shard.Flush, shard_pb2.FlushRequest(run_id="auth", rank=0, step=0)),
                (shard.Finish, shard_pb2.FinishRequest(run_id="auth", rank=0)),
                (shard.Checkpoint, shard_pb2.CheckpointRequest(run_id="auth", step=0,
                                                               directory="/tmp/x")),
                (admin.GetShardStats, admin_pb2.ShardStatsRequest()),
                (admin.Shutdown, admin_pb2.ShutdownRequest()),
            ]
            for fn, request in calls:
                assert rpc_code(fn, request, timeout=10, metadata=metadata) == \
                    grpc.StatusCode.UNAUTHENTICATED, fn
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(ch).get_services()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open.
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                     timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Nothing changed: no partition; the refusals were counted.
        ok = ClientSecurity(token=TOKEN)
        stats = get_shard_stats(token_server, security=ok)
        assert not stats.partitions and stats.pushes_applied_total == 0
        assert stats.refusals["unauthenticated"] >= 21
        # With the token everything works (and the admin token reads stats too).
        secret = shard.Register(register_request(), timeout=10,
                                metadata=ok.metadata).partition_secret
        answers = list(shard.Sync(iter(push), timeout=10, metadata=ok.metadata
                                  + partition_metadata("auth", 0, secret)))
        assert [a.update.step for a in answers] == [0]
        assert get_shard_stats(token_server, security=ClientSecurity(token=ADMIN)
                               ).pushes_applied_total == 1


@pytest.mark.e2e
def test_admin_cli_with_tokens(token_server: str, tmp_path: Path) -> None:
    assert admin_cli("health", "--ps", token_server).returncode == 0
    refused = admin_cli("stats", "--ps", token_server)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    token_file = tmp_path / "t"
    token_file.write_text(TOKEN)
    ok = admin_cli("stats", "--ps", token_server, "--auth-token-file", str(token_file))
    assert ok.returncode == 0, ok.stderr
    assert "server " in ok.stdout
    assert admin_cli("stats", "--ps", token_server,
                     env={"HYBRIDPS_AUTH_TOKEN": TOKEN}).returncode == 0
    # Shutdown with the worker token is refused; the server keeps serving.
    wrong = admin_cli("shutdown", "--ps", token_server, env={"HYBRIDPS_ADMIN_TOKEN": TOKEN})
    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr
    assert health_status(token_server) == "SERVING"


@pytest.mark.e2e
def test_shutdown_with_the_admin_token_stops_the_server(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path, env={"HYBRIDPS_ADMIN_TOKEN": ADMIN})
    try:
        done = admin_cli("shutdown", "--ps", server.address, "--reason", "test",
                         env={"HYBRIDPS_ADMIN_TOKEN": ADMIN})
        assert done.returncode == 0, done.stderr
        assert server.proc.wait(30) == 0
        err = server.stderr()
        assert "event=stop_requested" in err and "admin Shutdown" in err
        assert "event=stopped" in err
    finally:
        server.terminate()


@pytest.mark.e2e
def test_shutdown_is_refused_without_an_admin_token_and_stats_flag(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path, "--stats-without-token", env={
        "HYBRIDPS_AUTH_TOKEN": TOKEN})
    try:
        with open_channel(server.address, channel_options()) as ch:
            admin = admin_pb2_grpc.AdminServiceStub(ch)
            assert rpc_code(admin.Shutdown, admin_pb2.ShutdownRequest(), timeout=10,
                            metadata=(("authorization", f"Bearer {TOKEN}"),)) == \
                grpc.StatusCode.PERMISSION_DENIED
            admin.GetShardStats(admin_pb2.ShardStatsRequest(), timeout=10)  # no token: ok
            shard = shard_pb2_grpc.ShardServiceStub(ch)
            assert rpc_code(shard.Register, register_request(), timeout=10) == \
                grpc.StatusCode.UNAUTHENTICATED
        assert server.proc.poll() is None
    finally:
        server.terminate()


# -- TLS --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.e2e
def test_tls_end_to_end_and_wrong_ca_fails_the_handshake(pki: Pki, tmp_path: Path) -> None:
    server = start_ps_server(tmp_path, "--tls-cert", str(pki.server_cert), "--tls-key",
                             str(pki.server_key))
    try:
        good = client_security(ca_file=str(pki.ca))
        assert health_status(server.address, security=good) == "SERVING"
        stats = get_shard_stats(server.address, security=good)
        assert stats.server_id
        # The name in the certificate is checked: "localhost" via the override works too.
        by_name = client_security(ca_file=str(pki.ca), server_name="localhost")
        assert health_status(server.address, security=by_name) == "SERVING"
        wrong = client_security(ca_file=str(pki.other_ca))
        with pytest.raises(grpc.RpcError) as info:
            health_status(server.address, timeout=5, security=wrong)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = (info.value.details() or "").lower()
        assert "handshake" in details or "certificate_verify_failed" in details, details
        with pytest.raises(grpc.RpcError) as info:  # a plaintext client gets nowhere
            health_status(server.address, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        cli = admin_cli("health", "--ps", server.address, "--tls-ca", str(pki.ca))
        assert cli.returncode == 0 and "SERVING" in cli.stdout, cli.stderr
        assert "tls=on" in server.stderr()
    finally:
        server.terminate()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_mutual_tls_rejects_a_client_without_a_certificate_and_trains_with_one(
        pki: Pki, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server = start_ps_server(tmp_path, "--tls-cert", str(pki.server_cert), "--tls-key",
                             str(pki.server_key), "--tls-client-ca", str(pki.ca),
                             "--auth-token-file", str(token_file))
    try:
        no_cert = client_security(ca_file=str(pki.ca))
        with pytest.raises(grpc.RpcError) as info:
            health_status(server.address, timeout=5, security=no_cert)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = client_security(ca_file=str(pki.ca), cert_file=str(pki.client_cert),
                                    key_file=str(pki.client_key))
        assert health_status(server.address, security=with_cert) == "SERVING"
        # A worker (world of one) trains over mutual TLS + token.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
        proc = subprocess.run(
            [sys.executable, MAIN, "--ps", server.address, "--tls-ca", str(pki.ca),
             "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key),
             "--auth-token-file", str(token_file), "--num-rows", "500", "--batch-size", "16",
             "--steps", "6", "--dim", "4", "--log-every", "3", "--eval-batches", "0",
             "--progress", "false", "--run-id", "mtls"],
            cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
            timeout=180, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "connection=tls+client-cert+token" in proc.stderr
        stats = get_shard_stats(server.address, run_id="mtls",
                                security=ClientSecurity(token=TOKEN, tls=True,
                                                        ca=with_cert.ca, cert=with_cert.cert,
                                                        key=with_cert.key))
        assert stats.partitions and all(p.last_step == 5 for p in stats.partitions)
        assert "tls=mutual" in server.stderr()
    finally:
        server.terminate()
