"""Client calls to a shard server's AdminService and health, and the stats report.

Shared by `python -m ps.admin` and the worker (which prints the stats at the end of a
run): no torch import.

    stats = get_shard_stats("127.0.0.1:50051")   # admin_pb2.ShardStats
    print(format_shard_stats(stats))              # one line per run; wide=True: per table
    print(stats_json(stats))                      # numbers as JSON numbers
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridps.channel_options import channel_options
from hybridps.security import ClientSecurity, open_channel
from hybridps.v1 import admin_pb2, admin_pb2_grpc
from hybridps.wrap import wrap_fields

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


def message_dict(msg: Message) -> dict[str, Any]:
    """Every field of `msg` by its proto name, numbers as numbers (protobuf's JSON mapping
    writes 64-bit integers as strings), enums by name, maps as dicts."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            out[field.name] = {k: _plain(v, entry.fields_by_name["value"])
                               for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_plain(v, field) for v in value]
        else:
            out[field.name] = _plain(value, field)
    return out


def _plain(value: Any, field: Any) -> Any:
    if field.message_type is not None:
        return message_dict(value)
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name
    if isinstance(value, bytes):
        return value.hex()
    return value


def stats_json(stats: admin_pb2.ShardStats, indent: int | None = 2) -> str:
    return json.dumps(message_dict(stats), indent=indent)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _refusals(counts: Mapping[str, int]) -> str:
    items = sorted(counts.items())
    return ",".join(f"{k}={v}" for k, v in items) if items else "-"




def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def short_run_ids(run_ids: Iterable[str], min_len: int = 8, keep_len: int = 16
                  ) -> dict[str, str]:
    """run id -> its shortest prefix of at least `min_len` characters that no other id shares;
    ids of at most `keep_len` characters (the worker's own `run-<12 hex>`) stay whole. What
    the compact view prints, and what `--run PREFIX` takes back."""
    ids = sorted(set(run_ids))
    out: dict[str, str] = {}
    for run in ids:
        if len(run) <= keep_len:
            out[run] = run
            continue
        n = min_len
        while n < len(run) and any(o != run and o.startswith(run[:n]) for o in ids):
            n += 1
        out[run] = run[:n]
    return out


def select_runs(stats: admin_pb2.ShardStats, prefix: str) -> admin_pb2.ShardStats:
    """A copy of `stats` with only the partitions of runs whose id starts with `prefix`."""
    out = admin_pb2.ShardStats()
    out.CopyFrom(stats)
    if prefix:
        del out.partitions[:]
        out.partitions.extend(p for p in stats.partitions if p.run_id.startswith(prefix))
    return out


@dataclass
class RunSummary:
    """One run's partitions on this server, added up (the compact view's row)."""

    run_id: str
    state: str
    ranks: set[int]
    tables: set[str]
    last_step: int
    lag: int
    pushes: int
    rows_per_second: float
    state_bytes: int
    queue: int
    refusals: dict[str, int]


def run_summaries(stats: admin_pb2.ShardStats) -> list[RunSummary]:
    runs: dict[str, RunSummary] = {}
    for p in stats.partitions:
        r = runs.setdefault(p.run_id, RunSummary(p.run_id, p.run_state, set(), set(), -1, 0,
                                                 0, 0.0, 0, 0, {}))
        r.ranks.add(p.rank)
        r.tables.add(p.table)
        r.last_step = max(r.last_step, p.last_step)
        r.lag = max(r.lag, p.lag_steps)
        r.pushes += p.pushes_applied
        r.rows_per_second += p.rows_per_second
        r.state_bytes += p.state_bytes + p.master_bytes + p.dynamic_held_bytes
        r.queue += p.queue_depth
        for reason, n in p.refusals.items():
            r.refusals[reason] = r.refusals.get(reason, 0) + n
    return [runs[k] for k in sorted(runs)]


RUN_COLUMNS = ("run", "state", "ranks", "tables", "step", "lag", "pushes", "rows/s",
               "host_MB", "queue", "refusals")  # host_MB: optimizer state + master rows
# the compact view leaves these out first, in this order, to fit the terminal
RUN_COLUMNS_DROPPED_FIRST = ("queue", "tables", "ranks", "rows/s", "lag", "host_MB",
                             "pushes")
