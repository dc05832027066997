"""`python -m ps.admin stats --ps HOST:PORT [--json] [--run-id R]`: a shard server's stats.

Also the Python API for workers (no torch import):
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

from hybridps.cli import ConfigError, add_dataclass_flags, from_namespace
from hybridps.v1 import admin_pb2, admin_pb2_grpc
from ps.client_options import channel_options

DEFAULT_TIMEOUT_S = 10.0


def get_shard_stats(address: str, timeout: float = DEFAULT_TIMEOUT_S,
                    run_id: str = "") -> admin_pb2.ShardStats:
    """GetShardStats from the server at HOST:PORT (raises grpc.RpcError on failure)."""
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        return stub.GetShardStats(admin_pb2.ShardStatsRequest(run_id=run_id), timeout=timeout)


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
        f"totals: state {_mb(stats.state_bytes_total)} MB  pushes "
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
class StatsConfig:
    ps: str = field(default="127.0.0.1:50051", metadata={"help": "shard server HOST:PORT"})
    json: bool = field(default=False, metadata={"help": "print the ShardStats message as JSON"})
    run_id: str = field(default="", metadata={"help": "only this run (default: every run)"})
    timeout_s: float = field(default=DEFAULT_TIMEOUT_S, metadata={"help": "RPC timeout"})

    def __post_init__(self) -> None:
        if not self.ps:
            raise ValueError("--ps HOST:PORT is required")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s {self.timeout_s} must be > 0")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ps.admin",
                                     description="hybridps shard server admin")
    commands = parser.add_subparsers(dest="command", required=True)
    stats_parser = commands.add_parser("stats", help="print GetShardStats")
    add_dataclass_flags(stats_parser, StatsConfig)
    ns = parser.parse_args(argv)
    try:
        config = from_namespace(StatsConfig, ns)
    except ConfigError as exc:
        stats_parser.error(str(exc))
    try:
        stats = get_shard_stats(config.ps, config.timeout_s, config.run_id)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        name = code.name if code is not None else "ERROR"
        print(f"ps.admin: GetShardStats from {config.ps} failed: {name}: {details}",
              file=sys.stderr)
        return 1
    print(stats_json(stats) if config.json else format_shard_stats(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
