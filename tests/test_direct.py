"""The Sync socket (ps/socket_server.py, worker/socket_client.py) against a real shard server.

Results over the socket equal the gRPC stream's bitwise; a socket cut at a chosen step
(before the push is sent, or while its answer is awaited) re-registers, reconnects and
re-sends with the same result; refusals keep their status code; a wrong token is
refused; no socket (the server's --shm-socket false, or a path the rank cannot reach)
means the stream; a draining server ends an idle socket at once.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from hybridps.security import ClientSecurity
from tests.helpers import PsServer, start_ps_server
from tests.test_lifecycle import final_state
from tests.test_wire_fast import _client, _reference_deltas, _run, _steps
from worker.socket_client import SocketTransport
from worker.sync import ServerRefused, ShardClient
from worker.transport import TransportError, TransportRefused

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]  # every test starts processes

ROWS, DIM = 2000, 16
TOKEN = "direct-test-token-0123456789abcdef"


def _socket_of(server: PsServer) -> str:
    paths = glob.glob(f"/dev/shm/hybridps-sync-{server.proc.pid}-*.sock")
    assert len(paths) == 1, paths
    return paths[0]


def test_socket_equals_stream_bitwise_and_the_reference(ps_address: str) -> None:
    ids, grads = _steps(ROWS, DIM, 6)
    over_socket = _client(ps_address, ROWS, DIM, shm="on")
    got = _run(over_socket, ids, grads)
    over_stream = _client(ps_address, ROWS, DIM, shm="on", shm_socket="off")
    expected = _run(over_stream, ids, grads)
    assert over_socket.stats.transport == "socket" and over_socket.stats.shm_pushes == 6
    assert over_stream.stats.transport == "stream"
    for a, b, ref in zip(got, expected, _reference_deltas(grads, ids, ROWS, DIM,
                                                          torch.float32), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-9)


def _cut(client: ShardClient) -> None:
    transport = client._transport
    assert isinstance(transport, SocketTransport), "the client is not on the socket"
    transport.cut()


@pytest.mark.parametrize("cut_before", ["push", "take"])
def test_cut_socket_reconnects_and_resends(ps_address: str, cut_before: str) -> None:
    """Fault injection at step 3 of 6 (staleness 1): the answers equal an uncut run's."""
    ids, grads = _steps(ROWS, DIM, 6)
    reference = _reference_deltas(grads, ids, ROWS, DIM, torch.float32)
    client = _client(ps_address, ROWS, DIM, shm="on")
    client.start()
    got = []
    try:
        for step, (i, g) in enumerate(zip(ids, grads, strict=True)):
            if step == 3 and cut_before == "push":
                _cut(client)
            client.push(step, {"t": (i, g)})
            if step == 3 and cut_before == "take":
                _cut(client)
            if step >= 1:
                (update,), _ = client.take(step - 1)
                got.append(update.delta_UD.clone())
        (update,), _ = client.take(5)
        got.append(update.delta_UD.clone())
    finally:
        client.close()
    assert client.stats.reconnects >= 1 and client.stats.registers >= 2
    assert client.stats.transport == "socket"
    for a, ref in zip(got, reference, strict=True):
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-9)


def test_take_of_an_update_already_sent_is_not_a_wait(ps_address: str) -> None:
    """The socket is read only when updates are needed; one the server sent while the rank
    trained is read at once and counts as no wait (the staleness stats' `waits`)."""
    ids, grads = _steps(ROWS, DIM, 2)
    client = _client(ps_address, ROWS, DIM, shm="on")
    client.start()
    try:
        for step, (i, g) in enumerate(zip(ids, grads, strict=True)):
            client.push(step, {"t": (i, g)})
            time.sleep(0.5)  # the server answers meanwhile (a step's compute)
            (update,), blocked = client.take(step)
            assert update.step == step and not blocked, f"step {step}"
    finally:
        client.close()
    assert client.stats.transport == "socket"


