"""The run's PNG (worker/report/plot.py): a linear, plainly labelled loss axis with the train and
held-out curves and the planted model's loss; the task's metric on a second panel. Checked
on the matplotlib figure itself, then on the written file; and a real run writes it with an
eval curve by default."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.axes import Axes

from tests.testing.helpers import REPO
from worker.config.output_paths import plot_path
from worker.report.plot import build_figure, metric_keys, save_loss_curve


def synthetic_results() -> dict[str, Any]:
    return {
        "config": {"task": "synthetic"}, "steps": 300,
        "loss_curve": [[s, 0.69 - 0.0004 * s] for s in range(9, 300, 10)],
        "eval_curve": [[99, {"loss": 0.60, "auc": 0.70}], [199, {"loss": 0.57, "auc": 0.76}],
                       [299, {"loss": 0.55, "auc": 0.79}]],
        "eval": {"loss": 0.55, "auc": 0.79, "accuracy": 0.72, "planted_loss": 0.4822,
                 "planted_auc": 0.8488},
    }


def lines_by_label(ax: Axes) -> dict[str, Any]:
    return {line.get_label(): line for line in ax.get_lines()}


def test_synthetic_figure_has_curves_reference_lines_and_plain_linear_axes() -> None:
    fig = build_figure(synthetic_results())
    loss_ax, metric_ax = fig.axes
    assert loss_ax.get_yscale() == "linear" and metric_ax.get_yscale() == "linear"
    fig.canvas.draw()
    for ax in (loss_ax, metric_ax):  # no "x10^-1" or "+6.7e-1" offset on the axis
        assert ax.yaxis.get_offset_text().get_text() == ""
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert labels and all("e" not in t and "×" not in t for t in labels), labels
    loss = lines_by_label(loss_ax)
    assert set(loss) == {"train loss", "held-out loss", "planted model loss 0.4822"}
    assert list(loss["train loss"].get_xdata())[:2] == [9, 19]  # from 0, as the logs
    assert list(loss["held-out loss"].get_xdata()) == [99, 199, 299]
    assert list(loss["held-out loss"].get_ydata()) == [0.60, 0.57, 0.55]
    assert set(loss["planted model loss 0.4822"].get_ydata()) == {0.4822}  # horizontal
    assert loss_ax.get_ylabel() == "loss"
    metric = lines_by_label(metric_ax)
    assert set(metric) == {"held-out AUC", "planted model AUC 0.8488"}
    assert list(metric["held-out AUC"].get_ydata()) == [0.70, 0.76, 0.79]
    assert metric_ax.get_ylabel() == "AUC" and metric_ax.get_xlabel() == "step"
    assert loss_ax.get_title() == "hybridps synthetic — auc 0.7900"
    assert loss_ax.get_legend() is not None and metric_ax.get_legend() is not None


def test_kge_plots_mrr_and_no_loss_reference() -> None:
    res = {"config": {"task": "kge"}, "steps": 60, "loss_curve": [[4, 0.3], [59, 0.1]],
           "eval_curve": [[29, {"valid_mrr": 0.4}], [59, {"valid_mrr": 0.6}]],
           "eval": {"valid_mrr": 0.6, "test_mrr": 0.58, "test_hits@10": 0.9}}
    assert metric_keys(res) == ["valid_mrr", "test_mrr"]
    fig = build_figure(res)
    loss_ax, metric_ax = fig.axes
    assert set(lines_by_label(loss_ax)) == {"train loss"}
    metric = lines_by_label(metric_ax)
    assert set(metric) == {"valid mrr", "test mrr"}
    assert list(metric["test mrr"].get_xdata()) == [59]  # the final evaluation only
    assert metric_ax.get_ylabel() == "MRR"


def test_a_restored_best_model_is_marked_and_not_joined_to_the_curve() -> None:
    """--keep-best: the final evaluation is of the model of step 71, restored after step
    199: a star marks the best evaluation, the final metrics are separate markers at the
    end, and the training curve ends with the last step's own (lower) valid MRR."""
    curve = [[35, {"valid_mrr": 0.70}], [71, {"valid_mrr": 0.837}], [107, {"valid_mrr": 0.78}],
             [199, {"valid_mrr": 0.67}]]
    res = {"config": {"task": "kge"}, "steps": 400, "last_step": 199,
           "loss_curve": [[9, 2.0], [199, 0.4]], "eval_curve": curve,
           "eval": {"valid_mrr": 0.837, "test_mrr": 0.83},
           "hooks": {"restored_best": True, "best_valid_mrr": 0.837, "best_step": 71}}
    metric = lines_by_label(build_figure(res).axes[1])
    star = metric["best valid mrr 0.8370 at step 71: restored at the end"]
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([71], [0.837])
    assert star.get_marker() == "*"
    assert list(metric["valid mrr"].get_ydata()) == [0.70, 0.837, 0.78, 0.67]
    final = metric["valid mrr, final: the best model (step 71) restored"]
    assert (list(final.get_xdata()), list(final.get_ydata())) == ([199], [0.837])
    assert final.get_linestyle() == "None"
    test_final = metric["test mrr, final: the best model (step 71) restored"]
    assert list(test_final.get_xdata()) == [199]
    # without a restore the final evaluation joins the curve at the step training ended
    plain = {**res, "hooks": {"restored_best": False}, "eval": {"valid_mrr": 0.67}}
    metric = lines_by_label(build_figure(plain).axes[1])
    assert set(metric) == {"valid mrr"}
    assert list(metric["valid mrr"].get_xdata()) == [35, 71, 107, 199]


def test_a_task_without_metrics_gets_one_panel() -> None:
    fig = build_figure({"steps": 20, "loss_curve": [[9, 1.0], [19, 0.5]], "eval": {}})
    assert len(fig.axes) == 1 and set(lines_by_label(fig.axes[0])) == {"train loss"}


def test_png_is_written(tmp_path: Path) -> None:
    out = save_loss_curve(synthetic_results(), tmp_path / "sub" / "run.png")
    data = Path(out).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert plot_path(tmp_path / "run.json") == str(tmp_path / "run.png")


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_a_default_run_writes_an_eval_curve_and_its_plot(tmp_path: Path) -> None:
    """No --eval-every given: evaluations every 100 steps feed the curve and the plot."""
    results = tmp_path / "run.json"
    cmd = [sys.executable, str(REPO / "worker" / "main.py"), "--local-optimizer",
           "--num-rows", "2000", "--batch-size", "32", "--dim", "8", "--steps", "200",
           "--progress", "false", "--results", str(results)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=170,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(results.read_text())
    assert [s for s, _ in res["eval_curve"]] == [99, 199]
    ev = res["eval"]
    assert set(ev) == {"loss", "auc", "accuracy", "planted_loss", "planted_auc"}
    assert all(set(m) == set(ev) for _, m in res["eval_curve"])
    assert 0.5 < ev["planted_auc"] <= 1 and ev["planted_loss"] < ev["loss"]
    # the final evaluation comes after the last K updates are applied: close, not equal
    assert res["eval_curve"][-1][1]["auc"] == pytest.approx(ev["auc"], abs=0.02)
    png = results.with_suffix(".png")
    assert png.stat().st_size > 20_000 and f"wrote {results}  {png}" in proc.stdout
