"""--task dlrm: a short 2-rank real-server run on the synthetic generator, the Criteo TSV path
on 2 ranks, held-out AUC / log loss over 2 ranks equal to one process scoring the same
samples, and the fused 26-table lookup equal to 26 single lookups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.testing.helpers import start_ps_server
from tests.testing.reference_trainer import LocalEmbedding
from tests.testing.spawn_helpers import run_ranks
from worker.config.task_defaults import config_with_task_defaults
from worker.tasks.base import HybridModel, build_dense_seeded
from worker.tasks.ctr.batch import NUM_DENSE, NUM_SPARSE
from worker.tasks.ctr.dlrm import HOLDOUT_EVERY, DLRMTask, parse_table_rows
from worker.tasks.ctr.synthetic import SyntheticCTR
from worker.tasks.metrics import log_loss, roc_auc

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TSV_LINES, ROWS = 4000, 60


def write_criteo_tsv(path: Path, lines: int = TSV_LINES, seed: int = 3) -> Path:
    """Criteo-format lines (label, 13 ints, 26 hex tokens, some missing) with a learnable label."""
    gen = SyntheticCTR([1000] * NUM_SPARSE, seed=seed)
    b = gen.batch(0, lines, "train")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lines):
        ints = [("" if rng.random() < 0.05 else str(int(np.expm1(v)))) for v in b.dense[i]]
        cats = [("" if r == 0 else f"{int(r) * 2654435761 % 2**32:08x}") for r in b.sparse[i]]
        out.append("\t".join([str(int(b.labels[i])), *ints, *cats]) + "\n")
    path.write_text("".join(out))
    return path


def tsv_config(path: Path, **extra: Any) -> Any:
    return config_with_task_defaults(
        task="dlrm", data_path=str(path), local_optimizer=True, staleness=0, batch_size=64,
        steps=40, table_rows=str(ROWS), dim=8, eval_batches=3, eval_every=20, progress=False,
        log_every=4, **extra)


def _criteo_on_ranks(ctx: Any, tsv: str, out_dir: str) -> None:
    """Child (each rank): fused lookup check, then train on the TSV file and evaluate."""
    from worker.embedding.rows import TableConfig
    from worker.embedding.sharded import ShardedEmbedding
    from worker.train.trainer import Trainer

    tables = [TableConfig(f"t{j}", n, 4) for j, n in enumerate([5, 40, 2, 17])]
    results = []
    for fused in (False, True):
        emb = ShardedEmbedding(tables, rank=ctx.rank, world_size=2, group=ctx.embedding_group,
                               seed=4)
        g = torch.Generator().manual_seed(ctx.rank)
        ids = [torch.randint(0, t.num_rows, (7 + ctx.rank, 2), generator=g) for t in tables]
        names = [t.name for t in tables]
        rows = (emb.lookup_many(names, ids) if fused
                else [emb.lookup(n, i) for n, i in zip(names, ids, strict=True)])
        sum(((k + 1) * r).pow(2).sum() for k, r in enumerate(rows)).backward()  # type: ignore[union-attr]
        results.append((rows, emb.pop_grads()))
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert torch.equal(a, b)
    for name, (ids_a, grads_a) in results[0][1].items():
        ids_b, grads_b = results[1][1][name]
        assert torch.equal(ids_a, ids_b)
        torch.testing.assert_close(grads_a, grads_b)

    trainer = Trainer(tsv_config(Path(tsv)), ctx)
    try:
        trainer.train()
        trainer.dump_state(str(Path(out_dir) / "state.pt"))
        metrics = trainer.evaluate()
    finally:
        trainer.close()
    if ctx.rank == 0:
        (Path(out_dir) / "metrics.json").write_text(json.dumps(
            {"metrics": metrics, "loss": [v for _, v in trainer.record.loss_curve],
             "eval_curve": trainer.record.eval_curve}))


@pytest.fixture(scope="module")
def criteo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("criteo")
    tsv = write_criteo_tsv(root / "day_0.tsv")
    out = root / "out"
    out.mkdir()
    run_ranks("tests.worker.tasks.test_dlrm_task:_criteo_on_ranks", 2, str(tsv), str(out))
    return tsv, out


@pytest.mark.e2e
def test_criteo_tsv_two_ranks(criteo_run: tuple[Path, Path]) -> None:
    _, out = criteo_run
    res = json.loads((out / "metrics.json").read_text())
    ev = res["metrics"]
    # 62 full blocks of 64 lines: 31 per rank, 3 of them held out (j = 9, 19, 29); 40 steps
    # go past the 28 training blocks of a rank into a second pass
    assert ev["heldout_samples"] == 2 * 3 * 64
    assert 0.55 < ev["auc"] <= 1 and 0 < ev["log_loss"] < 0.69
    assert "planted_auc" not in ev  # real data: no planted model
    assert [s for s, _ in res["eval_curve"]] == [19, 39]
    assert res["loss"][-1] < res["loss"][0]


def test_criteo_epochs_and_holdout_split(tmp_path: Path) -> None:
    tsv = write_criteo_tsv(tmp_path / "d.tsv", lines=64 * 25 + 10)
    task = DLRMTask(tsv_config(tsv, epochs=1))
    # 25 full blocks of 64 lines (the 10 extra lines are dropped); a rank's block j is held
    # out when j % 10 == 9. One rank: 25 blocks, 2 held out. Two ranks: 13 / 12 blocks,
    # 1 held out each -> 12 / 11 training blocks; an epoch is the smaller.
    assert HOLDOUT_EVERY == 10
    assert task.steps_per_epoch(1) == 23
    assert task.steps_per_epoch(2) == 11
    keys = {}
    for r in (0, 1):
        held = task.heldout_batches("test", r, 2)
        assert [b.size for b in held] == [64]  # the same share on every rank
        keys[r] = {tuple(x) for b in held for x in b.ids["sparse"].numpy()}
        train = {tuple(x) for s in range(11) for x in task.batch(s, r, 2).ids["sparse"].numpy()}
        assert not train & keys[r]
        # step 11 starts the second epoch: the rank's first block again
        torch.testing.assert_close(task.batch(11, r, 2).values["label"],
                                   task.batch(0, r, 2).values["label"])
    assert not keys[0] & keys[1]


@pytest.mark.e2e
def test_auc_over_two_ranks_equals_single_process(criteo_run: tuple[Path, Path]) -> None:
    """The 2-rank held-out AUC / log loss (merged summaries) == one process on the same data."""
    tsv, out = criteo_run
    cfg = tsv_config(tsv)
    task = DLRMTask(cfg)
    state = torch.load(out / "state.pt")
    emb = LocalEmbedding(task.tables(), seed=cfg.run.seed, init_std=cfg.optim.init_std)
    for name, rows in state["tables"].items():
        emb.weight(name).data.copy_(rows)
    dense = build_dense_seeded(task, cfg.run.seed)
    dense.load_state_dict(state["dense"])
    model = HybridModel(emb, dense)
    scores, labels = [], []
    with torch.no_grad():
        for rank in (0, 1):
            for b in task.heldout_batches("test", rank, 2):
                scores.append(task.forward(model, b).numpy())
                labels.append(b.values["label"].numpy())
    s, y = np.concatenate(scores), np.concatenate(labels)
    got = json.loads((out / "metrics.json").read_text())["metrics"]
    assert got["auc"] == pytest.approx(roc_auc(s, y), abs=1e-12)
    assert got["log_loss"] == pytest.approx(log_loss(s, y), rel=1e-6)


@pytest.mark.e2e
def test_dlrm_synthetic_two_ranks_real_server(tmp_path: Path) -> None:
    results = tmp_path / "dlrm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with start_ps_server(tmp_path) as ps:
        cmd = [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(REPO / "worker/main.py"),
               "--ps", ps.address, "--task", "dlrm", "--steps", "120", "--batch-size", "256",
               "--table-rows", "50", "--eval-every", "60", "--eval-batches", "8",
               "--results", str(results), "--log-every", "30"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=170, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(results.read_text())
    assert res["mode"] == "server" and res["steps"] == 120
    ev = res["eval"]
    assert ev["heldout_samples"] == 8 * 2 * 256
    assert ev["auc"] > 0.65, ev  # chance 0.5; the planted model gets ~0.8
    assert ev["planted_auc"] > ev["auc"] - 0.02
    assert 0 < ev["log_loss"] < 0.69
    assert res["task"]["table_rows"] == [50] * NUM_SPARSE
    assert results.with_suffix(".png").stat().st_size > 1000
    assert "auc=" in proc.stderr  # rank 0's progress bar shows the held-out AUC


def test_table_rows_and_model_config(tmp_path: Path) -> None:
    assert parse_table_rows("7") == [7] * NUM_SPARSE
    assert parse_table_rows(",".join(map(str, range(2, 28)))) == list(range(2, 28))
    with pytest.raises(ValueError, match="1 or 26"):
        parse_table_rows("3,4")
    with pytest.raises(ValueError, match=">= 2"):
        parse_table_rows("1")
    conf = tmp_path / "model.json"
    conf.write_text(json.dumps({"table_rows": [3] * NUM_SPARSE, "bottom_mlp": [8],
                                "top_mlp": [16]}))
    task = DLRMTask(config_with_task_defaults(task="dlrm", local_optimizer=True,
                                              model_config=str(conf)))
    assert [t.num_rows for t in task.tables()] == [3] * NUM_SPARSE
    dense = task.build_dense()
    out = dense(torch.zeros(5, NUM_DENSE), torch.zeros(5, NUM_SPARSE, task.cfg.run.dim))
    assert out.shape == (5,)
    # a flag wins over the file
    flagged = DLRMTask(config_with_task_defaults(task="dlrm", local_optimizer=True,
                                                 model_config=str(conf), table_rows="9"))
    assert flagged.table_rows == [9] * NUM_SPARSE
    conf.write_text(json.dumps({"rows": 3}))
    with pytest.raises(ValueError, match="unknown dlrm options"):
        DLRMTask(config_with_task_defaults(task="dlrm", local_optimizer=True,
                                           model_config=str(conf)))
