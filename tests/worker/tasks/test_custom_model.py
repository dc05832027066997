"""docs/custom_model.md: its example model, as written there, trains with worker/main.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # every test here starts processes

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "custom_model.md"


def test_custom_model_example_trains(tmp_path: Path) -> None:
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    (tmp_path / "my_model.py").write_text(code)
    results = tmp_path / "two_tower.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    cmd = [sys.executable, str(REPO / "worker" / "main.py"), "--task", "my_model:TwoTower",
           "--local-optimizer", "--steps", "60", "--batch-size", "128", "--dim", "8",
           "--lr", "0.05", "--dense-lr", "0.01", "--log-every", "10", "--progress", "false",
           "--results", str(results)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(results.read_text())
    assert res["task"]["task"] == "two_tower" and res["steps"] == 60
    assert [t["name"] for t in res["task"]["tables"]] == ["user", "item", "tag"]
    assert res["final_loss"] < 0.9 * res["first_loss"], res["loss_curve"]
    assert results.with_suffix(".png").is_file()


BAD_TASKS = '''
from hybridps.dynamic import DynamicSpec


class ZeroRows(TwoTower):
    def tables(self) -> list[TableConfig]:
        return [TableConfig("user", 0, self.cfg.run.dim), *super().tables()[1:]]


class BadPolicy(TwoTower):
    def tables(self) -> list[TableConfig]:
        return [TableConfig("user", 64, self.cfg.run.dim, DynamicSpec(eviction="mru")),
                *super().tables()[1:]]
'''


@pytest.mark.parametrize(("task", "message"), [
    ("ZeroRows", "task 'two_tower': tables(): table 'user': num_rows=0 must be >= 1"),
    ("BadPolicy", "task 'two_tower': tables(): dynamic table: unknown eviction policy 'mru'"),
])
def test_a_bad_table_config_of_a_custom_task_is_one_line(tmp_path: Path, task: str,
                                                         message: str) -> None:
    """Two ranks under the launcher: the run ends on one line naming the bad value (exit
    2), no rank's traceback."""
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    (tmp_path / "my_model.py").write_text(code + BAD_TASKS)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HYBRIDPS_") and k != "LOGLEVEL"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    cmd = [sys.executable, "-m", "worker.launch", "--standalone", "--nproc_per_node", "2",
           str(REPO / "worker" / "main.py"), "--task", f"my_model:{task}",
           "--local-optimizer", "--steps", "5", "--dim", "8", "--progress", "false",
           "--log-level", "warning"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"hybridps worker: error: {message}"), output
