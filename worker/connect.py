"""The first Register: reach the shard server, or say at once why not and what to check.

gRPC's `wait_for_ready` would wait out the whole --ps-timeout (60 s by default) for an
address where nothing listens, or a host name that does not resolve, and then report
DEADLINE_EXCEEDED. Instead the first Register fails fast: every attempt is made without
waiting for the channel, and one that cannot connect (UNAVAILABLE) is tried again with
backoff for a short window only (a server that is still starting gets that long), then
refused with one line naming the address and what to check. A server that accepted the
connection still has the whole --ps-timeout to answer.

A rank that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0) waits the whole
--ps-timeout instead: the server may have crashed too and be restarting (the crash
recovery of docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from hybridps.logs import kv
from worker.transport import TransportError
from worker.updates import ServerUnavailable

log = logging.getLogger("worker.connect")

FIRST_CONNECT_S = 5.0  # how long a first start retries an address nobody answers at
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 1.0

T = TypeVar("T")


def connect_window_s(timeout_s: float, environ: Mapping[str, str] = os.environ) -> float:
    """How long the first Register retries a server it cannot connect to."""
    restarts = environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if restarts != "0":
        return timeout_s
    return min(FIRST_CONNECT_S, timeout_s)


def unreachable_hint(address: str, details: str) -> str:
    """What an UNAVAILABLE of a call that could not connect means, and what to check."""
    host = address.rsplit(":", 1)[0]
    lowered = details.lower()
    if "resolv" in lowered or "domain name not found" in lowered or "dns" in lowered:
        return (f"the host name {host!r} does not resolve: check the host in --ps "
                "(a compose service name resolves only inside its network)")
    if "connection refused" in lowered:
        return ("connection refused, nothing listens there: check that the shard server "
                "is running (python -m ps --port PORT) and that --ps names its host and port")
    if "ssl" in lowered or "handshake" in lowered or "certificate" in lowered:
        return (f"{details}: check that the TLS settings (--tls-*) match the server's")
    return (f"{details}: check that the shard server is running and reachable from here "
            "(host, port, firewall)")


def call_until_connected(attempt: Callable[[float], T], *, address: str, rank: int,
                         timeout_s: float, window_s: float,
                         sleep: Callable[[float], None] = time.sleep,
                         clock: Callable[[], float] = time.monotonic) -> T:
    """`attempt(deadline_s)` until it does not fail to connect. UNAVAILABLE is retried with
    backoff while less than `window_s` passed, then raised as ServerUnavailable naming
    the address and what to check; any other error is raised as it is. Every attempt
    gets what is left of `timeout_s`."""
    started = clock()
    delay = BACKOFF_START_S
    attempts = 0
    while True:
        attempts += 1
        left = started + timeout_s - clock()
        try:
            return attempt(max(left, 0.1))
        except TransportError as exc:
            if exc.code != "UNAVAILABLE":
                raise
            waited = clock() - started
            if waited + delay > window_s:
                raise ServerUnavailable(
                    f"rank {rank}: could not register with shard server {address} within "
                    f"{window_s:g}s ({attempts} attempts): "
                    f"{unreachable_hint(address, exc.details)}") from None
            if attempts == 1:
                log.info(kv("connecting", server=address, error=exc.text,
                            retry_for_s=f"{window_s:g}"))
            sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

