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
import time
from collections.abc import Callable
from typing import TypeVar

from hybridps.logs import kv
from worker.config.preflight import (  # noqa: F401  (connect_window_s: worker/sync/client.py)
    BACKOFF_MAX_S,
    BACKOFF_START_S,
    FIRST_CONNECT_S,
    connect_window_s,
    unreachable_hint,
)
from worker.sync.transport import TransportError
from worker.updates.source import ServerUnavailable

log = logging.getLogger("worker.connect")

T = TypeVar("T")


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

