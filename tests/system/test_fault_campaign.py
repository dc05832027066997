"""Torn and bit-flipped checkpoints at many files and offsets are always
answered by the previous intact checkpoint or a clear refusal, never a mixed state
(campaigns/fault_campaign.py --quick: 120 damages and one resumed run, bitwise)."""

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
def test_fault_campaign_quick(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(REPO / "campaigns" / "fault_campaign.py"), "--quick",
                           "--dir", str(tmp_path / "work"), "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=850, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["failures"] == []
    outcomes = figures["outcomes"]
    checked = figures["trials"] - outcomes.get("benign", 0)
    assert outcomes["worker_previous_intact"] == checked
    assert outcomes.get("server_refused", 0) + outcomes.get("server_restored", 0) == checked
    assert outcomes.get("server_refused", 0) > 0 and figures["resumed_bitwise_equal"] == 1
    assert set(figures["damages"]) == {"flip", "torn", "zeros", "missing"}
