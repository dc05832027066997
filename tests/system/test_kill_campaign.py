"""The shard server SIGKILLed at random steps of one run under
`torchrun --max-restarts`, restarted on the same port each time: the run ends bitwise
equal to an uninterrupted one (campaigns/server_kill_campaign.py; here 3 kills in a 60-step
run with a random seed the script prints; 20 kills: `python campaigns/server_kill_campaign.py`,
figures in docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_server_killed_three_times_ends_bitwise_equal(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(REPO / "campaigns" / "server_kill_campaign.py"),
                           "--kills", "3", "--steps", "60", "--dir", str(tmp_path / "work"),
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=850, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["failures"] == [], proc.stdout
    assert len(figures["kills"]) == 3 and figures["exit_code"] == 0, proc.stdout
    assert figures["bitwise_equal_rows_dense"] and figures["bitwise_equal_server_state"]
    for kill in figures["kills"]:  # each kill: the ranks resumed from a checkpoint not after it
        assert kill["resumed_from"] <= kill["server_step"], proc.stdout
