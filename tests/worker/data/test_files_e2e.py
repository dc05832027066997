"""`--task files` end to end: 2 gloo ranks under torchrun train from a tiny Parquet set,
evaluate on the held-out files and write results.json; a file with an id beyond its table
stops the run with one error line naming file, row group and column (exit code 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testing.files_data import write_parquet_set

REPO = Path(__file__).resolve().parents[3]


def launch(*flags: str) -> subprocess.CompletedProcess[str]:
    """hybridps-run (torchrun whose last line is ours) of 2 ranks of --task files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "worker.launch", "--standalone", "--nproc_per_node", "2",
           str(REPO / "worker/main.py"), "--local-optimizer", "--task", "files",
           "--batch-size", "32", "--dim", "8", "--log-every", "5", "--progress", "0",
           "--device", "cpu", *flags]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170,
                          check=False)


@pytest.mark.e2e
def test_two_ranks_train_from_parquet(tmp_path: Path) -> None:
    write_parquet_set(tmp_path / "train", [[300, 200], [250], [150, 124]], rows=50)
    write_parquet_set(tmp_path / "valid", [[200], [100]], rows=50, seed=1, prefix="valid")
    results = tmp_path / "files.json"
    proc = launch("--train-files", str(tmp_path / "train" / "*.parquet"),
                    "--valid-files", str(tmp_path / "valid" / "*.parquet"), "--num-rows", "50",
                    "--epochs", "3", "--eval-every", "10", "--results", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(results.read_text())
    assert res["steps"] == 3 * ((1024 // 2) // 32)  # 16 steps an epoch on 2 ranks
    assert res["task"]["train_rows"] == 1024 and res["task"]["valid_rows"] == 300
    ev = res["eval"]
    assert ev["heldout_samples"] == 300
    assert ev["auc"] > 0.7, ev  # the label follows cat_0 % 2 (10% flipped)
    assert 0 < ev["log_loss"] < 0.69


@pytest.mark.e2e
def test_an_id_beyond_its_table_is_one_error_line(tmp_path: Path) -> None:
    write_parquet_set(tmp_path, [[64], [64]], rows=1000)
    proc = launch("--train-files", str(tmp_path / "*.parquet"), "--num-rows", "50",
                    "--steps", "2", "--shuffle-buffer", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # each rank fails at its first batch, on its own file: whichever says it first
    assert re.fullmatch(r"hybridps worker: error: \S+part-00[01]\.parquet: row group 0: column "
                        r"cat_0: id \d+ is outside table cat_0's 50 rows \(.*\)", last), last
    assert "Traceback" not in proc.stderr, proc.stderr
