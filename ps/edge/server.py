"""Assemble and run the shard server: grpc.aio on one (uvloop) event loop.

Services: hybridps.v1.ShardService, hybridps.v1.AdminService, grpc.health.v1
(SERVING once up, NOT_SERVING on shutdown) and, unless switched off, server
reflection. Every call passes the token check of ps/edge/auth.py; TLS / mutual TLS
when given a certificate (hybridps/security.py).

Graceful stop, on SIGTERM/SIGINT, an admin Shutdown, or (--exit-after-run)
the end of the first run: health -> NOT_SERVING; every Sync stream answers the
pushes it already received and then ends with UNAVAILABLE (nothing answered
is lost: an answer is only sent after its push is applied); other in-flight
RPCs get --grace-s seconds; the update threads finish; the final applied step
of every partition is logged (`event=final_state`); exit 0.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from hybridps.arena_layout import SHM_DIR
from hybridps.channel_options import server_options
from hybridps.logs import set_log_fields
from hybridps.security import (
    ADMIN_TOKEN_ENV,
    AUTH_TOKEN_ENV,
    SecurityError,
    ensure_token_file,
    read_token,
    server_credentials,
)
from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2
from ps.config import ServerConfig
from ps.core.lifecycle import RunTracker
from ps.core.limits import default_max_state_bytes
from ps.core.maintenance import RunReaper, maintain
from ps.core.shard_core import ShardCore
from ps.core.spill import SpillTier
from ps.core.store import Store, kv
from ps.edge.arena_server import ArenaRegistry
from ps.edge.auth import AuthInterceptor, AuthPolicy
from ps.edge.service import AdminServicer, ShardServicer, add_shard_service

if TYPE_CHECKING:
    from ps.edge.metrics import MetricsServer

log = logging.getLogger("ps.server")

SHARD_SERVICE = shard_pb2.DESCRIPTOR.services_by_name["ShardService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING


class BindError(RuntimeError):
    """The server could not listen on the requested address."""


def format_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _bind_diagnosis(host: str, port: int) -> str:
    """Why binding failed, found by trying a plain socket (grpc only says 'failed')."""
    if port == 0:
        return "no free port"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host.strip("[]"), port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return "address already in use (is another server on this port?)"
        return exc.strerror or str(exc)
    return "see the grpc log above"


class StopRequest:
    """Why and how the server should stop; set once (by a signal, Shutdown or a run's end)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason = ""
        self.grace_s: float | None = None

    def set(self, reason: str, grace_s: float | None = None) -> None:
        if self.event.is_set():
            return
        self.reason, self.grace_s = reason, (grace_s or None)
        log.info(kv("stop_requested", reason=reason))
        self.event.set()


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: HealthServicer
    core: ShardCore
    port: int
    shard: ShardServicer
    stop_request: StopRequest
    metrics: MetricsServer | None = None  # --metrics-port (ps/edge/metrics.py)
    maintenance: asyncio.Task[None] | None = None

    async def stop(self, grace: float) -> None:
        log.info(kv("shutdown", grace_s=grace, reason=self.stop_request.reason or "-"))
        if self.maintenance is not None:
            self.maintenance.cancel()
        await self.health.enter_graceful_shutdown()  # every service -> NOT_SERVING
        self.shard.begin_drain()  # Sync streams answer what they hold, then end
        await self.server.stop(grace)
        if self.metrics is not None:
            self.metrics.close()
        self.core.shutdown()
        if self.shard.shm_arenas is not None:
            self.shard.shm_arenas.close()
        log_final_state(self.core.store)
        self.core.store.spill.close()
        log.info(kv("stopped"))


def log_final_state(store: Store) -> None:
    """One line per (run, rank, table): what this server applied, for the record."""
    for row in store.stats().partitions:
        log.info(kv("final_state", run=row.run_id, rank=row.rank, table=row.table,
                    last_step=row.last_step, pushes_applied=row.pushes_applied,
                    rows_updated=row.rows_updated))


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def _security_warnings(config: ServerConfig, token: str, tls: bool) -> None:
    if _is_loopback(config.host):
        return
    if not token:
        if not config.insecure:
            raise SecurityError(
                f"refusing to listen on {config.host} without a token: anyone who reaches "
                "the port could register, push and checkpoint. Set --auth-token-file FILE "
                "(with --generate-auth-token to create it) or HYBRIDPS_AUTH_TOKEN, listen on "
                "127.0.0.1, or pass --insecure")
        log.warning(kv("no_auth", host=config.host, hint="--insecure: anyone who reaches this "
                       "port can register and push; set --auth-token-file or "
                       "HYBRIDPS_AUTH_TOKEN"))
    elif not tls:
        log.warning(kv("token_in_clear", host=config.host, hint="the token travels "
                       "unencrypted; add --tls-cert/--tls-key (docs/deploy.md)"))


async def start_server(config: ServerConfig, stop_request: StopRequest | None = None
                       ) -> RunningServer:
    """Build, bind and start the server (BindError when the port is taken)."""
    stop_request = stop_request or StopRequest()
    if config.generate_auth_token:
        ensure_token_file(config.auth_token_file, AUTH_TOKEN_ENV)
    token = read_token(config.auth_token_file, AUTH_TOKEN_ENV, what="auth token")
    admin_token = read_token(config.admin_token_file, ADMIN_TOKEN_ENV, what="admin token")
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    _security_warnings(config, token, credentials is not None)  # refuses before binding
    store = Store(server_id=config.server_id or None,
                  answer_cache_steps=config.answer_cache_steps,
                  rate_window_s=config.rate_window_s,
                  checkpoint_root=config.checkpoint_root,
                  max_state_bytes=config.state_budget_bytes or default_max_state_bytes(),
                  max_run_state_bytes=config.max_run_state_bytes,
                  run_shares=config.run_shares, spill=_spill_tier(config))
    set_log_fields(server=store.server_id)
    core = ShardCore(store, update_threads=config.update_threads,
                     kernel_threads=config.kernel_threads,
                     flush_timeout_s=config.flush_timeout_s)

    loop = asyncio.get_running_loop()

    def run_over(run_id: str, why: str) -> None:
        log.info(kv("run_over", run=run_id, why=why, exit_after_run=config.exit_after_run))
        if config.exit_after_run:
            reason = f"--exit-after-run: run {run_id} is over ({why})"
            if config.exit_after_run_delay_s > 0:
                # Still serving meanwhile: the workers' own exit comes first (compose).
                def stop_later() -> None:
                    loop.call_later(config.exit_after_run_delay_s, stop_request.set, reason)

                loop.call_soon_threadsafe(stop_later)
            else:
                stop_request.set(reason)

    policy = AuthPolicy(token, admin_token, config.stats_without_token)
    interceptor = AuthInterceptor(policy, on_refused=store.record_refusal)
    server = grpc.aio.server(interceptors=[interceptor], options=server_options(
        config.max_message_bytes, keepalive_time_ms=config.keepalive_time_ms,
        keepalive_timeout_ms=config.keepalive_timeout_ms))
    tracker = RunTracker(run_over, abort_grace_s=config.abort_grace_s)
    store.run_state = lambda run_id: tracker.state(run_id, config.run_idle_timeout_s)
    shard = ShardServicer(core, config.max_message_bytes, tracker=tracker,
                          stop_when_run_over=config.exit_after_run,
                          run_idle_timeout_s=config.run_idle_timeout_s,
                          shm_arenas=ArenaRegistry() if config.shm else None)
    reaper = RunReaper(store, tracker, config.finished_run_retention_s,
                       shard.shm_arenas.release if shard.shm_arenas is not None else None,
                       config.run_idle_timeout_s, config.unused_registration_timeout_s)
    add_shard_service(shard, server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(
        AdminServicer(core, stop_request.set, reaper), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = [SHARD_SERVICE, ADMIN_SERVICE, HEALTH_SERVICE]
    if config.reflection:
        services.append(reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, server)
    address = format_address(config.host, config.port)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        core.shutdown()
        raise BindError(f"cannot listen on {address}: "
                        f"{_bind_diagnosis(config.host, config.port)}") from None
    metrics = _start_metrics(config, store, core)
    await server.start()
    for name in ("", *services):
        await health.set(name, SERVING)
    tls = "off" if credentials is None else ("mutual" if config.tls_client_ca else "on")
    maintenance = asyncio.get_running_loop().create_task(
        maintain(reaper, SHM_DIR if config.shm and config.shm_sweep else None,
                 mapped=shard.shm_arenas.paths if shard.shm_arenas is not None else tuple))
    log.info(kv("serving", address=format_address(config.host, port),
                kernel_threads=core.kernel_threads,
                server_id=store.server_id, max_message_bytes=config.max_message_bytes,
                reflection=config.reflection, tls=tls, auth="token" if token else "off",
                admin_shutdown="token" if admin_token else "off",
                exit_after_run=config.exit_after_run, shm=config.shm,
                checkpoint_root=store.checkpoint_root.root,
                max_state_bytes=store.budget.limit_bytes))
    return RunningServer(server, health, core, port, shard, stop_request,
                         metrics=metrics, maintenance=maintenance)


def _spill_tier(config: ServerConfig) -> SpillTier:
    """--spill-dir: this process's spill directory (a dead server's removed first)."""
    try:
        return SpillTier(config.spill_dir, int(config.spill_max_gb * 2**30),
                         config.spill_page_kb << 10)
    except OSError as exc:
        raise ValueError(f"--spill-dir {config.spill_dir!r}: {exc.strerror or exc}") from None


def _start_metrics(config: ServerConfig, store: Store, core: ShardCore) -> MetricsServer | None:
    """--metrics-port: the Prometheus endpoint (ps/edge/metrics.py), before the server starts."""
    if config.metrics_port < 0:
        return None
    from ps.edge.metrics import MetricsServer

    try:
        return MetricsServer(store, config.host, config.metrics_port)
    except OSError as exc:
        core.shutdown()
        where = format_address(config.host, config.metrics_port)
        raise BindError(f"cannot serve metrics on {where}: {exc.strerror or exc}") from None


def write_port_file(path: str, port: int) -> None:
    """Write atomically: a reader sees no file or the whole port, never a partial one.
    Missing directories are made (`--port-file runs/ps.port` in a fresh clone); what cannot
    be written was refused before binding (ps/config.py port_file_problem)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, an admin Shutdown or (--exit-after-run) the end of a run."""
    stop = StopRequest()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set, f"signal {sig.name}")
    try:
        running = await start_server(config, stop)
    except BindError as exc:
        log.error(kv("bind_failed", error=str(exc)))
        print(f"hybridps-ps: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except SecurityError as exc:
        log.error(kv("bad_security_config", error=str(exc)))
        print(f"hybridps-ps: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"hybridps-ps listening on {format_address(config.host, running.port)}", flush=True)
    if running.metrics is not None:
        print("hybridps-ps metrics on "
              f"http://{format_address(config.host, running.metrics.port)}/metrics", flush=True)
    if config.port_file:
        write_port_file(config.port_file, running.port)
    await stop.event.wait()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal: the default (exit now)
        loop.remove_signal_handler(sig)
    await running.stop(config.grace_s if stop.grace_s is None else stop.grace_s)
    return 0