def test_refusal_over_socket_keeps_its_code_and_names_the_server(ps_address: str) -> None:
    client = _client(ps_address, ROWS, DIM, shm="on")
    client.start()
    try:
        grads = torch.ones(4, DIM)
        grads[2, 5] = float("nan")
        client.push(0, {"t": (torch.tensor([1, 2, 3, 4]), grads)})
        with pytest.raises(ServerRefused) as caught:
            client.take(0)
    finally:
        client.close()
    text = str(caught.value)
    assert ps_address in text and "INVALID_ARGUMENT" in text and "non-finite" in text
    assert client.stats.transport == "socket"


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PsServer]:
    server = start_ps_server(tmp_path_factory.mktemp("ps"),
                             env={**os.environ, "HYBRIDPS_AUTH_TOKEN": TOKEN})
    yield server
    server.terminate()


def test_socket_checks_the_token(token_server: PsServer) -> None:
    path = _socket_of(token_server)
    with pytest.raises(TransportRefused) as caught:
        SocketTransport(path, "not-the-token-at-all-0123456789", 10.0, 1 << 20)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED.name
    with pytest.raises(TransportRefused) as caught:
        SocketTransport(path, "", 10.0, 1 << 20)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED.name
    ids, grads = _steps(ROWS, DIM, 3)
    client = _client(token_server.address, ROWS, DIM, shm="on",
                     security=ClientSecurity(token=TOKEN))
    got = _run(client, ids, grads)
    assert client.stats.transport == "socket"
    for a, ref in zip(got, _reference_deltas(grads, ids, ROWS, DIM, torch.float32),
                      strict=True):
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-9)


def test_no_socket_means_the_stream(tmp_path: Path) -> None:
    ids, grads = _steps(ROWS, DIM, 3)
    server = start_ps_server(tmp_path, "--shm-socket", "false")
    try:
        assert not glob.glob(f"/dev/shm/hybridps-sync-{server.proc.pid}-*.sock")
        client = _client(server.address, ROWS, DIM, shm="on")
        _run(client, ids, grads)
        assert client.stats.transport == "stream" and client.stats.shm == "on"
    finally:
        server.terminate()
    # A socket the rank cannot reach (another mount namespace): the stream, same results.
    server = start_ps_server(tmp_path)
    try:
        os.unlink(_socket_of(server))
        client = _client(server.address, ROWS, DIM, shm="on")
        got = _run(client, ids, grads)
        assert client.stats.transport == "stream" and client.stats.shm == "on"
    finally:
        server.terminate()
    for a, ref in zip(got, _reference_deltas(grads, ids, ROWS, DIM, torch.float32),
                      strict=True):
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-9)


def test_server_removes_its_socket_on_stop(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path)
    path = _socket_of(server)
    assert Path(path).is_socket()
    assert server.terminate() == 0
    assert not Path(path).exists()


def test_drain_ends_an_idle_socket_promptly_with_shutting_down(tmp_path: Path) -> None:
    """SIGTERM while a rank's socket waits for its next push: the server answers what it
    read, sends UNAVAILABLE "shutting down" (the rank then reconnects to a restarted
    server) and exits at once, not after the handlers' close timeout."""
    server = start_ps_server(tmp_path)
    try:
        ids, grads = _steps(ROWS, DIM, 3)
        client = _client(server.address, ROWS, DIM, shm="on")
        client.start()
        try:
            for step, (i, g) in enumerate(zip(ids, grads, strict=True)):
                client.push(step, {"t": (i, g)})
            updates, _ = client.take(2)
            assert [u.step for u in updates] == [0, 1, 2]
            assert client.stats.transport == "socket"
            transport = client._transport
            assert isinstance(transport, SocketTransport)
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(TransportError) as caught:
                transport.receive(10.0)
            code = server.proc.wait(10)
            elapsed = time.monotonic() - start
        finally:
            client._transport = None  # the socket is spent; close() must not wait on it
            client.close()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE.name
        assert "shutting down" in caught.value.details, caught.value.details
        assert code == 0, server.stderr()
        assert elapsed < 4.0, f"the server took {elapsed:.1f}s to stop"
        assert final_state(server.stderr())[(0, "t")] == (2, 3)
    finally:
        server.terminate()
