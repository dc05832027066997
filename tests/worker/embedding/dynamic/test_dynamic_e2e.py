"""Dynamic tables end to end (docs/dynamic_ids.md): a real shard server and real workers.

- the server's paging (Page RPC) equals --local-optimizer's bitwise, with evictions and
  page-ins at K=2, and the stats reach --results and the server's report;
- 2 ranks: checkpoints do not change the run, and a resume is bitwise;
- a 2-rank checkpoint resumed at 1 rank holds every live id with its row;
- export: every live id; --delta-since: the rows changed since a step, and tombstones;
- bad specs: one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import REPO, _env, worker_cmd

TABLES = "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,s:50"
COMMON = ["--task", "tables", "--num-rows", "300", "--dim", "8", "--progress", "false",
          "--eval-batches", "1", "--log-every", "5"]
GLOBAL_BATCH = 32

pytestmark = [pytest.mark.e2e]


def run(args: list[str], nproc: int = 1, expect: int = 0
        ) -> subprocess.CompletedProcess[str]:
    cmd = worker_cmd([*COMMON, "--batch-size", str(GLOBAL_BATCH // nproc), *args], nproc)
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    if proc.returncode != expect:
        raise AssertionError(f"worker exit {proc.returncode}, expected {expect}:\n"
                             f"{proc.stdout}\n{proc.stderr[-6000:]}")
    return proc


def export(checkpoint: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    subprocess.run([sys.executable, "-m", "worker.export", "--checkpoint", str(checkpoint),
                    "--out", str(out), *extra], cwd=REPO, env=_env(), check=True,
                   capture_output=True, timeout=120)
    return torch.load(out)


def same_tables(a: Path, b: Path) -> None:
    sa, sb = torch.load(a), torch.load(b)
    for name in sa["tables"]:
        assert torch.equal(sa["tables"][name], sb["tables"][name]), name


@pytest.mark.timeout(600)
def test_server_pages_like_the_local_optimizer(server: PsServer, tmp_path: Path) -> None:
    args = ["--tables", TABLES, "--staleness", "2", "--steps", "30"]
    run([*args, "--ps", server.address, "--run-id", "dyn-server", "--dump-state",
         str(tmp_path / "server.pt"), "--results", str(tmp_path / "server.json")])
    run([*args, "--local-optimizer", "--dump-state", str(tmp_path / "local.pt"),
         "--results", str(tmp_path / "local.json")])
    same_tables(tmp_path / "server.pt", tmp_path / "local.pt")
    res = json.loads((tmp_path / "server.json").read_text())
    user = res["dynamic"]["user"]
    assert user["evictions"] > 0 and user["page_ins"] > 0 and user["occupied"] == 40
    assert 0 < user["hit_rate"] < 1
    assert res["dynamic"]["ad"]["refused_filter"] > 0  # threshold=2
    rows = {p["table"]: p for p in res["server_stats"]["partitions"]}
    assert rows["user"]["dynamic"] and rows["user"]["dynamic_evictions"] == user["evictions"]
    assert rows["user"]["dynamic_page_ins"] == user["page_ins"]
    assert not rows["s"].get("dynamic", False)


@pytest.fixture(scope="module")
def two_ranks(server: PsServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks, K=2: 20 steps straight with checkpoints at 9 and 19; and 20 steps resumed
    from the checkpoint of step 9."""
    d = tmp_path_factory.mktemp("dyn-ranks")
    ps = ["--ps", server.address, "--tables", TABLES, "--staleness", "2", "--steps", "20"]
    run([*ps, "--run-id", "dyn-plain", "--dump-state", str(d / "plain.pt")], nproc=2)
    run([*ps, "--run-id", "dyn-ck", "--checkpoint-every", "10", "--checkpoint-dir",
         str(d / "ck"), "--dump-state", str(d / "straight.pt")], nproc=2)
    run([*ps, "--run-id", "dyn-resumed", "--resume-from", str(d / "ck" / "step-0000000009"),
         "--checkpoint-dir", str(d / "ck2"), "--dump-state", str(d / "resumed.pt")], nproc=2)
    return d


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_and_resume_are_bitwise(two_ranks: Path) -> None:
    same_tables(two_ranks / "plain.pt", two_ranks / "straight.pt")
    same_tables(two_ranks / "straight.pt", two_ranks / "resumed.pt")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_and_delta_export(two_ranks: Path, tmp_path: Path) -> None:
    ck = two_ranks / "ck"
    full = export(ck / "step-0000000019", tmp_path / "full.pt")
    before = export(ck / "step-0000000009", tmp_path / "before.pt")
    delta = export(ck / "step-0000000019", tmp_path / "delta.pt", "--delta-since", "9")
    for name in ("user", "ad"):
        key = f"embedding.dynamic.{name}"
        ids, rows = full[f"{key}.ids"], full[f"{key}.weight"]
        assert ids.numel() > 0 and torch.equal(ids, torch.sort(ids).values)
        old = dict(zip(before[f"{key}.ids"].tolist(), before[f"{key}.weight"], strict=True))
        d_ids = delta[f"{key}.ids"].tolist()
        assert set(d_ids) <= set(ids.tolist())
        now = dict(zip(ids.tolist(), rows, strict=True))
        for ident, row in zip(d_ids, delta[f"{key}.weight"], strict=True):
            assert torch.equal(row, now[ident])
        changed = {i for i, r in now.items() if i not in old or not torch.equal(r, old[i])}
        assert changed <= set(d_ids)  # every changed row is in the delta
        tombs = set(delta[f"{key}.tombstones"].tolist())
        assert not tombs & set(now)  # a tombstone is never a live id
        if name == "user":  # expire=6 over 20 steps
            assert tombs and tombs <= set(old) | tombs
    assert "embedding.tables.s.weight" in delta  # static tables whole


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_resume_at_one(server: PsServer, tmp_path: Path) -> None:
    """Room for every id (so no owner's capacity decides anything): the 2-rank run and its
    step-9 checkpoint resumed at 1 rank end with the same live ids and rows (float
    rounding of the dense part apart)."""
    tables = "user:400:dynamic:lfu,ad:400:3:dynamic,s:50"
    ps = ["--ps", server.address, "--tables", tables, "--staleness", "0", "--steps", "20",
          "--checkpoint-every", "10"]
    run([*ps, "--run-id", "dyn-two", "--checkpoint-dir", str(tmp_path / "a")], nproc=2)
    run([*ps, "--run-id", "dyn-one", "--checkpoint-dir", str(tmp_path / "b"), "--resume-from",
         str(tmp_path / "a" / "step-0000000009")], nproc=1)
    two = export(tmp_path / "a" / "step-0000000019", tmp_path / "two.pt")
    one = export(tmp_path / "b" / "step-0000000019", tmp_path / "one.pt")
    for name in ("user", "ad"):
        key = f"embedding.dynamic.{name}"
        assert torch.equal(two[f"{key}.ids"], one[f"{key}.ids"])
        torch.testing.assert_close(two[f"{key}.weight"], one[f"{key}.weight"], rtol=1e-4,
                                   atol=1e-5)


def test_bad_specs_fail_with_one_line() -> None:
    proc = run(["--tables", "user:0:dynamic", "--local-optimizer", "--steps", "1"], expect=2)
    assert "dynamic capacity 0 must be >= 1" in proc.stderr
    proc = run(["--tables", "user:10:dynamic:lru:mru", "--local-optimizer"], expect=2)
    assert "unknown policy 'mru'" in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 3  # the error (and argparse's usage line), no traceback
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_capacity_below_the_world_size_fails_with_one_line() -> None:
    proc = run(["--tables", "user:1:dynamic", "--local-optimizer", "--steps", "1"],
               nproc=2, expect=1)
    assert "dynamic capacity 1 is below the world size 2" in proc.stderr
