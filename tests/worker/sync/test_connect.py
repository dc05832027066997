"""A worker that cannot reach its shard server fails fast, says why last, leaves nothing.

Unit: worker/sync/connect.py's retry window (a fake clock). End to end:
`python -m worker.launch` (torchrun) with 2 ranks against an address
where nothing listens, a host name that does not resolve, and a server that refuses the
Register (a --max-state-bytes too small for the run): each ends within a bound, with the
rank's one error line last (no torchrun traceback), and no shared-memory arena left in
/dev/shm. The launcher's pre-check names a server that wants a token the worker lacks (or
has wrong), and an address that answers HTTP/1, before any rank starts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridps.arena_layout import SHM_DIR
from tests.testing.helpers import start_ps_server
from worker.sync.connect import FIRST_CONNECT_S, call_until_connected, connect_window_s
from worker.sync.transport import TransportRefused, TransportRetryable
from worker.updates.source import ServerUnavailable

REPO = Path(__file__).resolve().parents[3]
MAIN = str(REPO / "worker" / "main.py")
SMALL = ["--num-rows", "2000", "--batch-size", "32", "--steps", "20", "--dim", "8",
         "--progress", "false"]
# The arenas of these workers have a size no other test uses: those left behind are ours.
ARENA_MB = 37
# The workers run with --ps-timeout 120, which the old first Register waited out in full
# (DEADLINE_EXCEEDED after 120 s); now the rank fails 5 s after its first attempt. The
# bound is generous: a rank's start (torch, gloo) alone took 25 s on a 2-core machine
# under a load of 6.
PS_TIMEOUT_S = 120
FAIL_WITHIN_S = 75.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_unreachable_is_retried_for_the_window_then_named() -> None:
    clock = FakeClock()
    calls: list[float] = []

    def attempt(left: float) -> str:
        calls.append(left)
        raise TransportRetryable("UNAVAILABLE", "failed to connect to all addresses; last "
                                 "error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused")

    with pytest.raises(ServerUnavailable) as info:
        call_until_connected(attempt, address="127.0.0.1:1", rank=3, timeout_s=60.0,
                             window_s=5.0, sleep=clock.sleep, clock=clock)
    text = str(info.value)
    assert text.startswith("rank 3: could not register with shard server 127.0.0.1:1 "
                           "within 5s")
    assert "connection refused" in text and "check that the shard server is running" in text
    assert len(calls) > 3 and clock.now <= 5.0  # retried with backoff, within the window
    assert calls[0] == 60.0 and all(left <= 60.0 for left in calls)


def test_an_unresolvable_host_is_named() -> None:
    clock = FakeClock()

    def attempt(left: float) -> str:
        raise TransportRetryable("UNAVAILABLE", "errors resolving nosuchhost.invalid:5000: "
                                 "[... Domain name not found]")

    with pytest.raises(ServerUnavailable) as info:
        call_until_connected(attempt, address="nosuchhost.invalid:5000", rank=0,
                             timeout_s=60.0, window_s=2.0, sleep=clock.sleep, clock=clock)
    assert ("the host name 'nosuchhost.invalid' does not resolve: check the host in --ps"
            in str(info.value))


def test_a_server_that_starts_within_the_window_is_registered_with() -> None:
    clock = FakeClock()
    answers: Iterator[str | None] = iter([None, None, None, "registered"])

    def attempt(left: float) -> str:
        answer = next(answers)
        if answer is None:
            raise TransportRetryable("UNAVAILABLE", "Connection refused")
        return answer

    assert call_until_connected(attempt, address="h:1", rank=0, timeout_s=60.0, window_s=5.0,
                                sleep=clock.sleep, clock=clock) == "registered"


def test_other_errors_are_not_retried() -> None:
    clock = FakeClock()
    calls = []

    def attempt(left: float) -> str:
        calls.append(left)
        raise TransportRefused("UNAUTHENTICATED", "missing or wrong auth token")

    with pytest.raises(TransportRefused):
        call_until_connected(attempt, address="h:1", rank=0, timeout_s=60.0, window_s=5.0,
                             sleep=clock.sleep, clock=clock)
    assert len(calls) == 1 and clock.sleeps == []


def test_a_restarted_rank_waits_the_whole_timeout() -> None:
    assert connect_window_s(60.0, {}) == FIRST_CONNECT_S
    assert connect_window_s(60.0, {"TORCHELASTIC_RESTART_COUNT": "0"}) == FIRST_CONNECT_S
    assert connect_window_s(2.0, {}) == 2.0
    assert connect_window_s(60.0, {"TORCHELASTIC_RESTART_COUNT": "1"}) == 60.0


# -- end to end ---------------------------------------------------------------------------


def _our_arenas() -> set[str]:
    """Arena files in /dev/shm of the size these tests' workers use."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return set()
    found = set()
    for name in names:
        if name.startswith("hybridps-") and name.endswith(".arena"):
            try:
                size = os.stat(os.path.join(SHM_DIR, name)).st_size
            except OSError:
                continue
            if size == ARENA_MB << 20:
                found.add(name)
    return found


def _assert_no_arena_left(before: set[str]) -> None:
    left = _our_arenas() - before
    for name in left:  # not left for the next run either
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, name))
    assert left == set(), "a rank left its arena in /dev/shm"


