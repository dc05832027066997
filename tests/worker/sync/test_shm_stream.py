"""A same-node rank (the shared-memory arena, its messages on the gRPC Sync stream)
against a real shard server: the stream's failure paths with the arena.

A cut of the stream at a chosen step (before the push is sent, or while its answer is
awaited) re-registers, reconnects and re-sends with the reference's result; an answer
the server sent while the rank trained is read without a wait; a refusal keeps its
status code and names the server; a draining server ends an idle stream at once, and a
rank that pushes after it learns that the server is shutting down (not after
--ps-timeout of re-Registers). The wire protocol by hand, including a push by reference
without the partition's secret, is tests/worker/sync/test_shm_protocol.py.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

from tests.testing.helpers import start_ps_server
from tests.worker.runtime.test_lifecycle import final_state
from tests.worker.sync.test_wire_fast import _client, _reference_deltas, _steps
from worker.sync.client import ServerRefused, ServerUnavailable
from worker.sync.grpc_client import GrpcStreamTransport
from worker.sync.transport import TransportError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]  # every test starts processes

ROWS, DIM = 2000, 16


@pytest.mark.parametrize("cut_before", ["push", "take"])
def test_cut_stream_reconnects_and_resends(ps_address: str, cut_before: str) -> None:
    """Fault injection (the HYBRIDPS_FAULT_CUT path: ShardClient.cut_connection) at step
    3 of 6, staleness 1: the answers equal an uncut run's."""
    ids, grads = _steps(ROWS, DIM, 6)
    reference = _reference_deltas(grads, ids, ROWS, DIM, torch.float32)
    client = _client(ps_address, ROWS, DIM, shm="on")
    client.start()
    got = []
    try:
        for step, (i, g) in enumerate(zip(ids, grads, strict=True)):
            if step == 3 and cut_before == "push":
                client.cut_connection()
            client.push(step, {"t": (i, g)})
            if step == 3 and cut_before == "take":
                client.cut_connection()
            if step >= 1:
                (update,), _ = client.take(step - 1)
                got.append(update.delta_UD.clone())
        (update,), _ = client.take(5)
        got.append(update.delta_UD.clone())
    finally:
        client.close()
    assert client.stats.reconnects >= 1 and client.stats.registers >= 2
    assert client.stats.transport == "stream" and client.stats.shm == "on"
    assert client.stats.shm_pushes >= 6 and client.stats.shm_inline_pushes == 0
    for a, ref in zip(got, reference, strict=True):
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-9)


def test_take_of_an_update_already_sent_is_not_a_wait(ps_address: str) -> None:
    """An answer the server sent while the rank trained is taken at once and counts as no
    wait (the staleness stats' `waits`)."""
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
    assert client.stats.transport == "stream" and client.stats.shm_pushes == 2


def test_refusal_by_reference_keeps_its_code_and_names_the_server(ps_address: str) -> None:
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
    assert client.stats.transport == "stream" and client.stats.shm_pushes == 1


def test_drain_ends_an_idle_stream_promptly_with_shutting_down(tmp_path: Path) -> None:
    """SIGTERM while a rank's stream waits for its next push: the server answers what it
    read, ends the stream with UNAVAILABLE "shutting down" (the rank then stops: the state
    is gone with the server) and exits at once, not after its grace period."""
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
            assert client.stats.transport == "stream" and client.stats.shm_pushes == 3
            transport = client._transport
            assert isinstance(transport, GrpcStreamTransport)
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(TransportError) as caught:
                transport.receive(10.0)
            code = server.proc.wait(10)
            elapsed = time.monotonic() - start
        finally:
            client._transport = None  # the stream is spent; close() must not wait on it
            client.close()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE.name
        assert "shutting down" in caught.value.details, caught.value.details
        assert code == 0, server.stderr()
        assert elapsed < 4.0, f"the server took {elapsed:.1f}s to stop"
        assert final_state(server.stderr())[(0, "t")] == (2, 3)
    finally:
        server.terminate()


@pytest.mark.parametrize("shm", ["on", "off"])
def test_push_after_a_drain_stops_at_once_naming_the_shutdown(tmp_path: Path,
                                                              shm: str) -> None:
    """SIGTERM between two steps: the next push (its stream ended UNAVAILABLE "shutting
    down") is a ServerUnavailable saying the server is shutting down, at once, not after
    the 60 s --ps-timeout of a reconnect loop whose re-Registers could only find the state
    gone."""
    server = start_ps_server(tmp_path)
    try:
        ids, grads = _steps(ROWS, DIM, 4)
        client = _client(server.address, ROWS, DIM, shm=shm)
        assert client.timeout_s == 60.0
        client.start()
        try:
            for step in range(3):
                client.push(step, {"t": (ids[step], grads[step])})
            client.take(2)
            assert client.stats.transport == "stream" and client.stats.shm == shm
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(10) == 0, server.stderr()
            start = time.monotonic()
            with pytest.raises(ServerUnavailable) as caught:
                client.push(3, {"t": (ids[3], grads[3])})
                client.take(3)
            elapsed = time.monotonic() - start
        finally:
            client.close()
        assert elapsed < 5.0, f"learned of the shutdown after {elapsed:.1f}s"
        assert "is shutting down" in str(caught.value), caught.value
        assert "Broken pipe" not in str(caught.value)
    finally:
        server.terminate()
