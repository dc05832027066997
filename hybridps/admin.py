"""Client calls to a shard server's AdminService and health, and the stats report.

Shared by `python -m ps.admin` and the worker (which prints the stats at the end of a
run): no torch import.

    stats = get_shard_stats("127.0.0.1:50051")   # admin_pb2.ShardStats
    print(format_shard_stats(stats))
"""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridps.channel_options import channel_options
from hybridps.security import ClientSecurity, open_channel
from hybridps.v1 import admin_pb2, admin_pb2_grpc

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


def drop_run(address: str, security: ClientSecurity, run_id: str, reason: str = "",
             timeout: float = DEFAULT_TIMEOUT_S) -> admin_pb2.DropRunResponse:
    """Free every partition of `run_id` on the server now (admin token)."""
    with open_channel(address, channel_options(), security) as channel:
        return admin_pb2_grpc.AdminServiceStub(channel).DropRun(
            admin_pb2.DropRunRequest(run_id=run_id, reason=reason), timeout=timeout,
            metadata=security.metadata)


def stats_json(stats: admin_pb2.ShardStats) -> str:
    return json_format.MessageToJson(stats, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True, indent=2)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _refusals(counts: Mapping[str, int]) -> str:
    items = sorted(counts.items())
    return ",".join(f"{k}={v}" for k, v in items) if items else "-"


def _runs(stats: admin_pb2.ShardStats) -> str:
    return ", ".join(f"{r.run_id}={r.state}" + (f" (freed in {r.freed_in_s:.0f}s)"
                                                 if r.freed_in_s >= 0 else "")
                     for r in stats.runs) or "-"


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
        f"runs: {_runs(stats)}  freed {stats.runs_freed} runs "
        f"({stats.partitions_freed} partitions)",
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
