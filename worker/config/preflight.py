"""A worker's flags checked against the world before the heavy work: the data directory,
the paths the run writes (worker/config/output_paths.py) and the shard server, each problem one
line naming the value and what to do.

No torch import: the launcher (worker/launch.py) runs these checks before it starts any
rank, and every rank runs them again before its torch imports and its rendezvous (under a
bare torchrun, that is the first place). The server is asked for its gRPC health, which
needs no token; an address nobody answers at is retried with backoff for a short window
only (a server that is still starting gets that long), as the first Register does
(worker/sync/connect.py). A serving server is then asked for the list of its services through
gRPC reflection: a call that needs the worker's token (ps/edge/auth.py) and does no work, so a
token the server does not take, or a gRPC server that is not a hybridps shard server, is
named here instead of at the first Register of every rank. A server started with
--reflection false answers UNIMPLEMENTED, and the Register says it as before.

A rank that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0) waits the whole
--ps-timeout instead: the server may have crashed too and be restarting (the crash
recovery of docs/reliability.md).
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from hybridps.datasets import data_dir_problem
from worker.config.output_paths import output_problem

if TYPE_CHECKING:
    from hybridps.security import ClientSecurity
    from worker.config.train_config import TrainConfig

FIRST_CONNECT_S = 5.0  # how long a first start retries an address nobody answers at
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 1.0
ATTEMPT_MAX_S = 2.0  # one health call: a server that accepted the connection answers in ms


def connect_window_s(timeout_s: float, environ: Mapping[str, str] = os.environ) -> float:
    """How long a first start retries a server it cannot connect to."""
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


def data_problem(cfg: TrainConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """What the flags name on disk: the task's data (kge's --data-dir), then the paths this
    rank writes (worker/config/output_paths.py)."""
    if cfg.run.task == "kge" and cfg.kge.data_dir:
        found = data_dir_problem(cfg.kge.data_dir)
        if found is not None:
            return found
    if cfg.run.task == "files" or cfg.files.train_files:
        found = files_problem(cfg)
        if found is not None:
            return found
    return output_problem(cfg, environ)


def files_problem(cfg: TrainConfig) -> str | None:
    """--task files: a glob that matches no file, a --features file that is not there (the
    files' columns are checked by the task, worker/data/)."""
    for flag, patterns in (("--train-files", cfg.files.train_files),
                           ("--valid-files", cfg.files.valid_files)):
        for pattern in (p.strip() for p in patterns.split(",")):
            if pattern and not any(os.path.isfile(p)
                                   for p in glob.glob(os.path.expanduser(pattern))):
                return f"{flag} {pattern!r}: no file matches"
    if cfg.files.features and not os.path.isfile(cfg.files.features):
        return f"--features {cfg.files.features!r}: no such file"
    return None


def not_grpc_hint(details: str) -> bool:
    """Whether a failed call's details say that the peer answered, but not in HTTP/2."""
    lowered = details.lower()
    return "parsing http/2" in lowered or "http1.x" in lowered


def server_problem(address: str, security: ClientSecurity, window_s: float, *,
                   sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> str | None:
    """None when the shard server at `address` says SERVING and takes this worker's token
    (service_problem); else what is wrong, naming the address and what to check. A call
    that cannot connect is retried for `window_s`."""
    import grpc

    from hybridps.admin import health_status

    started = clock()
    delay = BACKOFF_START_S
    attempts = 0
    while True:
        attempts += 1
        left = started + window_s - clock()
        try:
            status = health_status(address, timeout=min(max(left, 0.5), ATTEMPT_MAX_S),
                                   security=security)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = (exc.details() if hasattr(exc, "details") else "") or str(code)
            if not_grpc_hint(details):
                return (f"{address} is not a hybridps shard server: it answers HTTP/1, not "
                        "gRPC (a web server, or a shard server's --metrics-port?); point --ps "
                        "at the shard server's --port")
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                name = code.name if code is not None else "ERROR"
                return (f"shard server {address} did not answer a health check "
                        f"({name}: {details}): check that --ps names a hybridps shard "
                        "server (python -m ps) and that the TLS settings (--tls-*) match")
            if clock() - started + delay > window_s:
                what = ("no answer" if code == grpc.StatusCode.DEADLINE_EXCEEDED
                        else unreachable_hint(address, details))
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    what += (": check that the shard server is running and reachable from "
                             "here (host, port, firewall)")
                return (f"could not register with shard server {address} within {window_s:g}s "
                        f"({attempts} attempts): {what}")
            sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
            continue
        if status == "SERVING":
            return service_problem(address, security, min(max(left, 0.5), ATTEMPT_MAX_S))
        return (f"shard server {address} is {status} (stopping, or not yet started): start "
                "it again (python -m ps) or point --ps at one that is serving")


def service_problem(address: str, security: ClientSecurity, timeout: float) -> str | None:
    """None when the serving server at `address` takes this worker's token and serves the
    shard service (or does not say: reflection off, module doc); else what is wrong."""
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from hybridps.channel_options import channel_options
    from hybridps.security import AUTH_TOKEN_ENV, open_channel
    from hybridps.v1 import shard_pb2

    shard_service = shard_pb2.DESCRIPTOR.services_by_name["ShardService"].full_name
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        with open_channel(address, channel_options(), security) as channel:
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([request]), timeout=timeout, metadata=security.metadata)
            reply = next(replies)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        if code != grpc.StatusCode.UNAUTHENTICATED:
            return None  # reflection off (UNIMPLEMENTED), or a hiccup: the Register tells
        if not security.token:
            return (f"shard server {address} wants an auth token and this worker has none: "
                    "give it the server's token with --auth-token-file PATH (or "
                    f"{AUTH_TOKEN_ENV})")
        return (f"shard server {address} refused this worker's auth token (not the "
                "server's): give the server's token file with --auth-token-file (or "
                f"{AUTH_TOKEN_ENV})")
    services = sorted(s.name for s in reply.list_services_response.service)
    if services and shard_service not in services:
        return (f"{address} is not a hybridps shard server: its gRPC services are "
                f"{', '.join(services)}; point --ps at a shard server (python -m ps)")
    return None


def problem(cfg: TrainConfig, address: str | None) -> str | None:
    """The data and the paths written, then the server at `address` (None: not checked
    here)."""
    found = data_problem(cfg)
    if (found is not None or address is None or not cfg.sync.update_kind.needs_server
            or cfg.sizing.plan):
        return found
    return server_problem(address, cfg.security.client_security(),
                          connect_window_s(cfg.sync.ps_timeout))
