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
          "server_threads", "nccl", "production_job"]
SUBSTAGES = ["a_both_hold", "c_server_threads", "d_bf16", "e_dynamic", "f_parquet",
             "g_profile", "b_larger"]


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
    check_production_figures(fig["production_job"])
    goals = {g["goal"]: g for g in data["goals"]}
    assert all(g["note"] == "dry run: not a measurement" for g in goals.values())
    assert any(g["stage"] == "server_threads" and g["value"] for g in goals.values())
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (DRY RUN") and "## Goals" in md
    assert "## b. The default job" in md and "## e. NCCL" in md
    assert "## f. The production-sized job" in md
    log = (out / "gpu_check.log").read_text()
    assert all(f"===== {name} " in log for name in STAGES)


def check_production_figures(prod: dict[str, Any]) -> None:
    """Stage production_job of a dry run: every sub-stage ran, in its budget, and says
    what docs/gpu_check.md says it does."""
    subs = prod["substages"]
    assert list(subs) == SUBSTAGES
    assert all(r["ok"] and r["seconds"] <= r["budget_s"] for r in subs.values()), subs
    a = subs["a_both_hold"]
    assert set(a["ratio_vs_resident"]) == {"dim 8 batch 64 adam",
                                           "dim 8 batch 64 rowwise_adagrad"}
    assert all(v > 0 for v in a["ratio_vs_resident"].values())
    threads = subs["c_server_threads"]["threads"]
    assert all(t["rows_pushed_per_step"] > 0 and t["waits"] >= 0 for t in threads.values())
    assert subs["d_bf16"]["supported"] is True and subs["d_bf16"]["bf16"]["samples_per_s"] > 0
    e = subs["e_dynamic"]
    assert e["dynamic"]["samples_per_s"] > 0 and e["device_prefetch"].startswith("not built")
    assert subs["f_parquet"]["run"]["steps"] == 3 and subs["f_parquet"]["files"] == 4
    g = subs["g_profile"]
    assert g["top_host_ops_ms"] and g["device_gaps"] is None  # no kernels on the CPU
    b = subs["b_larger"]
    assert b["elements"] >= 2.5 * prod["cap"]["resident_bound_elements"] * 0.99
    assert b["hybridps K=1"]["steps"] == 3


def _module(name: str) -> ModuleType:
    """gpu_check/NAME.py (gpu_check/ is not a package; it is on sys.path for its modules'
    imports of each other)."""
    if str(REPO / "gpu_check") not in sys.path:
        sys.path.append(str(REPO / "gpu_check"))
    spec = importlib.util.spec_from_file_location(name, REPO / "gpu_check" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report() -> ModuleType:
    return _module("gpu_report")


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


def test_the_production_job_is_sized_from_the_cap() -> None:
    job = _module("gpu_prod_job")
    sizes = job.sizes_from_cap(40 << 30)
    assert sizes["resident_bound_elements"] == (40 << 30) // 12
    assert sizes["larger_hybridps_gib"] == pytest.approx(40 * 2.5 / 3, abs=0.01)
    assert sizes["larger_resident_gib"] == pytest.approx(100.0, abs=0.01)  # > the cap
    rows = job.table_rows(sizes["larger_elements"], 64)
    assert len(rows) == 26 and sum(rows.values()) * 64 == pytest.approx(
        sizes["larger_elements"], rel=1e-3)
    spec = job.tables_spec(rows, dynamic=("cat_3",)).split(",")
    assert [e.count(":") for e in spec[:4]] == [2, 2, 2, 2]  # 3 bags, one dynamic
    assert spec[3].endswith(":dynamic") and job.ids_per_sample() == 58


def test_all_to_all_bytes_on_paper() -> None:
    job = _module("gpu_prod_job")
    # every id distinct: 58 ids a sample, 7 of 8 owned elsewhere, 8 bytes an id and a
    # row of 4 * dim bytes each way
    got = job.a2a_bytes_per_step(16384, 64, 8)
    assert got["total_bytes"] == 58 * 16384 * 7 / 8 * (8 + 2 * 64 * 4)
    assert job.a2a_bytes_per_step(16384, 64, 8, distinct_ids=800)["ids_bytes"] == 700 * 8
    assert job.owner_pooled_bag_bytes(16384, 64, 8) == 2 * 3 * 16384 * 64 * 4 * 7
    assert job.server_rows_needed(1e6, 10.0) == 1e7


def test_production_goals_come_from_its_sub_stages() -> None:
    goals = _report().goals
    stages = _stages(production_job={"substages": {
        "a_both_hold": {"ratio_vs_resident": {"dim 64 batch 16384 adam": 0.8}},
        "e_dynamic": {"dynamic_over_static": 0.85}}})
    got = {g["goal"]: g for g in goals(stages, dry_run=False)}
    speed = got["production job, dim 64 batch 16384 adam: samples/s at K=1 over the "
                "GPU-resident loop's"]
    assert speed["met"] is False and speed["margin"] == pytest.approx(0.8 / 0.9 - 1, abs=1e-3)
    assert got["production job: dynamic tables' samples/s over static tables'"]["met"] is True
