"""Bags pooled at their owner, end to end: a real shard server + `torchrun --nproc_per_node 2
worker/main.py --pool-at owner` at --staleness 0 equals the single-process reference
(tests/testing/reference_trainer.py: nn.Embedding(sparse=True) + F.embedding_bag + SparseAdam)
within the
same tolerances as tests/worker/train/test_worker_e2e.py; and --pipeline changes nothing (bitwise)
when
the owner pools (the owner's dedupe and bag structure are made ahead, on the pipeline's
thread). The synthetic job has a mean-pooled bag of 1..6 tags; the tables job a 3-id bag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.train.test_worker_e2e import (
    SMALL,
    assert_matches_reference,
    run_worker,
    small_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a server and torchrun'd ranks, ~1 min

TABLES_JOB = ["--task", "tables", "--tables", "a:3000,b:500:3", "--num-rows", "3000"]
JOBS = {"synthetic": ([], {}, ["tag"]),
        "tables": (TABLES_JOB, {"task": "tables", "tables": "a:3000,b:500:3",
                                "num_rows": 3000}, ["b"])}


def _run(ps_address: str, out: Path, run_id: str, extra: list[str]) -> dict[str, Any]:
    out.mkdir()
    run_worker(["--ps", ps_address, "--staleness", "0", "--run-id", run_id, "--pool-at",
                "owner", "--dump-state", str(out / "state.pt"), "--results",
                str(out / "r.json"), *SMALL, *extra])
    result: dict[str, Any] = json.loads((out / "r.json").read_text())
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job", list(JOBS))
def test_pooled_at_owner_matches_reference(ps_address: str, tmp_path: Path, job: str) -> None:
    args, overrides, bags = JOBS[job]
    res = _run(ps_address, tmp_path / "run", f"pooled-{job}-{tmp_path.name}", args)
    embedding = res["embedding"]
    sharding = embedding.pop("sharding")
    assert embedding == {"pool_at": "owner", "pooled_at_owner": bags}
    assert sharding and all(s["scheme"] == "row_wise" and s["ranks"] for s in sharding.values())
    assert_matches_reference(tmp_path / "run" / "state.pt", small_config(**overrides))


@pytest.mark.timeout(300)
def test_pooled_at_owner_pipeline_is_bitwise_unpipelined(ps_address: str,
                                                         tmp_path: Path) -> None:
    runs = {}
    for pipeline in (True, False):
        tag = f"pipe-{str(pipeline).lower()}"
        res = _run(ps_address, tmp_path / tag, f"pooled-{tag}-{tmp_path.name}",
                   [*TABLES_JOB, "--pipeline", str(pipeline).lower(), "--log-every", "1"])
        runs[pipeline] = (res, torch.load(tmp_path / tag / "state.pt"))
    (on, on_state), (off, off_state) = runs[True], runs[False]
    assert on["pipeline"]["input_dist_ahead"] and on["pipeline"]["unused_plans"] == 0
    assert on["loss_curve"] == off["loss_curve"] and on["eval"] == off["eval"]
    for part in ("tables", "dense"):
        for key, value in on_state[part].items():
            assert torch.equal(value, off_state[part][key]), f"{part} {key} differs"