COLUMNS = ("run", "rank", "table", "rows", "state_MB", "pushes", "rows_updated", "rows/s",
           "touched", "last_step", "lag", "queue", "refusals", "state", "inc", "rows_range",
           "dtype", "master_MB", "optimizer")
_TEXT_COLUMNS = {"run", "table", "refusals", "state", "rows_range", "dtype", "optimizer"}
DEFAULT_WIDTH = 100  # the compact view's width off a terminal
MAX_REFUSALS_CELL = 24  # longer: the compact view's cell shows the count (details: --wide)


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    lines = []
    for r in [columns, *rows]:
        cells = [c.ljust(w) if name in _TEXT_COLUMNS else c.rjust(w)
                 for name, c, w in zip(columns, r, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _fitted_table(columns: Sequence[str], rows: Sequence[Sequence[str]], width: int,
                  dropped_first: Sequence[str]) -> tuple[list[str], list[str]]:
    """The table without the fewest columns of `dropped_first` (in that order) that makes it
    fit `width`; (lines, the columns left out)."""
    keep = list(columns)
    left_out: list[str] = []
    for name in ["", *dropped_first]:
        if name:
            keep.remove(name)
            left_out.append(name)
        index = [columns.index(c) for c in keep]
        lines = _table(keep, [[r[i] for i in index] for r in rows])
        if max(len(line) for line in lines) <= width:
            break
    return lines, [c for c in columns if c in left_out]


def _wrapped(text: str, width: int) -> list[str]:
    """A header line, wrapped to `width` between its fields, never inside a word
    (continuations indented)."""
    return wrap_fields(text, width)


def _refusals_cell(counts: Mapping[str, int]) -> str:
    text = _refusals(counts)
    return text if len(text) <= MAX_REFUSALS_CELL else f"{sum(counts.values())} (--wide)"
def _dynamic_lines(stats: admin_pb2.ShardStats) -> list[str]:
    """One line per dynamic table's partition (docs/dynamic_ids.md)."""
    return [f"dynamic {p.run_id} rank {p.rank} {p.table}: occupied {p.dynamic_occupied}/"
            f"{p.dynamic_capacity}  admissions {p.dynamic_admissions}  refusals "
            f"{p.dynamic_refusals}  evictions {p.dynamic_evictions}  page-ins "
            f"{p.dynamic_page_ins}  hit rate {p.dynamic_hit_rate:.3f}  paged "
            f"{p.dynamic_paged_rows} ({_mb(p.dynamic_paged_bytes)} MB)  expired "
            f"{p.dynamic_expired}  dropped {p.dynamic_dropped}  quota "
            f"{_mb(p.dynamic_paged_quota) if p.dynamic_paged_quota else '-'} MB  held "
            f"{_mb(p.dynamic_held_bytes)} MB"
            for p in stats.partitions if p.dynamic]


def _spill_lines(stats: admin_pb2.ShardStats) -> list[str]:
    """The disk tier (--spill-dir): the server's line, one per run, one per spilled table."""
    if not stats.spill_enabled:
        return []
    limit = f"{_mb(stats.spill_max_bytes)} MB" if stats.spill_max_bytes else "no limit"
    lines = [f"spill: on disk {_mb(stats.spill_disk_bytes_total)} MB of {limit}"]
    runs: dict[str, list[Any]] = {}
    for p in stats.partitions:
        runs.setdefault(p.run_id, []).append(p)
    for run_id, parts in runs.items():
        spilled = [p for p in parts if p.spilled]
        if not spilled:
            continue
        memory = sum(p.state_bytes + p.master_bytes + p.dynamic_held_bytes for p in parts)
        hits = sum(p.spill_hits for p in spilled)
        accesses = hits + sum(p.spill_misses for p in spilled)
        lines.append(f"spill run {run_id}: in memory {_mb(memory)} MB  on disk "
                     f"{_mb(sum(p.spill_disk_bytes for p in spilled))} MB  spills "
                     f"{sum(p.spill_spills for p in spilled)} "
                     f"({sum(p.spill_spills_per_second for p in spilled):.0f}/s)  fills "
                     f"{sum(p.spill_fills for p in spilled)} "
                     f"({sum(p.spill_fills_per_second for p in spilled):.0f}/s)  hit rate "
                     f"{hits / accesses if accesses else 0.0:.3f}")
    lines += [f"spill {p.run_id} rank {p.rank} {p.table}: pages {p.spill_frames}/"
              f"{p.spill_pages} in memory ({_mb(p.state_bytes + p.master_bytes)} MB)  on disk "
              f"{_mb(p.spill_disk_bytes)} MB  spills {p.spill_spills} "
              f"({p.spill_spills_per_second:.0f}/s)  fills {p.spill_fills} "
              f"({p.spill_fills_per_second:.0f}/s)  hit rate {p.spill_hit_rate:.3f}"
              for p in stats.partitions if p.spilled]
    return lines


def format_shard_stats(stats: admin_pb2.ShardStats, wide: bool = False,
                       all_run_ids: Iterable[str] = (), width: int = DEFAULT_WIDTH) -> str:
    """A readable report: header lines, then one row per run (state, ranks, newest step,
    pushes...), or with `wide` one row per (run, rank, table) with every counter.

    The compact view fits `width` columns: header lines wrap, a long refusals cell shows
    its count, and the least useful columns are left out (named on a last line) when the
    table is still wider. The wide view may be wider: one optimizer shared by every row is
    said once above the table instead of in each row.

    Run ids are shortened to prefixes unique among the shown runs and `all_run_ids` (the
    server's runs when `stats` is a selection, so a short id does not change with it)."""
    header = [
        f"server {stats.server_id}  uptime {_duration(stats.uptime_s)}  "
        f"partitions {len(stats.partitions)}",
        f"totals: state {_mb(stats.state_bytes_total)} MB  master rows "
        f"{_mb(stats.master_bytes_total)} MB  paged-out rows "
        f"{_mb(stats.dynamic_held_bytes_total)} MB  pushes "
        f"{stats.pushes_applied_total}  rows updated {stats.rows_updated_total}",
        "refusals: " + (", ".join(f"{k}={v}" for k, v in sorted(stats.refusals.items()))
                        or "-"),
        f"runs freed {stats.runs_freed} ({stats.partitions_freed} partitions); each run's "
        "state and when it is freed: --json",
    ]
    lines = [part for line in header for part in _wrapped(line, max(width, 40))]
    if not stats.partitions:
        lines.append("(no partitions registered)")
        return "\n".join(lines)
    lines += [part for line in [*_dynamic_lines(stats), *_spill_lines(stats)]
              for part in (_wrapped(line, max(width, 40)) if not wide else [line])]
    if wide:
        optimizers = {p.optimizer for p in stats.partitions}
        columns = COLUMNS if len(optimizers) > 1 else COLUMNS[:-1]
        if len(optimizers) == 1:
            lines.append(f"optimizer (every row): {optimizers.pop() or '-'}")
        rows: list[tuple[str, ...]] = [
                (p.run_id, str(p.rank), p.table, str(p.rows_held), _mb(p.state_bytes),
                 str(p.pushes_applied), str(p.rows_updated), f"{p.rows_per_second:.0f}",
                 str(p.distinct_rows_touched), str(p.last_step), str(p.lag_steps),
                 str(p.queue_depth), _refusals(p.refusals), p.run_state or "-",
                 str(p.incarnation), f"[{p.row_start},{p.row_end})", p.row_dtype or "-",
                 _mb(p.master_bytes), p.optimizer)[:len(columns)]
                for p in stats.partitions]
        return "\n".join(lines + _table(columns, rows))
    summaries = run_summaries(stats)
    short = short_run_ids([*(r.run_id for r in summaries), *all_run_ids])
    rows = [(short[r.run_id], r.state or "-", str(len(r.ranks)), str(len(r.tables)),
             str(r.last_step), str(r.lag), str(r.pushes), f"{r.rows_per_second:.0f}",
             _mb(r.state_bytes), str(r.queue), _refusals_cell(r.refusals)) for r in summaries]
    table, left_out = _fitted_table(RUN_COLUMNS, rows, width, RUN_COLUMNS_DROPPED_FIRST)
    lines += table
    notes = []
    if any(short[r.run_id] != r.run_id for r in summaries):
        notes.append("run ids shortened: --run PREFIX selects")
    if left_out:
        notes.append(f"{', '.join(left_out)} left out to fit {width} columns")
    if notes:
        lines += _wrapped(f"({'; '.join(notes)}; --wide shows all)", max(width, 40))
    return "\n".join(lines)
