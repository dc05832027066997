"""Assemble and run the shard server: grpc.aio on one (uvloop) event loop.

Services: hybridps.v1.ShardService, hybridps.v1.AdminService, grpc.health.v1
(SERVING once up, NOT_SERVING on shutdown) and, unless switched off, server
reflection. Stops gracefully on SIGTERM/SIGINT.
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

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from hybridps.v1 import admin_pb2, admin_pb2_grpc, shard_pb2, shard_pb2_grpc
from ps.client_options import server_options
from ps.config import ServerConfig
from ps.core import ShardCore
from ps.service import AdminServicer, ShardServicer
from ps.store import Store, kv

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


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: HealthServicer
    core: ShardCore
    port: int

    async def stop(self, grace: float) -> None:
        log.info(kv("shutdown", grace_s=grace))
        await self.health.enter_graceful_shutdown()  # every service -> NOT_SERVING
        await self.server.stop(grace)
        self.core.shutdown()
        log.info(kv("stopped"))


async def start_server(config: ServerConfig) -> RunningServer:
    """Build, bind and start the server (BindError when the port is taken)."""
    store = Store(server_id=config.server_id or None,
                  answer_cache_steps=config.answer_cache_steps,
                  rate_window_s=config.rate_window_s)
    core = ShardCore(store, update_threads=config.update_threads,
                     flush_timeout_s=config.flush_timeout_s)
    server = grpc.aio.server(options=server_options(
        config.max_message_bytes, keepalive_time_ms=config.keepalive_time_ms,
        keepalive_timeout_ms=config.keepalive_timeout_ms))
    shard_pb2_grpc.add_ShardServiceServicer_to_server(
        ShardServicer(core, config.max_message_bytes), server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(core), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    services = [SHARD_SERVICE, ADMIN_SERVICE, HEALTH_SERVICE]
    if config.reflection:
        services.append(reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, server)
    address = format_address(config.host, config.port)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        core.shutdown()
        raise BindError(f"cannot listen on {address}: "
                        f"{_bind_diagnosis(config.host, config.port)}") from None
    await server.start()
    for name in ("", *services):
        await health.set(name, SERVING)
    log.info(kv("serving", address=format_address(config.host, port),
                server_id=store.server_id, max_message_bytes=config.max_message_bytes,
                reflection=config.reflection))
    return RunningServer(server, health, core, port)


def write_port_file(path: str, port: int) -> None:
    """Write atomically: a reader sees no file or the whole port, never a partial one."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        running = await start_server(config)
    except BindError as exc:
        log.error(kv("bind_failed", error=str(exc)))
        print(f"hybridps-ps: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"hybridps-ps listening on {format_address(config.host, running.port)}", flush=True)
    if config.port_file:
        write_port_file(config.port_file, running.port)
    await stop.wait()
    await running.stop(config.grace_s)
    return 0
