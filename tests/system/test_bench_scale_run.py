"""bench/scale_run.py at --quick size end to end: a real server and 2 ranks train a dynamic
table whose paged rows spill to disk, checkpoint, are killed with SIGKILL past the
checkpoint, resume from it on a new server and export; every phase reports its time,
memory and disk, and the resumed run starts at the checkpoint's step + 1."""

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
def test_the_quick_scale_run_trains_checkpoints_is_killed_resumes_and_exports(
        tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    work = tmp_path / "work"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scale_run.py"), "--quick",
                           "--work-dir", str(work), "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=850, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert not work.exists()  # removed without --keep
    record = json.loads(out.read_text())
    phases = {p["phase"]: p for p in record["phases"]}
    assert list(phases) == ["train", "checkpoint", "kill", "resume", "export"], proc.stdout
    plan = record["plan"]
    for p in phases.values():
        assert p["seconds"] > 0 and p["machine_used_bytes"] > 0, p
    for name in ("train", "checkpoint", "kill", "resume"):
        hwm = phases[name]["vm_hwm_bytes"]
        assert set(hwm) == {"server", "rank 0", "rank 1"}, (name, hwm)
        assert all(v > 0 for v in hwm.values()), (name, hwm)
    assert phases["export"]["vm_hwm_bytes"]["export"] > 0
    # the paged rows spilled: the spill files took disk, sparse beyond what was written
    spill = phases["kill"]["disk_bytes"]["spill"]
    assert 0 < spill["allocated"] < spill["apparent"], spill
    assert phases["kill"]["spill_disk_bytes"] > 0 and phases["kill"]["ids_paged"] > 0
    assert phases["checkpoint"]["disk_bytes"]["checkpoint"]["allocated"] > 0
    # killed past the checkpoint, resumed from it, trained to the end
    first = plan["every"] - 1
    assert phases["kill"]["killed_at_step"] >= first + plan["kill_after"]
    resume = phases["resume"]
    assert resume["resumed_step"] == first and resume["start_step"] == first + 1
    assert resume["last_step"] == plan["steps"] - 1
    assert resume["stale_spill_dirs_left"] and resume["stale_spill_dirs_removed"] == \
        resume["stale_spill_dirs_left"]  # the dead server's files, removed at start
    assert resume["dropped"] == 0  # the budget and the disk held every id
    # every id the run saw is exported: uniform over 500M ids, a few collide
    assert 0.98 * plan["distinct"] <= phases["export"]["ids"] <= resume["ids_held"]
    assert resume["ids_held"] == phases["export"]["ids"]
    assert record["resumed_ok"] is True
