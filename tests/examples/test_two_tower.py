"""examples/two_tower.py (docs/custom_model.md#training-from-files): a custom task that
declares its columns gets its batches from the one file path, and a run of it stopped at a
checkpoint and resumed ends bitwise equal to the run straight through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.two_tower import ITEMS, TAGS, USERS, FileTowers, write_data
from tests.testing.reference_trainer import LocalEmbedding
from worker.config.train_config import TrainConfig
from worker.data.errors import DataError
from worker.tasks import task_class
from worker.tasks.base import HybridModel, build_dense_seeded

REPO = Path(__file__).resolve().parents[2]


def config(folder: Path, **flags: object) -> TrainConfig:
    return TrainConfig.of(**{
        "local_optimizer": True, "task": "examples.two_tower:FileTowers",
        "train_files": str(folder / "train-*.parquet"),
        "valid_files": str(folder / "valid-*.parquet"), "batch_size": 32, "dim": 8, **flags})


def test_the_task_declares_its_columns_and_reads_the_files(tmp_path: Path) -> None:
    write_data(tmp_path, train_files=2, rows_per_file=256, rows_per_group=64, valid_rows=96)
    assert task_class("examples.two_tower:FileTowers") is FileTowers
    task = FileTowers(config(tmp_path))
    assert [(t.name, t.num_rows, t.dim) for t in task.tables()] == [
        ("user", USERS, 8), ("item", ITEMS, 8), ("tag", TAGS, 8)]
    assert task.spec.dense == () and task.steps_per_epoch(2) == 8  # 512 rows: 256 a rank
    b = task.batch(3, 1, 2)
    assert set(b.ids) == {"user", "item"} and set(b.bags) == {"tag"} and b.size == 32
    model = HybridModel(LocalEmbedding(task.tables(), seed=0, init_std=0.1),
                        build_dense_seeded(task, 0))
    assert task.forward(model, b).shape == (32,)
    got = task.evaluate_full(model, 0, 1)
    assert got is not None and got["heldout_samples"] == 96
    # the declared columns are checked against the files like --features' are
    class Misnamed(FileTowers):
        def features(self):  # type: ignore[no-untyped-def]
            return {"tables": [{"column": "users", "name": "user", "rows": USERS}]}

    with pytest.raises(DataError, match=r"train-000\.parquet: column users: missing"):
        Misnamed(config(tmp_path))
    spec = tmp_path / "f.json"
    spec.write_text('{"tables": [{"column": "user_id"}]}')
    with pytest.raises(DataError, match=r"f\.json: task 'file_towers': features\(\) declares "
                       "its columns already; drop the flag"):
        FileTowers(config(tmp_path, features=str(spec)))


def _run(folder: Path, *flags: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(REPO / "worker" / "main.py"), "--local-optimizer",
           "--device", "cpu", "--task", "examples.two_tower:FileTowers", "--dim", "8",
           "--batch-size", "32", "--train-files", str(folder / "train-*.parquet"),
           "--shuffle-buffer", "100", "--checkpoint-every", "5", "--eval-every", "0",
           "--progress", "false", *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=170, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


@pytest.mark.e2e
def test_a_resumed_run_ends_bitwise_equal(tmp_path: Path) -> None:
    """256 rows, 8 steps an epoch: 12 steps straight, and 5 (a checkpoint mid-epoch) then
    --resume to 12 (into epoch 1, bags and shuffle buffer across the stop)."""
    write_data(tmp_path, train_files=2, rows_per_file=128, rows_per_group=50, valid_rows=10)
    _run(tmp_path, "--steps", "12", "--checkpoint-dir", str(tmp_path / "a"),
         "--dump-state", str(tmp_path / "straight.pt"))
    _run(tmp_path, "--steps", "5", "--checkpoint-dir", str(tmp_path / "b"))
    _run(tmp_path, "--steps", "12", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
         "--dump-state", str(tmp_path / "resumed.pt"))
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    for part in ("tables", "dense"):
        assert set(a[part]) == set(b[part]) and a[part]
        for key in a[part]:
            assert torch.equal(a[part][key], b[part][key]), (part, key)
