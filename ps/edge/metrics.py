"""Prometheus `/metrics` for a shard server (`--metrics-port`; off by default).

    python -m ps --metrics-port 9400        # http://HOST:9400/metrics (HOST: the --host)
    python -m ps --metrics-port 0           # a free port, printed and logged (event=metrics)

What a scrape shows (the official prometheus_client; the same numbers as GetShardStats,
read from the Store at scrape time, so nothing is counted twice):
- per partition, labels run, rank, table: hybridps_partition_pushes_applied_total,
  hybridps_partition_rows_updated_total, hybridps_partition_refusals_total (+ reason),
  and the gauges hybridps_partition_{rows_held, state_bytes, master_bytes, rows_per_second,
  distinct_rows_touched, last_step, lag_steps, queue_depth};
- per dynamic table's partition (docs/dynamic_ids.md): hybridps_partition_dynamic_{capacity,
  occupied, admissions, refusals, evictions, page_ins, hit_rate, paged_rows, paged_bytes,
  expired, dropped};
- per spilled table's partition (--spill-dir, ps/core/spill.py):
  hybridps_partition_spill_{disk_bytes, pages, frames, hit_rate} and the counters
  hybridps_partition_spill_{hits, misses, fills, spills}_total (their rate(): per second);
- per run: hybridps_run_state{run, state} = 1 for its state (active, finished, aborted,
  abandoned);
- per server: hybridps_refusals_total{reason}, hybridps_uptime_seconds,
  hybridps_server_info{server_id}, and the process_* metrics of prometheus_client;
- hybridps_push_latency_seconds{run, rank, table}: a histogram of the time from a push's
  first chunk arriving to its answer being ready (queueing + the optimizer update; the
  network and the answer's encoding are not in it).

Labels are only run, rank, table (and a refusal's reason, from a fixed set), so the number
of series is bounded by the partitions the server holds; the latency series of a run whose
partitions are gone are dropped at the next scrape. The endpoint has no token and no TLS:
bind the server (--host) to a network only the scraper reaches (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ps.core.store import Store, kv

log = logging.getLogger("ps.metrics")

LABELS = ("run", "rank", "table")
RUN_STATES = ("active", "finished", "aborted", "abandoned")
# A push's time in the server runs from ~50 us (small push, update on the event loop) to
# seconds (a big push behind a queue).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PARTITION_GAUGES = (
    ("rows_held", "rows of the table this partition holds"),
    ("state_bytes", "optimizer state bytes held for the partition"),
    ("master_bytes", "fp32 master-row bytes (row dtype bf16), not in state_bytes"),
    ("rows_per_second", "rows updated per second over the recent window"),
    ("distinct_rows_touched", "distinct rows updated at least once"),
    ("last_step", "newest step applied"),
    ("lag_steps", "newest step of the run on this server minus this partition's"),
    ("queue_depth", "pushes received but not yet applied"),
)
# a dynamic table's partitions only (docs/dynamic_ids.md), hybridps_partition_dynamic_<name>
DYNAMIC_GAUGES = (
    ("capacity", "the rank's slots"),
    ("occupied", "slots holding an id"),
    ("admissions", "new ids given a slot"),
    ("refusals", "ids refused a slot (admission filter or no evictable slot)"),
    ("evictions", "rows paged out of their slot"),
    ("page_ins", "rows paged back onto a slot"),
    ("hit_rate", "distinct ids looked up that were on a slot"),
    ("paged_rows", "rows held paged out"),
    ("paged_bytes", "host bytes of the rows held paged out"),
    ("expired", "paged-out ids dropped after --expire steps unseen"),
    ("dropped", "paged-out ids dropped over the table's quota of the budget"),
    ("paged_quota", "bytes the paged-out rows may hold (0: no limit)"),
    ("held_bytes", "host bytes the paged store holds (capacity, id map, tombstones)"),
)

# a spilled table's partitions only (ps/core/spill.py), hybridps_partition_spill_<name>
SPILL_GAUGES = (
    ("disk_bytes", "bytes of its pages in its spill file"),
    ("pages", "pages of its state"),
    ("frames", "pages of its state in memory"),
    ("hit_rate", "page accesses found in memory"),
)
SPILL_COUNTERS = (
    ("hits", "page accesses found in memory"),
    ("misses", "page accesses not found in memory"),
    ("fills", "pages read back from the spill file"),
    ("spills", "pages written to the spill file"),
)


class StoreCollector(Collector):
    """Reads Store.stats() at every scrape and yields it as Prometheus metric families."""

    def __init__(self, store: Store, latency: LatencyRecorder) -> None:
        self.store = store
        self.latency = latency

    def collect(self) -> Iterator[Any]:
        stats = self.store.stats()
        info = InfoMetricFamily("hybridps_server", "the shard server's id")
        info.add_metric([], {"server_id": stats.server_id})
        yield info
        yield GaugeMetricFamily("hybridps_uptime_seconds", "seconds since the server started",
                                value=stats.uptime_s)
        refusals = CounterMetricFamily("hybridps_refusals", "refused requests by reason, "
                                       "including those no partition could own",
                                       labels=["reason"])
        for reason, n in sorted(stats.refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals

        pushes = CounterMetricFamily("hybridps_partition_pushes_applied",
                                     "pushes applied to the partition", labels=list(LABELS))
        rows = CounterMetricFamily("hybridps_partition_rows_updated",
                                   "rows updated in the partition", labels=list(LABELS))
        part_refusals = CounterMetricFamily("hybridps_partition_refusals",
                                            "refused pushes of the partition by reason",
                                            labels=[*LABELS, "reason"])
        gauges = {name: GaugeMetricFamily(f"hybridps_partition_{name}", doc, labels=list(LABELS))
                  for name, doc in PARTITION_GAUGES}
        dynamic = {name: GaugeMetricFamily(f"hybridps_partition_dynamic_{name}", doc,
                                           labels=list(LABELS))
                   for name, doc in DYNAMIC_GAUGES}
        spill: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            **{name: GaugeMetricFamily(f"hybridps_partition_spill_{name}", doc,
                                       labels=list(LABELS)) for name, doc in SPILL_GAUGES},
            **{name: CounterMetricFamily(f"hybridps_partition_spill_{name}", doc,
                                         labels=list(LABELS)) for name, doc in SPILL_COUNTERS}}
        states: dict[str, str] = {}
        held: set[tuple[str, str, str]] = set()
        for p in stats.partitions:
            key = (p.run_id, str(p.rank), p.table)
            held.add(key)
            pushes.add_metric(list(key), p.pushes_applied)
            rows.add_metric(list(key), p.rows_updated)
            for reason, n in sorted(p.refusals.items()):
                part_refusals.add_metric([*key, reason], n)
            for name, family in gauges.items():
                family.add_metric(list(key), float(getattr(p, name)))
            if p.dynamic:
                for name, family in dynamic.items():
                    family.add_metric(list(key), float(getattr(p, f"dynamic_{name}")))
            if p.spilled:
                for name, spill_family in spill.items():
                    spill_family.add_metric(list(key), float(getattr(p, f"spill_{name}")))
            states[p.run_id] = p.run_state
        yield pushes
        yield rows
        yield part_refusals
        yield from gauges.values()
        yield from dynamic.values()
        yield from spill.values()
        run_state = GaugeMetricFamily("hybridps_run_state", "1 for the run's state on this "
                                      "server (active, finished, aborted, abandoned)",
                                      labels=["run", "state"])
        for run, state in sorted(states.items()):
            for name in RUN_STATES:
                run_state.add_metric([run, name], 1.0 if state == name else 0.0)
        yield run_state
        self.latency.forget_except(held)


class LatencyRecorder:
    """The push latency histogram; `observe` is the Store's push observer."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.histogram = Histogram(
            "hybridps_push_latency_seconds", "time from a push's first chunk arriving to its "
            "answer being ready (queueing + update)", labelnames=LABELS,
            buckets=LATENCY_BUCKETS, registry=registry)
        self._lock = threading.Lock()
        self._seen: set[tuple[str, str, str]] = set()

    def observe(self, run_id: str, rank: int, table: str, seconds: float) -> None:
        key = (run_id, str(rank), table)
        with self._lock:
            self._seen.add(key)
        self.histogram.labels(*key).observe(seconds)

    def forget_except(self, held: set[tuple[str, str, str]]) -> None:
        """Drop the series of partitions the server no longer holds (bounded cardinality)."""
        with self._lock:
            gone = self._seen - held
            self._seen -= gone
        for key in gone:
            with contextlib.suppress(KeyError):  # never observed since it was dropped
                self.histogram.remove(*key)


class MetricsServer:
    """The /metrics HTTP endpoint (a daemon thread) for one Store."""

    def __init__(self, store: Store, host: str, port: int) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.latency = LatencyRecorder(self.registry)
        self.registry.register(StoreCollector(store, self.latency))
        self._store = store
        self._httpd, self._thread = start_http_server(port, addr=host.strip("[]"),
                                                      registry=self.registry)
        self.port = int(self._httpd.server_port)
        store.push_observer = self.latency.observe
        log.info(kv("metrics", host=host, port=self.port, path="/metrics"))

    def close(self) -> None:
        self._store.push_observer = None
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
