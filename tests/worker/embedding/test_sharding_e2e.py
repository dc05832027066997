"""Table-wise and auto sharding end to end (real gloo ranks under torchrun, a real shard
server or --local-optimizer): at --staleness 0 they equal the single-process reference
(tests/testing/reference_trainer.py) within the tolerances of the row-wise tests
(tests/worker/train/test_worker_e2e.py), each table placed where results.json says; and a
row-wise checkpoint resumes table-wise and auto, at another world size too, equal to the
straight row-wise run (checkpoints hold global row ranges: any placement loads them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridps.checkpoint import step_dir
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import assert_states
from tests.worker.checkpoint.test_checkpoint import run as run_resumable
from tests.worker.train.test_worker_e2e import (
    SMALL,
    assert_matches_reference,
    run_worker,
    small_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # torchrun'd ranks, ~1 min a run

SYNTHETIC_TABLES = ("user", "item", "category", "tag")
TABLES_JOB = ["--task", "tables", "--tables", "a:3000,b:500:3:table_wise,c:40",
              "--num-rows", "3000", "--pool-at", "owner"]
# (update source, --sharding, extra flags, what the reference config overrides)
CASES = {
    "server-table_wise": ("server", "table_wise", [], {}),
    "local-auto": ("local", "auto", [], {}),
    "server-auto-tables": ("server", "auto", TABLES_JOB,
                           {"task": "tables", "tables": "a:3000,b:500:3:table_wise,c:40",
                            "num_rows": 3000}),
}


def _placement(res: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    return {name: (p["scheme"], p["ranks"]) for name, p in res["embedding"]["sharding"].items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_sharding_staleness0_matches_reference(ps_address: str, tmp_path: Path,
                                               case: str) -> None:
    source, sharding, extra, overrides = CASES[case]
    where = (["--ps", ps_address, "--run-id", f"shard-{case}-{tmp_path.name}"]
             if source == "server" else ["--local-optimizer"])
    run_worker([*where, "--staleness", "0", "--sharding", sharding, "--dump-state",
                str(tmp_path / "state.pt"), "--results", str(tmp_path / "r.json"),
                *SMALL, *extra])
    placed = _placement(json.loads((tmp_path / "r.json").read_text()))
    if case == "server-table_wise":  # every table whole, over both ranks
        assert {s for s, _ in placed.values()} == {"table_wise"}
        assert {r[0] for _, r in placed.values()} == {0, 1}
        assert all(len(r) == 1 for _, r in placed.values())
    elif case == "local-auto":  # the big table row-wise, the small ones whole
        assert placed["user"] == ("row_wise", [0, 1])
        assert {placed[t][0] for t in SYNTHETIC_TABLES[1:]} == {"table_wise"}
    else:  # b chose table_wise itself; a (most of the bytes) row-wise; c small: whole
        assert placed["a"] == ("row_wise", [0, 1])
        assert placed["b"][0] == placed["c"][0] == "table_wise"
    assert_matches_reference(tmp_path / "state.pt", small_config(**overrides))


@pytest.mark.timeout(900)
def test_row_wise_checkpoint_resumes_table_wise_and_auto(server: PsServer,
                                                         tmp_path: Path) -> None:
    ps = ["--ps", server.address]
    run_resumable([*ps, "--run-id", "rw-straight", "--steps", "20", "--dump-state",
                   str(tmp_path / "straight.pt")])
    run_resumable([*ps, "--run-id", "rw-first", "--steps", "10", "--checkpoint-every", "10",
                   "--checkpoint-dir", str(tmp_path / "ck")])
    for sharding, nproc in (("table_wise", 3), ("auto", 2)):
        out = tmp_path / f"{sharding}{nproc}.pt"
        run_resumable([*ps, "--run-id", f"rs-{sharding}", "--steps", "20", "--sharding",
                       sharding, "--resume-from", str(step_dir(tmp_path / "ck", 9)),
                       "--checkpoint-dir", str(tmp_path / f"ck_{sharding}"),
                       "--results", str(tmp_path / f"{sharding}.json"), "--dump-state",
                       str(out)], nproc=nproc)
        placed = _placement(json.loads((tmp_path / f"{sharding}.json").read_text()))
        assert "table_wise" in {s for s, _ in placed.values()}, placed
        assert_states(tmp_path / "straight.pt", out, exact=False)


@pytest.mark.timeout(900)
def test_dynamic_tables_table_wise_reshard(server: PsServer, tmp_path: Path) -> None:
    """Dynamic tables table-wise: every slot (and every raw id) on one rank, the other
    rank's partition an empty range on the server. With room for every id, a 2-rank
    table-wise run ends with the live ids and rows of the 1-rank run, and its checkpoint
    resumes row-wise (the ids hashed over both ranks again) to the same."""
    from tests.worker.embedding.dynamic.test_dynamic_e2e import export
    from tests.worker.embedding.dynamic.test_dynamic_e2e import run as run_dynamic

    tables = "user:400:table_wise:dynamic:lfu,ad:400:3:table_wise:dynamic,s:50"
    flags = ["--ps", server.address, "--tables", tables, "--staleness", "0", "--steps", "20",
             "--checkpoint-every", "10"]
    run_dynamic([*flags, "--run-id", "dtw-one", "--checkpoint-dir", str(tmp_path / "one")])
    run_dynamic([*flags, "--run-id", "dtw-two", "--checkpoint-dir", str(tmp_path / "two"),
                 "--results", str(tmp_path / "two.json")], nproc=2)
    placed = _placement(json.loads((tmp_path / "two.json").read_text()))
    assert placed["user"][0] == placed["ad"][0] == "table_wise"
    assert len(placed["user"][1]) == len(placed["ad"][1]) == 1
    run_dynamic([*flags, "--run-id", "dtw-rw", "--checkpoint-dir", str(tmp_path / "rw"),
                 "--resume-from", str(step_dir(tmp_path / "two", 9)), "--tables",
                 tables.replace(":table_wise", "")], nproc=2)
    one = export(step_dir(tmp_path / "one", 19), tmp_path / "one.pt")
    for run_dir in ("two", "rw"):
        got = export(step_dir(tmp_path / run_dir, 19), tmp_path / f"{run_dir}.pt")
        for name in ("user", "ad"):
            key = f"embedding.dynamic.{name}"
            assert got[f"{key}.ids"].numel() > 0
            assert torch.equal(got[f"{key}.ids"], one[f"{key}.ids"]), (run_dir, name)
            torch.testing.assert_close(got[f"{key}.weight"], one[f"{key}.weight"], rtol=1e-4,
                                       atol=1e-5)
