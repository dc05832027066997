"""--pipeline (worker/train/pipeline.py) changes the timing, never the results.

Real runs: a shard server subprocess + `torchrun --nproc_per_node 2 worker/main.py` on
gloo, once with the pipeline (batch t+1 and its ids all_to_all on a second thread and
process group) and once without, at --staleness 0: the final tables, the dense weights and
the loss curves must be bitwise equal. The synthetic task covers plain and pooled (bag)
lookups fused in one exchange; the tables task a table of another size and pooling.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.testing.spawn_helpers import run_ranks
from tests.worker.train.test_worker_e2e import SMALL, run_worker, small_config
from worker.config.train_config import TrainConfig
from worker.runtime.dist import DistContext
from worker.tasks.base import Batch, HybridModel
from worker.tasks.synthetic import SyntheticTask
from worker.train.trainer import Trainer

pytestmark = pytest.mark.e2e  # every test here starts processes

TABLES_JOB = ["--task", "tables", "--tables", "a:3000,b:500:3", "--num-rows", "3000"]


def _run(ps_address: str, tmp_path: Path, tag: str, pipeline: bool, extra: list[str]
         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    out = tmp_path / tag
    out.mkdir()
    run_worker(["--ps", ps_address, "--staleness", "0", "--run-id", f"pipe-{tmp_path.name}-{tag}",
                "--pipeline", str(pipeline).lower(), "--dump-state", str(out / "state.pt"),
                "--results", str(out / "r.json"), *SMALL, "--log-every", "1", *extra])
    state = torch.load(out / "state.pt")
    return state["tables"], state["dense"], json.loads((out / "r.json").read_text())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job", [[], TABLES_JOB], ids=["synthetic", "tables"])
def test_pipeline_equals_unpipelined_at_staleness0(ps_address: str, tmp_path: Path,
                                                   job: list[str]) -> None:
    tables_on, dense_on, res_on = _run(ps_address, tmp_path, "on", True, job)
    tables_off, dense_off, res_off = _run(ps_address, tmp_path, "off", False, job)
    assert res_on["pipeline"]["enabled"] and res_on["pipeline"]["input_dist_ahead"], (
        "the pipeline did not run the input dist ahead")
    assert res_on["pipeline"]["unused_plans"] == 0
    assert not res_off["pipeline"]["input_dist_ahead"]
    assert res_on["loss_curve"] == res_off["loss_curve"]
    assert res_on["eval"] == res_off["eval"]
    assert set(tables_on) == set(tables_off)
    for name in tables_on:
        assert torch.equal(tables_on[name], tables_off[name]), f"table {name} differs"
    for key in dense_on:
        assert torch.equal(dense_on[key], dense_off[key]), f"dense {key} differs"


class _DerivedIdsTask(SyntheticTask):
    """Looks `user` up with ids it computes from the batch: not a batch field."""

    def forward(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        user_ids = batch.ids["user"] + 0  # a new tensor: the pipeline cannot find it
        shifted = Batch(batch.size, {**batch.ids, "user": user_ids}, batch.bags, batch.values)
        return super().forward(model, shifted)


def _train_tables(ctx: DistContext, cfg: TrainConfig) -> tuple[dict[str, torch.Tensor], Trainer]:
    trainer = Trainer(cfg, ctx, task=_DerivedIdsTask(cfg))
    try:
        trainer.train()
        tables = trainer.embedding.gather_full(dst=0)
    finally:
        trainer.close()
    return tables or {}, trainer


def _derived_ids_scenario(ctx: DistContext) -> None:
    cfg = small_config(steps=6, progress=False, log_every=3)
    on, trainer = _train_tables(ctx, cfg.replace(pipeline=True))
    assert trainer.inputs.plan == [] and not trainer.inputs.dist_ahead
    assert trainer.inputs.overlapped["data"] > 0, "batches were not made ahead"
    off, _ = _train_tables(ctx, cfg.replace(pipeline=False))
    for name in on:
        assert torch.equal(on[name], off[name]), name


@pytest.mark.timeout(240)
def test_derived_ids_fall_back_to_in_step_input_dist() -> None:
    """A lookup of ids the task computed: batches are still made ahead, the ids all_to_all
    stays in the step, and the results are those of the unpipelined loop."""
    run_ranks("tests.worker.train.test_pipeline:_derived_ids_scenario", 2)
