"""`python -m ps.admin`: talk to a shard server (no torch import).

    python -m ps.admin stats --ps HOST:PORT [--json] [--run-id R]   # read-only stats
    python -m ps.admin health --ps HOST:PORT      # exit 0 only when SERVING (healthchecks)
    python -m ps.admin shutdown --ps HOST:PORT    # graceful stop; needs the admin token

Every subcommand takes the TLS flags (--tls, --tls-ca, --tls-cert, --tls-key,
--tls-server-name); stats and shutdown send a token (--auth-token-file or env
HYBRIDPS_AUTH_TOKEN; shutdown: --admin-token-file or HYBRIDPS_ADMIN_TOKEN).
Health is open on every server and sends no token.

Also the Python API for workers:
    stats = get_shard_stats("127.0.0.1:50051")   # admin_pb2.ShardStats
    print(format_shard_stats(stats))
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridps.cli import ConfigError, add_dataclass_flags, from_namespace
from hybridps.security import (
    ADMIN_TOKEN_ENV,
    AUTH_TOKEN_ENV,
    ClientSecurity,
    SecurityError,
    client_security,
    open_channel,
)
from hybridps.v1 import admin_pb2, admin_pb2_grpc
from ps.client_options import channel_options

DEFAULT_TIMEOUT_S = 10.0


def get_shard_stats(address: str, timeout: float = DEFAULT_TIMEOUT_S,
                    run_id: str = "", security: ClientSecurity | None = None
                    ) -> admin_pb2.ShardStats:
    """GetShardStats from the server at HOST:PORT (raises grpc.RpcError on failure)."""
    security = security or ClientSecurity()
    with open_channel(address, channel_options(), security) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        return stub.GetShardStats(admin_pb2.ShardStatsRequest(run_id=run_id), timeout=timeout,
                                  metadata=security.metadata)


def health_status(address: str, timeout: float = DEFAULT_TIMEOUT_S, service: str = "",
                  security: ClientSecurity | None = None) -> str:
    """The grpc.health.v1 status name (SERVING, NOT_SERVING, ...) of `service` ('' = server)."""
    with open_channel(address, channel_options(), security) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def shutdown_server(address: str, security: ClientSecurity, grace_s: float = 0.0,
                    reason: str = "", timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """Ask the server to stop gracefully (admin token); returns its server id."""
    with open_channel(address, channel_options(), security) as channel:
        reply = admin_pb2_grpc.AdminServiceStub(channel).Shutdown(
            admin_pb2.ShutdownRequest(grace_s=grace_s, reason=reason), timeout=timeout,
            metadata=security.metadata)
    return str(reply.server_id)


def stats_json(stats: admin_pb2.ShardStats) -> str:
    return json_format.MessageToJson(stats, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True, indent=2)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _refusals(counts: Mapping[str, int]) -> str:
    items = sorted(counts.items())
    return ",".join(f"{k}={v}" for k, v in items) if items else "-"


COLUMNS = ("run", "rank", "table", "rows", "state_MB", "pushes", "rows_updated", "rows/s",
           "touched", "last_step", "lag", "queue", "refusals")


def format_shard_stats(stats: admin_pb2.ShardStats) -> str:
    """A readable report: header lines, then one row per (run, rank, table)."""
    lines = [
        f"server {stats.server_id}  uptime {stats.uptime_s:.1f}s  "
        f"partitions {len(stats.partitions)}",
        f"totals: state {_mb(stats.state_bytes_total)} MB  master rows "
        f"{_mb(stats.master_bytes_total)} MB  pushes "
        f"{stats.pushes_applied_total}  rows updated {stats.rows_updated_total}",
        f"refusals: {_refusals(stats.refusals)}",
    ]
    rows = [COLUMNS]
    for p in stats.partitions:
        rows.append((p.run_id, str(p.rank), p.table, str(p.rows_held), _mb(p.state_bytes),
                     str(p.pushes_applied), str(p.rows_updated), f"{p.rows_per_second:.0f}",
                     str(p.distinct_rows_touched), str(p.last_step), str(p.lag_steps),
                     str(p.queue_depth), _refusals(p.refusals)))
    if len(rows) == 1:
        lines.append("(no partitions registered)")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    text_cols = {0, 2, 12}
    for r in rows:
        cells = [c.ljust(w) if i in text_cols else c.rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@dataclass(frozen=True)
class ClientConfig:
    """Flags every subcommand shares: where the server is and how to reach it."""

    ps: str = field(default="127.0.0.1:50051", metadata={"help": "shard server HOST:PORT"})
    timeout_s: float = field(default=DEFAULT_TIMEOUT_S, metadata={"help": "RPC timeout"})
    tls: bool = field(default=False, metadata={
        "help": "use TLS (implied by any --tls-* flag; system roots without --tls-ca)"})
    tls_ca: str = field(default="", metadata={"help": "PEM CA that signed the server's cert"})
    tls_cert: str = field(default="", metadata={"help": "PEM client certificate (mutual TLS)"})
    tls_key: str = field(default="", metadata={"help": "PEM key of --tls-cert"})
    tls_server_name: str = field(default="", metadata={
        "help": "name to verify in the server's certificate (default: the --ps host)"})

    def __post_init__(self) -> None:
        if not self.ps:
            raise ValueError("--ps HOST:PORT is required")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s {self.timeout_s} must be > 0")

    def security(self, token_file: str = "", token_env: str = "") -> ClientSecurity:
        return client_security(token_file=token_file, token_env=token_env, tls=self.tls,
                               ca_file=self.tls_ca, cert_file=self.tls_cert,
                               key_file=self.tls_key, server_name=self.tls_server_name)


@dataclass(frozen=True)
class StatsConfig(ClientConfig):
    json: bool = field(default=False, metadata={"help": "print the ShardStats message as JSON"})
    run_id: str = field(default="", metadata={"help": "only this run (default: every run)"})
    auth_token_file: str = field(default="", metadata={
        "help": "file with the token (else env HYBRIDPS_AUTH_TOKEN; the admin token works "
                "too)"})


@dataclass(frozen=True)
class HealthConfig(ClientConfig):
    service: str = field(default="", metadata={
        "help": "service to check ('' = the whole server)"})


@dataclass(frozen=True)
class ShutdownConfig(ClientConfig):
    admin_token_file: str = field(default="", metadata={
        "help": "file with the admin token (else env HYBRIDPS_ADMIN_TOKEN)"})
    grace_s: float = field(default=0.0, metadata={
        "help": "seconds in-flight RPCs get (0: the server's --grace-s)"})
    reason: str = field(default="", metadata={"help": "logged by the server"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.grace_s >= 0:
            raise ValueError(f"--grace-s {self.grace_s} must be >= 0")


COMMANDS: dict[str, tuple[type[ClientConfig], str]] = {
    "stats": (StatsConfig, "print GetShardStats"),
    "health": (HealthConfig, "exit 0 only when the server is SERVING (for healthchecks)"),
    "shutdown": (ShutdownConfig, "graceful stop (needs the admin token)"),
}


def _rpc_failure(what: str, address: str, exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"ps.admin: {what} from {address} failed: {name}: {details}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps.admin",
                                     description="hybridps shard server admin")
    commands = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, (cls, help_text) in COMMANDS.items():
        parsers[name] = commands.add_parser(name, help=help_text)
        add_dataclass_flags(parsers[name], cls)
    ns = parser.parse_args(argv)
    cls = COMMANDS[ns.command][0]
    try:
        config = from_namespace(cls, ns)
        if isinstance(config, StatsConfig):
            security = config.security(config.auth_token_file, AUTH_TOKEN_ENV)
        elif isinstance(config, ShutdownConfig):
            security = config.security(config.admin_token_file, ADMIN_TOKEN_ENV)
        else:
            security = config.security()
    except (ConfigError, SecurityError) as exc:
        parsers[ns.command].error(str(exc))
    try:
        if isinstance(config, StatsConfig):
            stats = get_shard_stats(config.ps, config.timeout_s, config.run_id, security)
            print(stats_json(stats) if config.json else format_shard_stats(stats))
        elif isinstance(config, HealthConfig):
            status = health_status(config.ps, config.timeout_s, config.service, security)
            print(f"{config.ps} {config.service or '(server)'}: {status}")
            return 0 if status == "SERVING" else 1
        elif isinstance(config, ShutdownConfig):
            server_id = shutdown_server(config.ps, security, config.grace_s, config.reason,
                                        config.timeout_s)
            print(f"{config.ps}: server {server_id} is stopping")
    except grpc.RpcError as exc:
        rpc = {"stats": "GetShardStats", "health": "Health.Check", "shutdown": "Shutdown"}
        print(_rpc_failure(rpc[ns.command], config.ps, exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
