"""GetShardStats and `python -m ps.admin stats` after real pushes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from hybridps.admin import (
    DEFAULT_WIDTH,
    RUN_COLUMNS,
    message_dict,
    select_runs,
    short_run_ids,
    stats_json,
)
from hybridps.v1 import admin_pb2, shard_pb2
from ps.admin import format_shard_stats, get_shard_stats
from ps.core.lifecycle import RunTracker
from tests.testing.grpc_helpers import (
    open_channel,
    push_messages,
    register,
    shard_stub,
    sync,
    table,
)
from tests.testing.helpers import REPO, start_ps_server

pytestmark = pytest.mark.e2e  # every test here starts processes

DIM = 8
ROWS = 100  # rank 0 owns [0, 50), rank 1 owns [50, 100)


def admin(*args: str) -> subprocess.CompletedProcess[str]:
    # The width off a terminal, whatever COLUMNS the test runner's environment carries
    # (80 where a parent set it): these tests read the default view's columns.
    env = {**os.environ, "COLUMNS": str(DEFAULT_WIDTH)}
    return subprocess.run([sys.executable, "-m", "ps.admin", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=env)


def test_stats_report_pushes_rows_and_steps(ps_server: str) -> None:
    with open_channel(ps_server) as channel:
        stub = shard_stub(channel)
        for rank in (0, 1):
            register(stub, "train", [table("emb", ROWS, DIM, 50 * rank, 50 * rank + 50)],
                     rank=rank, world_size=2)
        rank0 = [[1, 2, 3], [2, 4], []]  # 3 pushes, 5 rows, 4 distinct
        pushes = [m for step, ids in enumerate(rank0)
                  for m in push_messages("train", step, "emb", torch.tensor(ids, dtype=torch.int64),
                                         torch.ones(len(ids), DIM))]
        sync(stub, pushes)
        sync(stub, push_messages("train", 0, "emb", torch.tensor([60, 70]), torch.ones(2, DIM),
                                 rank=1))
        with pytest.raises(grpc.RpcError):  # one refusal, counted on rank 1
            sync(stub, push_messages("train", 1, "emb", torch.tensor([5]), torch.ones(1, DIM),
                                     rank=1))

    stats = get_shard_stats(ps_server, timeout=10)
    assert stats.server_id and stats.uptime_s > 0
    parts = {p.rank: p for p in stats.partitions}
    assert set(parts) == {0, 1}
    p0, p1 = parts[0], parts[1]
    assert (p0.run_id, p0.table, p0.row_start, p0.row_end, p0.rows_held) == (
        "train", "emb", 0, 50, 50)
    assert (p0.pushes_applied, p0.rows_updated, p0.distinct_rows_touched) == (3, 5, 4)
    assert (p0.last_step, p0.lag_steps, p0.queue_depth) == (2, 0, 0)
    assert (p1.pushes_applied, p1.rows_updated, p1.last_step, p1.lag_steps) == (1, 2, 0, 2)
    assert dict(p1.refusals) == {"row_out_of_range": 1} and dict(p0.refusals) == {}
    assert p0.state_bytes == 2 * 50 * DIM * 4 + 2 * 50  # m and v; two flags a row
    assert p0.rows_per_second > 0 and p0.optimizer.startswith("adam(")
    assert dict(stats.refusals) == {"row_out_of_range": 1}
    assert (stats.pushes_applied_total, stats.rows_updated_total) == (4, 7)
    assert stats.state_bytes_total == 2 * p0.state_bytes
    assert get_shard_stats(ps_server, run_id="other").partitions == []

    text = format_shard_stats(stats)
    assert "pushes 4" in text and "rows updated 7" in text
    assert "refusals: row_out_of_range=1" in text

    out = admin("stats", "--ps", ps_server, "--wide")  # one row per (run, rank, table)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"server {stats.server_id}")
    assert "refusals: row_out_of_range=1" in out.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = [line.split() for line in lines[header + 1:]]
    assert [r[:3] for r in rows] == [["train", "0", "emb"], ["train", "1", "emb"]]
    # columns: run rank table rows state_MB pushes rows_updated rows/s touched last_step lag
    #          queue refusals state inc rows_range dtype master_MB optimizer
    assert rows[0][5:7] == ["3", "5"] and rows[0][8:12] == ["4", "2", "0", "0"]
    assert rows[1][5:7] == ["1", "2"] and rows[1][9:11] == ["0", "2"]
    assert rows[1][12] == "row_out_of_range=1"
    assert rows[0][13:17] == ["active", "0", "[0,50)", "fp32"]

    out = admin("stats", "--ps", ps_server, "--json", "--run-id", "train")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    by_rank = {p.get("rank", 0): p for p in doc["partitions"]}
    assert int(by_rank[0]["pushes_applied"]) == 3 and int(by_rank[0]["rows_updated"]) == 5
    assert int(by_rank[0]["last_step"]) == 2 and int(by_rank[1]["last_step"]) == 0
    assert int(doc["pushes_applied_total"]) == 4
    # numbers as JSON numbers (protobuf's JSON mapping would write every int64 as a string)
    assert by_rank[0]["pushes_applied"] == 3 and doc["pushes_applied_total"] == 4
    assert by_rank[1]["refusals"] == {"row_out_of_range": 1} and doc["refusals"] == {
        "row_out_of_range": 1}
    assert by_rank[0]["run_state"] == "active" and by_rank[0]["rows_per_second"] > 0

    out = admin("stats", "--ps", ps_server, "--run-id", "nobody")
    assert out.returncode == 0 and "(no partitions registered)" in out.stdout


def test_admin_reports_an_unreachable_server() -> None:
    out = admin("stats", "--ps", "127.0.0.1:1", "--timeout-s", "5")
    assert out.returncode == 1
    assert "GetShardStats from 127.0.0.1:1 failed: UNAVAILABLE" in out.stderr


# -- the compact view, run states, --run, --watch ------------------------------------------

def _finish(stub: Any, run_id: str, rank: int, last_step: int, aborted: bool = False) -> None:
    stub.Finish(shard_pb2.FinishRequest(run_id=run_id, rank=rank, last_step=last_step,
                                        aborted=aborted, reason="test"), timeout=30)


def _one_push_run(stub: Any, run_id: str, ranks: int = 1) -> None:
    for rank in range(ranks):
        register(stub, run_id, [table("emb", 10 * ranks, DIM, 10 * rank, 10 * rank + 10)],
                 rank=rank, world_size=ranks)
        sync(stub, push_messages(run_id, 0, "emb", torch.tensor([10 * rank]),
                                 torch.ones(1, DIM), rank=rank))


def _run_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert lines[header].split() == list(RUN_COLUMNS)
    return {r[0]: r for r in (line.split() for line in lines[header + 1:])
            if not r[0].startswith("(")}


def test_compact_view_one_row_per_run_with_state_and_short_ids(ps_server: str) -> None:
    long_a = "1f0c2b7e-aaaa-4b1e-9c1d-2f3e4a5b6c7d"  # a torchrun-style 36-character id
    long_b = "1f0c2b7e-bbbb-4b1e-9c1d-2f3e4a5b6c7d"  # shares its first 9 characters
    with open_channel(ps_server) as channel:
        stub = shard_stub(channel)
        _one_push_run(stub, long_a, ranks=2)
        _one_push_run(stub, long_b)
        _one_push_run(stub, "done")
        _finish(stub, "done", 0, 0)
        _one_push_run(stub, "stopped", ranks=2)
        _finish(stub, "stopped", 0, 0, aborted=True)

    out = admin("stats", "--ps", ps_server)
    assert out.returncode == 0, out.stderr
    rows = _run_rows(out.stdout)
    short_a, short_b = "1f0c2b7e-a", "1f0c2b7e-b"  # shortest unique prefixes >= 8 chars
    assert set(rows) == {short_a, short_b, "done", "stopped"}
    # run state ranks tables step lag pushes rows/s host_MB queue refusals
    assert rows[short_a][1:5] == ["active", "2", "1", "0"]
    assert rows[short_a][6] == "2" and rows[short_b][6] == "1"
    assert rows["done"][1] == "finished" and rows["stopped"][1] == "aborted"
    assert all(len(line) <= 100 for line in out.stdout.splitlines()), out.stdout
    assert "run ids shortened" in out.stdout

    out = admin("stats", "--ps", ps_server, "--run", short_b)
    assert out.returncode == 0, out.stderr
    assert set(_run_rows(out.stdout)) == {short_b}
    out = admin("stats", "--ps", ps_server, "--run", "1f0c", "--wide")
    assert out.returncode == 0, out.stderr
    wide = out.stdout.splitlines()
    header = next(i for i, line in enumerate(wide) if line.startswith("run "))
    assert sorted(line.split()[0] for line in wide[header + 1:]) == [long_a, long_a, long_b]

    stats = get_shard_stats(ps_server)
    assert {p.run_id: p.run_state for p in stats.partitions} == {
        long_a: "active", long_b: "active", "done": "finished", "stopped": "aborted"}
    text = format_shard_stats(select_runs(stats, "nothing"))
    assert "(no partitions registered)" in text


def test_a_run_without_streams_for_the_idle_timeout_is_abandoned(tmp_path: Path) -> None:
    with start_ps_server(tmp_path, "--run-idle-timeout-s", "0.5") as server:
        with open_channel(server.address) as channel:
            _one_push_run(shard_stub(channel), "gone")  # the stream closes after the push
        time.sleep(0.8)
        stats = get_shard_stats(server.address)
    assert [p.run_state for p in stats.partitions] == ["abandoned"]


def test_watch_refreshes_until_interrupted(ps_server: str) -> None:
    with open_channel(ps_server) as channel:
        _one_push_run(shard_stub(channel), "watched")
    proc = subprocess.Popen([sys.executable, "-m", "ps.admin", "stats", "--ps", ps_server,
                             "--watch", "0.3", "--json"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        frames: list[dict[str, Any]] = []
        deadline = time.monotonic() + 30
        assert proc.stdout is not None
        while len(frames) < 3 and time.monotonic() < deadline:
            frames.append(json.loads(proc.stdout.readline()))  # one JSON document a line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(frames) == 3
    assert all(f["partitions"][0]["run_id"] == "watched" for f in frames)
    uptimes = [f["uptime_s"] for f in frames]
    assert uptimes == sorted(uptimes) and uptimes[2] - uptimes[0] >= 0.5


def test_watch_alone_takes_the_default_period_and_bad_values_are_refused() -> None:
    out = admin("stats", "--ps", "127.0.0.1:1", "--watch", "-1")
    assert out.returncode == 2 and "--watch -1.0 must be a number of seconds >= 0" in out.stderr
    from ps.admin import DEFAULT_WATCH_S, StatsConfig

    assert StatsConfig().watch == 0.0 and DEFAULT_WATCH_S == 2.0
    proc = subprocess.Popen([sys.executable, "-m", "ps.admin", "stats", "--ps", "127.0.0.1:1",
                             "--timeout-s", "0.5", "--watch"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("every 2s "), first  # the header of a refresh
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_short_run_ids_are_unique_prefixes() -> None:
    ids = ["run-0123456789ab", "0123456789abcdef-1xyz", "0123456789abcdef-2xyz", "short",
           "x" * 40]
    assert short_run_ids(ids) == {
        "run-0123456789ab": "run-0123456789ab",  # the worker's own ids stay whole
        "0123456789abcdef-1xyz": "0123456789abcdef-1",
        "0123456789abcdef-2xyz": "0123456789abcdef-2",
        "short": "short", "x" * 40: "x" * 8}


def test_message_dict_keeps_numbers_numbers() -> None:
    stats = admin_pb2.ShardStats(server_id="s", uptime_s=1.5, pushes_applied_total=2**40)
    part = stats.partitions.add(run_id="r", rank=1, last_step=-1, lag_steps=3)
    part.refusals["stale"] = 7
    doc = message_dict(stats)
    assert doc["pushes_applied_total"] == 2**40 and doc["uptime_s"] == 1.5
    assert doc["partitions"][0]["last_step"] == -1 and doc["partitions"][0]["refusals"] == {
        "stale": 7}
    assert json.loads(stats_json(stats)) == doc


def test_run_tracker_states() -> None:
    now = [100.0]
    tracker = RunTracker(clock=lambda: now[0])
    assert tracker.state("none") == ""
    for run in ("a", "b", "c"):
        tracker.registered(run, 0)
        tracker.registered(run, 1)
        tracker.stream_opened(run, 0)
    assert tracker.state("a", idle_timeout_s=5) == "active"
    tracker.finish("a", 0, 9, aborted=False, reason="done")
    assert tracker.state("a") == "active"  # rank 1 has not finished
    tracker.finish("a", 1, 9, aborted=False, reason="done")
    assert tracker.state("a") == "finished"
    tracker.finish("b", 1, 3, aborted=True, reason="SIGTERM")
    assert tracker.state("b") == "aborted"
    tracker.stream_closed("c", 0)
    now[0] += 4
    assert tracker.state("c", idle_timeout_s=5) == "active"
    now[0] += 1
    assert tracker.state("c", idle_timeout_s=5) == "abandoned"
    assert tracker.state("c", idle_timeout_s=0) == "active"  # 0: never
