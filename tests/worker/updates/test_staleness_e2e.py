"""--staleness-compensation predict end to end: real torchrun ranks, a real shard server.

- K=0 is bitwise unchanged by the flag, K=1 is not (the flag is wired);
- 2 ranks against a server equal 2 ranks with --local-optimizer and --pipeline (bitwise):
  predictions depend on the pushed ids and the applied updates only, which the staleness
  window fixes by step;
- 2 ranks equal 1 rank on the same global batches (float rounding): the owner adds the
  prediction of its rows to what every rank looks up (synthetic: fused pooled lookups;
  KGE KvsAll: lookup + local_block);
- checkpoints at K=2 do not change the run, and a run resumed from one equals the
  uninterrupted run (bitwise at 2 ranks, float rounding at 3): the predictor's state is in
  the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import step_dir
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import assert_states, run
from tests.worker.tasks.kge.test_kge_task import write_graph

pytestmark = pytest.mark.e2e  # every test here starts processes

PREDICT = ["--staleness-compensation", "predict"]
NONE = ["--staleness-compensation", "none"]


def kge_job(directory: Path) -> list[str]:
    graph = write_graph(directory / "graph")
    return ["--task", "kge", "--data-dir", str(graph), "--model", "keci", "--model-config",
            str(graph / "keci.json"), "--dim", "9", "--epochs", "3", "--lr", "0.05",
            "--dense-lr", "0.05", "--eval-every", "0"]


def _dump(tmp_path: Path, tag: str, args: list[str], nproc: int) -> Path:
    out = tmp_path / f"{tag}.pt"
    run([*args, "--dump-state", str(out), "--results", str(tmp_path / f"{tag}.json")],
        nproc=nproc)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_k0_is_unchanged_and_k1_is_changed(tmp_path: Path) -> None:
    base = ["--local-optimizer", "--steps", "12"]
    plain0 = _dump(tmp_path, "k0", [*base, "--staleness", "0", *NONE], 1)
    pred0 = _dump(tmp_path, "k0p", [*base, "--staleness", "0", *PREDICT], 1)
    assert_states(plain0, pred0, exact=True)
    plain1 = _dump(tmp_path, "k1", [*base, "--staleness", "1", *NONE], 1)
    pred1 = _dump(tmp_path, "k1p", [*base, "--staleness", "1", *PREDICT], 1)
    with pytest.raises(AssertionError, match="differs"):
        assert_states(plain1, pred1, exact=True)
    comp = json.loads((tmp_path / "k1p.json").read_text())["staleness"]["compensation"]
    assert comp["method"] == "predict" and comp["predicted_rows_mean"] > 0
    assert json.loads((tmp_path / "k0p.json").read_text())["staleness"]["compensation"] == {
        "method": "none"}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("job", ["synthetic", "kge"])
def test_server_equals_local_optimizer_and_pipeline(server: PsServer, tmp_path: Path,
                                                    job: str) -> None:
    args = ["--steps", "14", "--staleness", "1", *PREDICT]
    if job == "kge":
        args = ["--staleness", "1", *PREDICT, *kge_job(tmp_path)]
    on_server = _dump(tmp_path, "server", [*args, "--ps", server.address, "--run-id",
                                           f"predict-{job}"], 2)
    local_piped = _dump(tmp_path, "local", [*args, "--local-optimizer", "--pipeline", "true"],
                        2)
    assert_states(on_server, local_piped, exact=True)
    res = json.loads((tmp_path / "server.json").read_text())
    assert res["staleness"]["compensation"]["predicted_rows_mean"] > 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("job", ["synthetic", "kge"])
def test_two_ranks_equal_one_rank(tmp_path: Path, job: str) -> None:
    args = ["--local-optimizer", "--steps", "14", "--staleness", "2", *PREDICT]
    if job == "kge":
        args = ["--local-optimizer", "--staleness", "2", *PREDICT, *kge_job(tmp_path)]
    one = _dump(tmp_path, "one", args, 1)
    two = _dump(tmp_path, "two", args, 2)
    assert_states(one, two, exact=False)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_and_resume_keep_the_predictions(server: PsServer, tmp_path: Path) -> None:
    stale = ["--ps", server.address, "--staleness", "2", "--steps", "16", *PREDICT]
    run([*stale, "--run-id", "p-plain", "--dump-state", str(tmp_path / "plain.pt")])
    run([*stale, "--run-id", "p-ck", "--checkpoint-every", "5", "--checkpoint-dir",
         str(tmp_path / "ck"), "--dump-state", str(tmp_path / "ck.pt")])
    assert_states(tmp_path / "plain.pt", tmp_path / "ck.pt", exact=True)
    manifest = json.loads((step_dir(tmp_path / "ck", 9) / "manifest.json").read_text())
    payload = torch.load(step_dir(tmp_path / "ck", 9) / manifest["pending"]["files"][0]["file"])
    # Applied through 7: the ids of the pending steps 8, 9 and the deltas they need.
    assert {8, 9} <= set(payload["prediction"]["pushed"]) <= {6, 7, 8, 9}
    assert payload["prediction"]["deltas"]["user"]["ids"].numel() > 0
    for nproc in (2, 3):
        out = tmp_path / f"resumed{nproc}.pt"
        run([*stale, "--run-id", f"p-resumed{nproc}", "--resume-from",
             str(step_dir(tmp_path / "ck", 9)), "--dump-state", str(out)], nproc=nproc)
        assert_states(tmp_path / "plain.pt", out, exact=nproc == 2)
