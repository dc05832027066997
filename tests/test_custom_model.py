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

REPO = Path(__file__).resolve().parents[1]
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
