"""GetShardStats and `python -m ps.admin stats` after real pushes."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
import torch

from ps.admin import format_shard_stats, get_shard_stats
from tests.grpc_helpers import open_channel, push_messages, register, shard_stub, sync, table
from tests.helpers import REPO

pytestmark = pytest.mark.e2e  # every test here starts processes

DIM = 8
ROWS = 100  # rank 0 owns [0, 50), rank 1 owns [50, 100)


def admin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ps.admin", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


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
    assert p0.state_bytes == 2 * 50 * DIM * 4 + 50
    assert p0.rows_per_second > 0 and p0.optimizer.startswith("adam(")
    assert dict(stats.refusals) == {"row_out_of_range": 1}
    assert (stats.pushes_applied_total, stats.rows_updated_total) == (4, 7)
    assert stats.state_bytes_total == 2 * p0.state_bytes
    assert get_shard_stats(ps_server, run_id="other").partitions == []

    text = format_shard_stats(stats)
    assert "pushes 4" in text and "rows updated 7" in text
    assert "refusals: row_out_of_range=1" in text

    out = admin("stats", "--ps", ps_server)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"server {stats.server_id}")
    assert "refusals: row_out_of_range=1" in out.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = [line.split() for line in lines[header + 1:]]
    assert [r[:3] for r in rows] == [["train", "0", "emb"], ["train", "1", "emb"]]
    # columns: run rank table rows state_MB pushes rows_updated rows/s touched last_step lag
    #          queue refusals
    assert rows[0][5:7] == ["3", "5"] and rows[0][8:12] == ["4", "2", "0", "0"]
    assert rows[1][5:7] == ["1", "2"] and rows[1][9:11] == ["0", "2"]
    assert rows[1][12] == "row_out_of_range=1"

    out = admin("stats", "--ps", ps_server, "--json", "--run-id", "train")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    by_rank = {p.get("rank", 0): p for p in doc["partitions"]}
    # proto3 JSON writes int64 as strings
    assert int(by_rank[0]["pushes_applied"]) == 3 and int(by_rank[0]["rows_updated"]) == 5
    assert int(by_rank[0]["last_step"]) == 2 and int(by_rank[1]["last_step"]) == 0
    assert int(doc["pushes_applied_total"]) == 4

    out = admin("stats", "--ps", ps_server, "--run-id", "nobody")
    assert out.returncode == 0 and "(no partitions registered)" in out.stdout


def test_admin_reports_an_unreachable_server() -> None:
    out = admin("stats", "--ps", "127.0.0.1:1", "--timeout-s", "5")
    assert out.returncode == 1
    assert "GetShardStats from 127.0.0.1:1 failed: UNAVAILABLE" in out.stderr
