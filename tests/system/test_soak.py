"""Sync connections cut every few steps (HYBRIDPS_FAULT_CUT), and a soak
of a run against one server with its connections cut and its RSS sampled.

(a) a run whose ranks cut their Sync stream (with the arena; inline) every 7th
    step re-registers, reconnects and re-sends each time, and ends bitwise equal to the
    same run uncut;
(b) campaigns/soak.py for 15 s (the 10-minute soak is `python campaigns/soak.py`, figures in
    docs/reliability.md): the server's RSS after the warm-up stays within a generous
    bound, the run trains, the server logs no internal error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import REPO, assert_states, run
from worker.runtime.faults import CUT_ENV


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_cut_connections_reconnect_and_change_nothing(server: PsServer, tmp_path: Path
                                                      ) -> None:
    common = ["--ps", server.address, "--steps", "40", "--staleness", "1"]
    run([*common, "--run-id", "cut-none", "--dump-state", str(tmp_path / "none.pt")])
    for same_node in ("auto", "off"):
        out = tmp_path / f"{same_node}.pt"
        proc = run([*common, "--run-id", f"cut-{same_node}", "--same-node", same_node,
                    "--dump-state", str(out)], env={CUT_ENV: "7"})
        # steps 6, 13, 20, 27, 34 on each of 2 ranks: a reconnect each
        assert proc.stderr.count("event=reconnect") == 10, proc.stderr[-6000:]
        assert "transport=stream" in proc.stderr, proc.stderr[-6000:]
        assert ("event=shm " in proc.stderr) == (same_node == "auto"), proc.stderr[-6000:]
        assert_states(tmp_path / "none.pt", out, exact=True)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_soak_keeps_the_server_rss_flat(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(REPO / "campaigns" / "soak.py"), "--minutes", "0.25",
                           "--sample-s", "1", "--kill-every-s", "0", "--max-growth", "0.25",
                           "--dir", str(tmp_path / "work"), "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=550, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["failures"] == []
    assert figures["rss_growth"] is not None and figures["rss_growth"] < 0.25
    assert figures["reconnects_logged"] > 0 and figures["final_step"] > 100
