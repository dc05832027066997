"""--task dlrm: a short 2-rank real-server run on the synthetic generator, Criteo TSV files
through the one data path (worker/data) on 2 ranks, the same batches from the TSV and from
its Parquet conversion, a run from Parquet stopped mid-epoch and resumed bitwise equal to
the run straight through, held-out AUC / log loss over 2 ranks equal to one process scoring
the same samples, and the fused 26-table lookup equal to 26 single lookups.
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
from worker.data.convert import convert_tsv
from worker.tasks.base import HybridModel, build_dense_seeded
from worker.tasks.ctr.batch import NUM_DENSE, NUM_SPARSE
from worker.tasks.ctr.dlrm import DLRMTask, parse_table_rows
from worker.tasks.ctr.synthetic import SyntheticCTR
from worker.tasks.metrics import log_loss, roc_auc

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TSV_LINES, VALID_LINES, ROWS = 4000, 600, 60


def write_criteo_tsv(path: Path, lines: int = TSV_LINES, seed: int = 3,
                     split: str = "train") -> Path:
    """Criteo-format lines (label, 13 ints, 26 hex tokens, some missing) with a learnable
    label (the planted model of `seed`; `split`: other samples of it)."""
    gen = SyntheticCTR([1000] * NUM_SPARSE, seed=seed)
    b = gen.batch(0, lines, split)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(lines):
        ints = [("" if rng.random() < 0.05 else str(int(np.expm1(v)))) for v in b.dense[i]]
        cats = [("" if r == 0 else f"{int(r) * 2654435761 % 2**32:08x}") for r in b.sparse[i]]
        out.append("\t".join([str(int(b.labels[i])), *ints, *cats]) + "\n")
    path.write_text("".join(out))
    return path


def tsv_config(path: Path, **extra: Any) -> Any:
    """--data-path DAY.tsv, held out: valid.tsv next to it when there is one."""
    valid = path.with_name("valid.tsv")
    return config_with_task_defaults(**{
        "task": "dlrm", "data_path": str(path), "local_optimizer": True, "staleness": 0,
        "batch_size": 64, "steps": 40, "table_rows": str(ROWS), "dim": 8, "eval_batches": 3,
        "eval_every": 20, "progress": False, "log_every": 4,
        "valid_files": str(valid) if valid.is_file() else "", **extra})


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
    write_criteo_tsv(root / "valid.tsv", lines=VALID_LINES, split="test")
    out = root / "out"
    out.mkdir()
    run_ranks("tests.worker.tasks.test_dlrm_task:_criteo_on_ranks", 2, str(tsv), str(out))
    return tsv, out


@pytest.mark.e2e
def test_criteo_tsv_two_ranks(criteo_run: tuple[Path, Path]) -> None:
    _, out = criteo_run
    res = json.loads((out / "metrics.json").read_text())
    ev = res["metrics"]
    # valid.tsv's 600 lines: 300 a rank, all scored by the final evaluation
    assert ev["heldout_samples"] == VALID_LINES
    assert 0.55 < ev["auc"] <= 1 and 0 < ev["log_loss"] < 0.69
    assert "planted_auc" not in ev  # real data: no planted model
    assert [s for s, _ in res["eval_curve"]] == [19, 39]
    assert res["loss"][-1] < res["loss"][0]


def _same(a: Any, b: Any) -> bool:
    return a.size == b.size and all(torch.equal(a.values[k], b.values[k]) for k in a.values) \
        and set(a.ids) == set(b.ids) and all(torch.equal(a.ids[k], b.ids[k]) for k in a.ids)


def test_criteo_tsv_and_its_parquet_give_the_same_batches(tmp_path: Path) -> None:
    tsv = write_criteo_tsv(tmp_path / "day_0.tsv", lines=64 * 25 + 10)
    task = DLRMTask(tsv_config(tsv, epochs=1, shuffle_buffer=0))
    # 1610 lines: 25 full batches of 64 on one rank, 805 lines a rank -> 12 on two
    assert task.steps_per_epoch(1) == 25 and task.steps_per_epoch(2) == 12
    assert task.describe()["train_rows"] == 1610 and task.describe()["data"] == "files"
    b = task.batch(0, 1, 2)
    assert sorted(b.ids) == sorted(f"cat_{j}" for j in range(NUM_SPARSE))
    assert b.values["dense"].shape == (64, NUM_DENSE)
    assert all(int(v.min()) >= 0 and int(v.max()) < ROWS for v in b.ids.values())  # hashed
    # no shuffle buffer: epoch 1 (step 12) reads what epoch 0 read
    assert _same(task.batch(12, 1, 2), task.batch(0, 1, 2))
    # the converter keeps the tokens' 64-bit hashes: the same ids from the Parquet files
    convert_tsv([tsv], tmp_path / "pq", rows_per_group=100)
    parquet = DLRMTask(tsv_config(tsv, data_path="", shuffle_buffer=0,
                                  train_files=str(tmp_path / "pq" / "*.parquet")))
    for step in (0, 5, 11, 12):
        for rank in (0, 1):
            assert _same(parquet.batch(step, rank, 2), task.batch(step, rank, 2)), step
    with pytest.raises(ValueError, match="--train-files or --data-path, not both"):
        DLRMTask(tsv_config(tsv, train_files=str(tmp_path / "pq" / "*.parquet")))


def _dlrm_from_parquet(folder: Path, *flags: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(REPO / "worker" / "main.py"), "--task", "dlrm",
           "--local-optimizer", "--device", "cpu", "--train-files",
           str(folder / "pq" / "*.parquet"), "--table-rows", str(ROWS), "--dim", "8",
           "--batch-size", "64", "--shuffle-buffer", "256", "--eval-every", "0",
           "--progress", "false", "--log-every", "5", "--checkpoint-every", "7", *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=170, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


@pytest.mark.e2e
def test_dlrm_from_parquet_resumes_mid_epoch_bitwise(tmp_path: Path) -> None:
    """640 rows, 10 steps an epoch: 14 steps straight, and 7 (a checkpoint mid-epoch 0)
    then --resume to 14 (into epoch 1): the same tables and dense weights, bitwise."""
    convert_tsv([write_criteo_tsv(tmp_path / "d.tsv", lines=640)], tmp_path / "pq",
                rows_per_group=100)
    _dlrm_from_parquet(tmp_path, "--steps", "14", "--checkpoint-dir", str(tmp_path / "a"),
                       "--dump-state", str(tmp_path / "straight.pt"))
    _dlrm_from_parquet(tmp_path, "--steps", "7", "--checkpoint-dir", str(tmp_path / "b"))
    _dlrm_from_parquet(tmp_path, "--steps", "14", "--checkpoint-dir", str(tmp_path / "b"),
                       "--resume", "--dump-state", str(tmp_path / "resumed.pt"))
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    for part in ("tables", "dense"):
        assert set(a[part]) == set(b[part]) and a[part]
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)


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