def _launch(ps: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "worker.launch", "--standalone", "--nproc_per_node", "2",
           MAIN, "--ps", ps, "--same-node-mb", str(ARENA_MB), "--ps-timeout",
           str(PS_TIMEOUT_S), *SMALL, *extra]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=150, check=False)
    return proc, time.monotonic() - started


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _free_port() -> int:
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["refused", "unresolvable"])
def test_an_unreachable_server_fails_fast_with_one_line_last(kind: str) -> None:
    address = f"127.0.0.1:{_free_port()}" if kind == "refused" else "nosuchhost.invalid:5000"
    hint = ("check that the shard server is running" if kind == "refused"
            else "does not resolve: check the host in --ps")
    before = _our_arenas()
    proc, seconds = _launch(address)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert seconds < FAIL_WITHIN_S, f"took {seconds:.1f}s\n{proc.stderr[-4000:]}"
    last = _last_line(proc.stderr)
    # the launcher checks the server before it starts any rank (worker/config/preflight.py)
    assert last.startswith("hybridps-run: error: "), proc.stderr[-4000:]
    assert f"could not register with shard server {address} within 5s " in last
    assert hint in last, last
    assert "Traceback" not in proc.stderr and "DEADLINE_EXCEEDED" not in proc.stderr
    _assert_no_arena_left(before)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_refused_register_leaves_no_arena(tmp_path: Path) -> None:
    """A server that refuses the Register (its --max-state-bytes cannot hold the run: no
    pre-check can know): the arena offered with it is removed too, and the refusal is the
    last line."""
    before = _our_arenas()
    with start_ps_server(tmp_path, "--max-state-bytes", "1000") as server:
        proc, seconds = _launch(server.address)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert seconds < FAIL_WITHIN_S, f"took {seconds:.1f}s\n{proc.stderr[-4000:]}"
    last = _last_line(proc.stderr)
    assert last.startswith("hybridps worker: error: rank "), proc.stderr[-4000:]
    assert f"shard server {server.address} refused" in last and "RESOURCE_EXHAUSTED" in last
    assert "Traceback" not in proc.stderr
    _assert_no_arena_left(before)


# The launcher's pre-check (worker/config/preflight.py) names these before any rank starts; 30 s
# is the launcher's own start and one health and reflection call on a loaded 2-core box.
PRECHECK_WITHIN_S = 30.0


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("worker_token", ["none", "wrong"])
def test_a_token_the_server_does_not_take_is_named_before_any_rank_starts(
        worker_token: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("connect-test-token-0123456789abcdef\n")
    token.chmod(0o600)
    flags: list[str] = []
    if worker_token == "wrong":
        other = tmp_path / "other"
        other.write_text("not-the-servers-token-0123456789ab\n")
        other.chmod(0o600)
        flags = ["--auth-token-file", str(other)]
    with start_ps_server(tmp_path, "--auth-token-file", str(token)) as server:
        proc, seconds = _launch(server.address, *flags)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert seconds < PRECHECK_WITHIN_S, f"took {seconds:.1f}s\n{proc.stderr[-4000:]}"
    says = ("wants an auth token and this worker has none" if worker_token == "none"
            else "refused this worker's auth token (not the server's)")
    assert _last_line(proc.stderr) == (
        f"hybridps-run: error: shard server {server.address} {says}: give "
        + ("it the server's token with --auth-token-file PATH" if worker_token == "none"
           else "the server's token file with --auth-token-file")
        + " (or HYBRIDPS_AUTH_TOKEN)"), proc.stderr[-4000:]
    assert "rank" not in proc.stderr and "Traceback" not in proc.stderr  # no rank started


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_an_http_port_is_named_as_not_a_shard_server(tmp_path: Path) -> None:
    web = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind",
                            "127.0.0.1", "--directory", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert web.stdout is not None
        banner = web.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (http://...) ..."
        port = int(banner.split(" port ")[1].split()[0])
        address = f"127.0.0.1:{port}"
        proc, seconds = _launch(address)
    finally:
        web.kill()
        web.wait()
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert seconds < PRECHECK_WITHIN_S, f"took {seconds:.1f}s\n{proc.stderr[-4000:]}"
    last = _last_line(proc.stderr)
    assert last.startswith(f"hybridps-run: error: {address} is not a hybridps shard server: "
                           "it answers HTTP/1, not gRPC"), proc.stderr[-4000:]
    assert "Failed parsing HTTP/2" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_grpc_server_without_the_shard_service_is_named() -> None:
    """A gRPC server that answers health and reflection but is no shard server."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from hybridps.security import ClientSecurity
    from worker.config.preflight import server_problem

    other = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), other)
    reflection.enable_server_reflection(["grpc.health.v1.Health", reflection.SERVICE_NAME],
                                        other)
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        line = server_problem(f"127.0.0.1:{port}", ClientSecurity(), 5.0)
    finally:
        other.stop(None)
    assert line == (f"127.0.0.1:{port} is not a hybridps shard server: its gRPC services are "
                    "grpc.health.v1.Health, grpc.reflection.v1alpha.ServerReflection; point "
                    "--ps at a shard server (python -m ps)")
