"""Dynamic tables in a chain of incremental checkpoints, end to end (real ranks; a real
shard server where named):

- every link after the full one holds its dynamic tables' slot maps, paged rows and (under
  --local-optimizer) optimizer state as delta shards, and a resume from a link equals the
  straight run bitwise: --local-optimizer at --staleness 0, 1, 2, and the server's paging;
- a 2-rank chain's link resumed at 1 rank holds every live id with its row (the
  documented re-shard of dynamic tables: the same ids, rows up to float rounding);
- a dynamic table whose interval touches a few % of its ids writes a link of well under
  0.2x its full checkpoint's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridps.step_dirs import step_dir
from tests.testing.helpers import PsServer
from tests.worker.embedding.dynamic.test_dynamic_e2e import TABLES, export, run, same_tables

pytestmark = [pytest.mark.e2e]

DYNAMIC = ("user", "ad")
KINDS = ("rows", "optim", "ids", "paged")


def _files(ck: Path, step: int, table: str) -> list[dict]:
    manifest = json.loads((step_dir(ck, step) / "manifest.json").read_text())
    return manifest["tables"][table]["shards"]


def _assert_deltas(ck: Path, full: int, links: list[int]) -> None:
    """Link `full` holds every dynamic table's files whole, each of `links` as deltas."""
    for table in DYNAMIC:
        for step, delta in [(full, False), *((s, True) for s in links)]:
            for shard in _files(ck, step, table):
                for kind in KINDS:
                    assert shard[kind].get("delta", False) is delta, (table, step, kind)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_local_optimizer_chain_resumes_bitwise(tmp_path: Path, staleness: int) -> None:
    args = ["--local-optimizer", "--tables", TABLES, "--staleness", str(staleness),
            "--steps", "20"]
    ck = tmp_path / "ck"
    run([*args, "--checkpoint-every", "4", "--checkpoint-dir", str(ck), "--dump-state",
         str(tmp_path / "straight.pt")], nproc=2)
    _assert_deltas(ck, 3, [7, 11, 15, 19])
    run([*args, "--resume-from", str(step_dir(ck, 15)), "--checkpoint-dir",
         str(tmp_path / "ck2"), "--dump-state", str(tmp_path / "resumed.pt")], nproc=2)
    same_tables(tmp_path / "straight.pt", tmp_path / "resumed.pt")


@pytest.mark.timeout(900)
def test_a_server_chain_holds_paged_deltas_and_resumes_bitwise(server: PsServer,
                                                               tmp_path: Path) -> None:
    ps = ["--ps", server.address, "--tables", TABLES, "--staleness", "2", "--steps", "20"]
    ck = tmp_path / "ck"
    run([*ps, "--run-id", "dyn-chain-ck", "--checkpoint-every", "4", "--checkpoint-dir",
         str(ck), "--dump-state", str(tmp_path / "straight.pt")], nproc=2)
    _assert_deltas(ck, 3, [7, 11, 15, 19])
    run([*ps, "--run-id", "dyn-chain-resumed", "--resume-from", str(step_dir(ck, 11)),
         "--checkpoint-dir", str(tmp_path / "ck2"), "--dump-state",
         str(tmp_path / "resumed.pt")], nproc=2)
    same_tables(tmp_path / "straight.pt", tmp_path / "resumed.pt")


@pytest.mark.timeout(900)
def test_a_two_rank_chain_resumes_at_one_rank(tmp_path: Path) -> None:
    """Room for every id (no owner's capacity decides anything), as
    test_dynamic_e2e.test_two_ranks_resume_at_one, but from the third link of a chain."""
    tables = "user:400:dynamic:lfu,ad:400:3:dynamic,s:50"
    args = ["--local-optimizer", "--tables", tables, "--staleness", "0", "--steps", "20",
            "--checkpoint-every", "5"]
    run([*args, "--checkpoint-dir", str(tmp_path / "a")], nproc=2)
    _assert_deltas(tmp_path / "a", 4, [9, 14])
    run([*args, "--checkpoint-dir", str(tmp_path / "b"), "--resume-from",
         str(step_dir(tmp_path / "a", 14))], nproc=1)
    two = export(step_dir(tmp_path / "a", 19), tmp_path / "two.pt")
    one = export(step_dir(tmp_path / "b", 19), tmp_path / "one.pt")
    for name in DYNAMIC:
        key = f"embedding.dynamic.{name}"
        assert two[f"{key}.ids"].numel() > 0
        assert torch.equal(two[f"{key}.ids"], one[f"{key}.ids"])
        torch.testing.assert_close(two[f"{key}.weight"], one[f"{key}.weight"], rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.timeout(900)
def test_a_link_writes_what_changed_of_a_dynamic_table(tmp_path: Path) -> None:
    """4,000 slots over 400,000 Zipf ids, 2 steps of 256 ids between checkpoints: the link
    of step 79 (a delta since 77) against the full checkpoint of step 81, per kind and in
    all, for the dynamic table's files (its paged store holds a few thousand ids)."""
    ck = tmp_path / "ck"
    run(["--local-optimizer", "--tables", "d:4000:dynamic:lru", "--num-rows", "400000",
         "--dim", "16", "--batch-size", "256", "--steps", "82", "--checkpoint-every", "2",
         "--checkpoint-dir", str(ck)], nproc=1)
    (inc,), (full,) = _files(ck, 79, "d"), _files(ck, 81, "d")
    assert not any(full[k].get("delta", False) for k in KINDS)
    assert all(inc[k].get("delta", False) for k in KINDS)
    sizes = {k: (inc[k]["bytes"], full[k]["bytes"]) for k in KINDS}
    assert sizes["paged"][1] > 100_000, sizes  # the store is not empty
    for kind in ("optim", "ids", "paged"):
        assert sizes[kind][0] * 5 < sizes[kind][1], sizes
    assert sum(i for i, _ in sizes.values()) * 5 < sum(f for _, f in sizes.values()), sizes
