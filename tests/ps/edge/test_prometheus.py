"""The shard server's Prometheus endpoint (--metrics-port): a live scrape parses with
prometheus_client's text parser, shows GetShardStats' counters, and they move with pushes."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from hybridps.admin import get_shard_stats
from ps.config import ServerConfig
from ps.edge.metrics import LatencyRecorder
from tests.testing.grpc_helpers import (
    open_channel,
    push_messages,
    register,
    shard_stub,
    sync,
    table,
)
from tests.testing.helpers import REPO, start_ps_server

DIM = 4
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    """{(sample name, sorted labels): value} and {family name: type} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def metrics_url(server_stdout: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"metrics on (http://\S+/metrics)", server_stdout.read_text())
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise AssertionError(f"no metrics address in {server_stdout.read_text()!r}")


def part(run: str, rank: int, tab: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"run": run, "rank": str(rank), "table": tab, **extra}.items()))


@pytest.mark.e2e
def test_scrape_of_a_live_server_shows_counters_that_move(tmp_path: Path) -> None:
    with start_ps_server(tmp_path, "--metrics-port", "0") as server:
        url = metrics_url(server.stdout_path)
        before, types = scrape(url)
        assert types["hybridps_partition_pushes_applied"] == "counter"
        assert types["hybridps_push_latency_seconds"] == "histogram"
        assert not [k for k in before if k[0] == "hybridps_partition_pushes_applied_total"]
        assert before[("hybridps_uptime_seconds", ())] > 0
        assert any(k[0] == "process_cpu_seconds_total" for k in before)

        with open_channel(server.address) as channel:
            stub = shard_stub(channel)
            register(stub, "m1", [table("emb", 20, DIM, 0, 20)])
            pushes = [m for step in range(3) for m in push_messages(
                "m1", step, "emb", torch.tensor([1, 2, step + 5]), torch.ones(3, DIM))]
            sync(stub, pushes)
            mid, _ = scrape(url)
            sync(stub, push_messages("m1", 3, "emb", torch.tensor([9]), torch.ones(1, DIM)))
            with pytest.raises(Exception, match="row"):  # out of range: a refusal
                sync(stub, push_messages("m1", 4, "emb", torch.tensor([99]),
                                         torch.ones(1, DIM)))
        after, _ = scrape(url)
        stats = get_shard_stats(server.address)

    key = part("m1", 0, "emb")
    assert mid[("hybridps_partition_pushes_applied_total", key)] == 3
    assert mid[("hybridps_partition_rows_updated_total", key)] == 9
    assert mid[("hybridps_push_latency_seconds_count", key)] == 3
    assert after[("hybridps_partition_pushes_applied_total", key)] == 4  # moved
    assert after[("hybridps_partition_rows_updated_total", key)] == 10
    assert after[("hybridps_push_latency_seconds_count", key)] == 4
    assert 0 < after[("hybridps_push_latency_seconds_sum", key)] < 10
    assert after[("hybridps_push_latency_seconds_bucket", part("m1", 0, "emb", le="+Inf"))] == 4
    # the same numbers as GetShardStats
    p = stats.partitions[0]
    assert after[("hybridps_partition_state_bytes", key)] == p.state_bytes
    assert after[("hybridps_partition_rows_held", key)] == p.rows_held == 20
    assert after[("hybridps_partition_distinct_rows_touched", key)] == p.distinct_rows_touched
    assert after[("hybridps_partition_last_step", key)] == p.last_step == 3
    assert after[("hybridps_partition_queue_depth", key)] == 0
    assert after[("hybridps_partition_refusals_total",
                  part("m1", 0, "emb", reason="row_out_of_range"))] == 1
    assert after[("hybridps_refusals_total", (("reason", "row_out_of_range"),))] == 1
    assert after[("hybridps_run_state", (("run", "m1"), ("state", "active")))] == 1
    assert after[("hybridps_run_state", (("run", "m1"), ("state", "finished")))] == 0
    assert after[("hybridps_server_info", (("server_id", stats.server_id),))] == 1
    # bounded labels: hybridps series carry only run, rank, table (+ reason, le, state, id)
    allowed = {"run", "rank", "table", "reason", "le", "state", "server_id"}
    assert all({k for k, _ in labels} <= allowed
               for name, labels in after if name.startswith("hybridps_"))


def test_latency_series_of_dropped_partitions_are_forgotten() -> None:
    recorder = LatencyRecorder(CollectorRegistry())
    recorder.observe("a", 0, "t", 0.01)
    recorder.observe("b", 1, "t", 0.02)
    recorder.forget_except({("a", "0", "t")})
    names = {tuple(s.labels.values()) for m in recorder.histogram.collect()
             for s in m.samples if s.name.endswith("_count")}
    assert names == {("a", "0", "t")}


@pytest.mark.parametrize(("fields", "message"), [
    ({"metrics_port": -2}, "--metrics-port -2 must be in [0, 65535] (-1: off)"),
    ({"metrics_port": 70000}, "must be in [0, 65535]"),
    ({"port": 9400, "metrics_port": 9400}, "--metrics-port 9400 is the gRPC --port"),
])
def test_bad_metrics_port_is_refused(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as info:
        ServerConfig(**fields)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_metrics_are_off_by_default() -> None:
    assert ServerConfig().metrics_port == -1


def test_compose_documents_an_optional_scrape() -> None:
    """docker-compose.yml: metrics off unless HYBRIDPS_METRICS_PORT is set, and a commented
    Prometheus service whose scrape job (docs/prometheus.yml) targets that port."""
    text = (REPO / "docker-compose.yml").read_text()
    spec = yaml.safe_load(text)
    assert spec["services"]["ps"]["environment"]["HYBRIDPS_METRICS_PORT"] == (
        "${HYBRIDPS_METRICS_PORT:--1}")
    assert ServerConfig(metrics_port=int("-1")).metrics_port == -1
    commented = "\n".join(line.strip()[2:] for line in text.splitlines()
                          if line.strip().startswith("# "))
    assert "HYBRIDPS_METRICS_PORT=9400 docker compose up" in commented
    service = yaml.safe_load(commented[commented.index("prometheus:\n"):])["prometheus"]
    assert service["volumes"] == ["./docs/prometheus.yml:/etc/prometheus/prometheus.yml:ro"]
    scrape = yaml.safe_load((REPO / "docs" / "prometheus.yml").read_text())
    job = scrape["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["ps:9400"]
