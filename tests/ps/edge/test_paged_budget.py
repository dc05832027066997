"""Paging under a memory budget end to end (ps/core/limits.py, ps/core/paging.py): a real
shard server with a run share too small for every paged-out row, two uninterrupted runs
of the same 2-rank job: rows are dropped, and the two runs' dumps and checkpoints are
bitwise equal (each drop is decided by its table's own history, not by how the two
ranks' Page calls interleave)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.testing.helpers import start_ps_server
from tests.worker.checkpoint.test_checkpoint import REPO, _env, worker_cmd

pytestmark = [pytest.mark.e2e]

ARGS = ["--task", "tables", "--num-rows", "300", "--dim", "8", "--progress", "false",
        "--eval-batches", "1", "--log-every", "5", "--batch-size", "16",
        "--tables", "user:40:dynamic:lru,s:50", "--staleness", "2", "--steps", "30",
        "--checkpoint-every", "10"]
# Each rank's fixed state is 2,925 bytes and a paged row costs 178: a run share of
# 13,000 bytes leaves each rank's table room for about 20 of the 50-70 rows it pages out.
RUN_SHARE = 13_000


def _tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: t for key, v in value.items() for k, t in _tensors(v, f"{prefix}/{key}")
                .items()}
    if isinstance(value, (list, tuple)):
        return {k: t for i, v in enumerate(value) for k, t in _tensors(v, f"{prefix}/{i}")
                .items()}
    return {}


@pytest.mark.timeout(900)
def test_two_runs_under_a_budget_are_bitwise_equal(tmp_path: Path) -> None:
    with start_ps_server(tmp_path, "--max-run-state-bytes", str(RUN_SHARE),
                         "--run-shares", "1") as server:
        for name in ("a", "b"):
            cmd = worker_cmd([*ARGS, "--ps", server.address, "--run-id", f"capped-{name}",
                              "--checkpoint-dir", str(tmp_path / f"ck-{name}"),
                              "--dump-state", str(tmp_path / f"{name}.pt"),
                              "--results", str(tmp_path / f"{name}.json")], 2)
            proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                                  timeout=400, check=False)
            assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("a", "b"):
        rows = json.loads((tmp_path / f"{name}.json").read_text())["server_stats"]["partitions"]
        user = [r for r in rows if r["table"] == "user"]
        assert all(r["dynamic_dropped"] > 0 for r in user), user  # the budget decided
        assert all(r["dynamic_paged_bytes"] <= RUN_SHARE // 2 for r in user)
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    for name in a["tables"]:
        assert torch.equal(a["tables"][name], b["tables"][name]), name
    files = sorted(p.relative_to(tmp_path / "ck-a") for p in (tmp_path / "ck-a").rglob("*.pt"))
    assert any("paged" in str(f) for f in files)
    for rel in files:
        ta = _tensors(torch.load(tmp_path / "ck-a" / rel))
        tb = _tensors(torch.load(tmp_path / "ck-b" / rel))
        assert ta.keys() == tb.keys(), rel
        for key, t in ta.items():
            assert torch.equal(t, tb[key]), (rel, key)
