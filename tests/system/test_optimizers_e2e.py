"""The optimizers beyond Adam end to end: real torchrun ranks, a real shard server.

- 2 ranks at --staleness 0 equal the single-process reference (tests/testing/reference_trainer.py:
its
  RowOptimizer runs the torch reference kernels on whole tables, torch.optim.Adagrad for
  adagrad), on the server and with --local-optimizer;
- a checkpoint of a rowwise Adagrad run resumes bitwise (its one sum a row in the optim
  files), and resuming it with another optimizer is refused with one line naming both;
- the weight prediction (--staleness 1 --staleness-compensation predict) works for them:
  it predicts rows, and the server and --local-optimizer agree bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridps.checkpoint import complete_checkpoints, read_shard, step_dir
from tests.testing.chains import composed_like
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import assert_states, run
from tests.worker.train.test_worker_e2e import (
    SMALL,
    assert_matches_reference,
    run_worker,
    small_config,
)

pytestmark = pytest.mark.e2e  # every test here starts processes


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "kind", "weight_decay"), [
    ("server", "rowwise_adagrad", 0.0), ("local", "rowwise_adagrad", 0.01),
    ("server", "partial_rowwise_adam", 0.01), ("local", "partial_rowwise_adam", 0.0),
    ("local", "adagrad", 0.0)])
def test_staleness0_matches_reference(ps_address: str, tmp_path: Path, mode: str, kind: str,
                                      weight_decay: float) -> None:
    where = (["--local-optimizer"] if mode == "local" else
             ["--ps", ps_address, "--run-id", f"e2e-{kind}-{weight_decay:g}"])
    run_worker([*where, "--staleness", "0", "--optimizer", kind, "--weight-decay",
                str(weight_decay), "--dump-state", str(tmp_path / "state.pt"), *SMALL])
    assert_matches_reference(tmp_path / "state.pt",
                             small_config(optimizer=kind, weight_decay=weight_decay))


ROWWISE = ["--optimizer", "rowwise_adagrad"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rowwise_adagrad_resumes_bitwise_and_refuses_another_optimizer(
        server: PsServer, tmp_path: Path) -> None:
    ps = ["--ps", server.address, "--checkpoint-every", "10", *ROWWISE]
    run([*ps, "--run-id", "ra-straight", "--steps", "20", "--checkpoint-dir",
         str(tmp_path / "ck_a"), "--dump-state", str(tmp_path / "straight.pt")])
    run([*ps, "--run-id", "ra-first", "--steps", "10", "--checkpoint-dir",
         str(tmp_path / "ck_b")])
    run([*ps, "--run-id", "ra-resumed", "--steps", "20", "--checkpoint-dir",
         str(tmp_path / "ck_b"), "--resume", "--dump-state", str(tmp_path / "resumed.pt")])
    assert_states(tmp_path / "straight.pt", tmp_path / "resumed.pt", exact=True)
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck_b")] == [9, 19]
    for rank in (0, 1):
        name = f"optim/user.r{rank:05d}.pt"
        # ck_b's step 19 is the resumed run's first checkpoint, full; ck_a's an
        # incremental link of its chain, compared as a restore composes it
        b = read_shard(step_dir(tmp_path / "ck_b", 19) / name)
        assert set(b["tensors"]) == {"sum", "master"} and b["tensors"]["master"] is None
        assert b["tensors"]["sum"].shape == (1000, 1)
        assert b["meta"]["optimizer"]["kind"] == "rowwise_adagrad"
        a = composed_like(step_dir(tmp_path / "ck_a", 19), 19, b)
        assert set(a.state) == {"sum"} and a.master is None
        assert torch.equal(a.state["sum"], b["tensors"]["sum"])
    manifest = json.loads((step_dir(tmp_path / "ck_b", 9) / "manifest.json").read_text())
    assert manifest["optimizer"]["kind"] == "rowwise_adagrad"
    refused = run(["--ps", server.address, "--run-id", "ra-adam", "--steps", "20",
                   "--resume-from", str(step_dir(tmp_path / "ck_b", 9))], expect=2)
    lines = [line for line in refused.stderr.splitlines() if "hybridps worker: error:" in line]
    assert len(lines) >= 1, refused.stderr[-2000:]
    assert ("was saved with optimizer rowwise_adagrad(lr=0.02, eps=1e-08, weight_decay=0), "
            "this run has adam(lr=0.02, betas=(0.9, 0.999), eps=1e-08)") in lines[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "partial_rowwise_adam"])
def test_weight_prediction_at_k1(server: PsServer, tmp_path: Path, kind: str) -> None:
    args = ["--steps", "14", "--staleness", "1", "--optimizer", kind]
    predict = [*args, "--staleness-compensation", "predict"]

    def dump(tag: str, extra: list[str]) -> Path:
        out = tmp_path / f"{tag}.pt"
        run([*extra, "--dump-state", str(out), "--results", str(tmp_path / f"{tag}.json")])
        return out

    on_server = dump("server", [*predict, "--ps", server.address, "--run-id", f"k1-{kind}"])
    local = dump("local", [*predict, "--local-optimizer"])
    assert_states(on_server, local, exact=True)
    comp = json.loads((tmp_path / "server.json").read_text())["staleness"]["compensation"]
    assert comp["method"] == "predict" and comp["predicted_rows_mean"] > 0
    plain = dump("plain", [*args, "--local-optimizer", "--staleness-compensation", "none"])
    with pytest.raises(AssertionError, match="differs"):
        assert_states(plain, local, exact=True)
