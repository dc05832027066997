"""gpu_check/check.py --dry-run: every stage of the GPU check runs on the CPU (tiny sizes,
gloo) and is ok, and the JSON and markdown have the shape docs/gpu_check.md describes;
the goals are computed from the stages' figures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

STAGES = ["prepare", "pytest_gpu", "default_job", "sync_debug", "table_budget",
          "server_threads", "nccl"]


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_dry_run_runs_every_stage_ok_on_the_cpu(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    proc = subprocess.run([sys.executable, str(REPO / "gpu_check" / "check.py"), "--dry-run",
                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1700,
                          check=False)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log",
                                                    "gpu_check.md"]
    data = json.loads((out / "gpu_check.json").read_text())
    failed = {n: s["error"] for n, s in data["stages"].items() if not s["ok"]}
    assert proc.returncode == 0 and not failed, (failed, proc.stderr[-3000:])
    assert data["dry_run"] is True and list(data["stages"]) == STAGES
    for name, stage in data["stages"].items():
        assert {"ok", "what", "seconds", "figures", "error", "log_tail"} <= set(stage), name
        assert stage["seconds"] > 0 and stage["figures"], name
    fig = {n: s["figures"] for n, s in data["stages"].items()}
    assert fig["prepare"]["native"]["kernel"] in ("native", "torch")
    assert fig["pytest_gpu"]["passed"] == 3 and fig["pytest_gpu"]["skipped"] == 0
    variants = fig["default_job"]["variants"]
    assert set(variants) == {"sparse_adam (rows + Adam on the GPU)", "hybridps fp32 K=0",
                             "hybridps fp32 K=1", "hybridps fp32 K=2", "hybridps bf16 K=1"}
    assert all(v["samples_per_s"] > 0 for v in variants.values())
    assert variants["hybridps fp32 K=0"]["waits"] > 0  # K=0 waits for every update
    assert set(fig["default_job"]["marginal_bytes_per_element"]) == {
        "sparse_adam (rows + Adam on the GPU)", "hybridps fp32 K=1", "hybridps bf16 K=1"}
    assert fig["sync_debug"]["checked"] is False
    assert all(r["named_per_step"]["pop_grads"] == 1.0 for r in fig["sync_debug"]["runs"].values())
    assert fig["table_budget"]["rows_vs_sparse_adam"]["16"]["hybridps fp32"] == pytest.approx(
        3.0, rel=0.01)  # the dry run's rule: 4 bytes an element against 12
    for job in fig["server_threads"]["jobs"].values():
        assert job["gpu_rows_per_s_needed"] > 0 and job["keeps_up_from_threads"] is not None
    assert fig["nccl"]["group"]["backend"] == "gloo" and fig["nccl"]["job"]["backend"] == "gloo"
    goals = {g["goal"]: g for g in data["goals"]}
    assert all(g["note"] == "dry run: not a measurement" for g in goals.values())
    assert any(g["stage"] == "server_threads" and g["value"] for g in goals.values())
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (DRY RUN") and "## Goals" in md
    assert "## b. The default job" in md and "## e. NCCL" in md
    log = (out / "gpu_check.log").read_text()
    assert all(f"===== {name} " in log for name in STAGES)


def _report() -> ModuleType:
    """gpu_check/gpu_report.py (gpu_check/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_report",
                                                  REPO / "gpu_check" / "gpu_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stages(**figures: dict[str, Any]) -> dict[str, Any]:
    return {name: {"ok": True, "figures": f} for name, f in figures.items()}


def test_goals_say_met_or_missed_with_the_margin() -> None:
    goals, markdown = _report().goals, _report().markdown
    stages = _stages(
        default_job={"marginal_bytes_per_element": {"hybridps fp32 K=1": 4.4,
                                                    "hybridps bf16 K=1": 2.0},
                     "samples_per_s_vs_sparse_adam": {"hybridps fp32 K=1": 0.99}},
        table_budget={"rows_vs_sparse_adam": {"16": {"hybridps fp32": 2.9,
                                                     "hybridps bf16": 5.6}}},
        server_threads={"jobs": {"default job": {"served_over_needed_at_16": 0.5}}},
        sync_debug={"checked": True, "unnamed_total": 3})
    got = {g["goal"]: g for g in goals(stages, dry_run=False)}
    fp32 = got["GPU bytes per embedding element, fp32 rows (default job, K=1)"]
    assert fp32["met"] is False and fp32["margin"] == pytest.approx(4 / 4.4 - 1, abs=1e-3)
    assert got["GPU bytes per embedding element, bf16 rows (default job, K=1)"]["met"]
    assert got["rows per GiB over SparseAdam's, fp32 rows, dim 16"]["met"]
    speed = got["samples/s at K=1 over the GPU-resident SparseAdam loop's"]
    assert speed["met"] and speed["margin"] == pytest.approx(0.99 / 0.9 - 1, abs=1e-3)
    server = got["server rows/s at 16 threads over what a GPU step asks, default job"]
    assert server["met"] is False and server["margin"] == pytest.approx(-0.5)
    assert got["synchronising calls in the loop outside the named sync points"]["met"] is False
    text = markdown({"stages": stages, "goals": list(got.values())})
    assert "MISSED" in text and "-9.1%" in text
    # a stage that gave no figure: no verdict rather than a wrong one
    empty = goals({}, dry_run=False)
    assert all(g["met"] is None and g["value"] is None for g in empty)
