"""results.json laid out from a run's parts (worker/report/results.py): the figures derived
from the record, each part's own report under its key, the summary read from the dict, and
the file written as the dict."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from worker.config.train_config import TrainConfig
from worker.report.results import RunParts, RunRecord, run_results, summary, write_results


@dataclass
class _Stats:
    pushes: int = 3


def _parts(**over: Any) -> RunParts:
    stats = SimpleNamespace(as_dict=lambda: {"applied_mean": 1.0, "applied_max": 1,
                                             "arrival_lag_mean": 0.0, "arrival_lag_max": 0,
                                             "waits": 0, "wait_s": 0.0})
    embedding = SimpleNamespace(describe=lambda: {"tables": 1}, owner_pool=lambda: {"t0": 0},
                                groups=lambda: [])
    fields: dict[str, Any] = dict(
        task=SimpleNamespace(describe=lambda: {"name": "fake"}, save_artifacts=lambda p: []),
        mode="local-optimizer", hooks=None, budget=None,
        window=SimpleNamespace(stats=stats, predictor=None), source=SimpleNamespace(
            stats=_Stats()), dense=SimpleNamespace(describe=lambda: {"parallel": "none"}),
        embedding=embedding,
        checkpoints=SimpleNamespace(save_s=[0.5], stall_s=[0.1], behind_s=[0.0],
                                    snapshot_bytes=64, restore_s=0.0, resumed_step=-1,
                                    written=[]),
        pipeline={"enabled": False})
    fields.update(over)
    return RunParts(**fields)


def _results(record: RunRecord) -> dict[str, Any]:
    cfg = TrainConfig.of(local_optimizer=True, dim=8, batch_size=4, staleness=2)
    ctx = SimpleNamespace(world_size=2, device="cpu", backend="gloo")
    return run_results(cfg, ctx, "r1", record, _parts(), {"auc": 0.75}, None,  # type: ignore[arg-type]
                       wall_s=9.0)


def test_the_figures_come_from_the_record() -> None:
    record = RunRecord(10, 2, {"apply": 4.0, "eval": 1.0}, last_step=5,
                       loss_curve=[(3, 0.7), (5, 0.6)], train_s=2.0)
    res = _results(record)
    ran = 5 + 1 - 2
    assert res["samples"] == ran * 4 * 2
    assert res["step_time_s"] == {"apply": 4.0 / ran, "eval": 1.0 / ran}
    assert (res["first_loss"], res["final_loss"]) == (0.7, 0.6)
    assert res["loss_curve"] == [[3, 0.7], [5, 0.6]]
    assert res["eval_fraction"] == 0.5 and res["samples_per_s"] == ran * 8 / 2.0
    assert res["staleness"]["k"] == 2 and res["staleness"]["compensation"] == {"method": "none"}
    assert (res["mode"], res["sync"], res["pipeline"]) == (
        "local-optimizer", {"pushes": 3}, {"enabled": False})
    assert res["checkpoint"] == {"save_s": [0.5], "stall_s": [0.1], "behind_s": [0.0],
                                 "snapshot_bytes": 64, "restore_s": 0.0, "resumed_step": -1,
                                 "written": []}


def test_no_step_run_reports_nothing_divided_by_zero() -> None:
    res = _results(RunRecord(10, 10, {"eval": 0.0}, last_step=9))
    assert (res["samples"], res["samples_per_s"], res["eval_fraction"]) == (0, 0.0, 0.0)
    assert res["first_loss"] is None
    assert "loss nan -> nan" in summary(res, "fake")


def test_the_summary_names_the_task_and_the_mode() -> None:
    res = _results(RunRecord(10, 0, {"eval": 0.0}, last_step=9, loss_curve=[(9, 0.5)]))
    text = summary(res, "fake")
    assert text.splitlines()[0].startswith("hybridps worker: task=fake mode=local-optimizer")
    assert "eval: auc 0.7500" in text and "sync:" not in text  # no server: no sync line


def test_the_file_is_the_dict(tmp_path: Path) -> None:
    res = _results(RunRecord(10, 0, {"eval": 0.0}, last_step=9, loss_curve=[(9, 0.5)]))
    path = tmp_path / "out" / "r.json"
    files = write_results(res, str(path), _parts().task)
    assert files[0] == str(path) and Path(files[1]).is_file()  # and its loss plot
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
