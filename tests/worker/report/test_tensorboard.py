"""`--tensorboard DIR`: the event file of a short run reads back with TensorBoard's own reader
and holds the loss, eval metrics, speed, staleness and step-time scalars."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.testing.helpers import REPO
from worker.config.train_config import TrainConfig

SMALL = ["--num-rows", "2000", "--batch-size", "32", "--dim", "8", "--progress", "false"]


@pytest.mark.e2e
def test_a_short_run_writes_scalars_tensorboard_reads_back(tmp_path: Path) -> None:
    results = tmp_path / "run.json"
    cmd = [sys.executable, str(REPO / "worker" / "main.py"), "--local-optimizer", *SMALL,
           "--steps", "30", "--log-every", "5", "--eval-every", "10", "--run-id", "tb-run",
           "--results", str(results), "--tensorboard", str(tmp_path / "tb")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=170,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(results.read_text())
    events = EventAccumulator(str(tmp_path / "tb" / "tb-run"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "staleness/applied", "staleness/arrival_lag",
            "staleness/waits", "eval/loss", "eval/auc", "eval/planted_loss",
            "eval/planted_auc"} <= tags
    assert {f"time_ms/{k}" for k in ("apply", "data", "forward", "backward", "optimizer",
                                     "push", "eval")} <= tags

    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in loss] == [5, 10, 15, 20, 25, 30]
    assert [v for _, v in loss] == pytest.approx([v for _, v in res["loss_curve"]], rel=1e-6)
    auc = [(e.step, e.value) for e in events.Scalars("eval/auc")]
    assert [s for s, _ in auc[:3]] == [10, 20, 30]  # then the final evaluation, at step 30
    assert auc[-1][1] == pytest.approx(res["eval"]["auc"], rel=1e-6)
    planted = events.Scalars("eval/planted_loss")
    assert [e.step for e in planted] == [10, 20, 30, 30]
    assert planted[-1].value == pytest.approx(res["eval"]["planted_loss"], rel=1e-6)
    assert all(e.value > 0 for e in events.Scalars("train/samples_per_s"))
    assert all(e.value >= 0 for e in events.Scalars("time_ms/forward"))
    assert events.Tags()["tensors"] == ["config/text_summary"]  # the run's config, as text
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"run_id": "tb-run"' in config_text and '"steps": 30' in config_text


def test_the_flag_says_what_to_install_when_tensorboard_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs the tensorboard package.*"
                                         r"pip install 'hybridps\[tensorboard\]'"):
        TrainConfig.of(local_optimizer=True, tensorboard="runs/tb")
    assert TrainConfig.of(local_optimizer=True).output.tensorboard == ""  # off by default
