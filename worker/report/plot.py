"""The picture of a run, a PNG next to its --results JSON (run.json -> run.png).

    python -m worker.report.plot results.json            # writes results.png
    from worker.report.plot import save_loss_curve; save_loss_curve(results_dict, "run.png")

Top panel, a linear loss axis: the training loss (mean over the ranks of each --log-every
window), the held-out loss at every --eval-every evaluation and at the end, and where the
task has one, the planted model's loss as a horizontal line (synthetic and tables: labels
drawn from a planted logit, so its loss is the best any model can do on those samples;
dlrm's synthetic generator: its planted log loss). Bottom panel, when the task has one:
its metric over the evaluations (AUC for synthetic, tables and dlrm, MRR for kge), with
the planted model's AUC as a line. When training ended by restoring the best evaluated model
(kge's --keep-best: results["hooks"]["restored_best"]), the final evaluation is of that
model, not of the last step's: it is drawn as separate "final" markers, not joined to the
curve, and the best evaluation is marked with a star saying it was restored. Steps are
numbered from 0 on the axis and in the labels, as in the run's log lines, checkpoints, results
JSON and summary (a point at step s: after step s). matplotlib with the Agg backend (no
display), imported only when a plot is made.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.config.output_paths import plot_path

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LOSS_KEYS = ("loss", "log_loss")  # the held-out loss, by task
PLANTED_LOSS_KEYS = ("planted_loss", "planted_log_loss")
TRAIN_COLOR, EVAL_COLOR, PLANTED_COLOR = "tab:blue", "tab:orange", "tab:gray"
METRIC_COLORS = ("tab:green", "tab:red", "tab:purple", "tab:brown")


def metric_keys(results: Mapping[str, Any]) -> list[str]:
    """The task's quality metrics present in the run: AUC / MRR keys, planted ones aside."""
    names: list[str] = []
    for _, metrics in _eval_points(results):
        names += [k for k in metrics if k not in names]
    names += [k for k in (results.get("eval") or {}) if k not in names]
    return [k for k in names if ("auc" in k or k.endswith("mrr")) and not k.startswith("planted")]


def end_step(results: Mapping[str, Any]) -> int:
    """The step training ended after: the last step run (an early stop, a time budget)
    or, in older results without it, the last planned step."""
    last = results.get("last_step")
    return int(last) if last is not None else int(results.get("steps") or 0) - 1


def restored_best(results: Mapping[str, Any]) -> tuple[int, float] | None:
    """(step, valid MRR) of the best evaluation when training ended by restoring it (the
    final evaluation is then of that model), else None."""
    hooks = results.get("hooks") or {}
    if not hooks.get("restored_best") or hooks.get("best_valid_mrr") is None:
        return None
    return int(hooks["best_step"]), float(hooks["best_valid_mrr"])


def _eval_points(results: Mapping[str, Any], *, with_final: bool = True
                 ) -> list[tuple[int, Mapping[str, float]]]:
    """(step, metrics) of every evaluation: the --eval-every points, then the final one
    (merged into the last point when that is the final step: the same model). Without
    `with_final`, the evaluations during training only."""
    points = [(int(s), m) for s, m in results.get("eval_curve") or []]
    final = results.get("eval") or {}
    steps = end_step(results)
    if final and steps >= 0 and with_final:
        if points and points[-1][0] == steps:
            points[-1] = (steps, {**points[-1][1], **final})
        elif not points or points[-1][0] < steps:
            points.append((steps, final))
    return points


def build_figure(results: Mapping[str, Any]) -> Figure:
    """The figure (one or two panels, shared step axis), for saving or inspecting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = metric_keys(results)
    rows = 2 if metrics else 1
    fig, axes = plt.subplots(rows, 1, figsize=(7.5, 3.2 * rows + 0.6), dpi=110, sharex=True,
                             squeeze=False)
    loss_ax = axes[0][0]
    _loss_panel(loss_ax, results)
    if metrics:
        _metric_panel(axes[1][0], results, metrics)
    axes[-1][0].set_xlabel("step")
    cfg = results.get("config") or {}
    title = f"hybridps {cfg.get('task', '')}".strip()
    final = results.get("eval") or {}
    shown = [f"{k} {final[k]:.4f}" for k in metrics if isinstance(final.get(k), float)][:3]
    if shown:
        title += " — " + ", ".join(shown)
    loss_ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _plain_axis(ax: Axes) -> None:
    """Linear y axis with plain tick labels: no offset or x10^n notation."""
    from matplotlib.ticker import ScalarFormatter

    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    ax.yaxis.set_major_formatter(formatter)
    ax.set_yscale("linear")
    ax.grid(alpha=0.3)


def _loss_panel(ax: Axes, results: Mapping[str, Any]) -> None:
    loss = results.get("loss_curve") or []
    if loss:
        ax.plot([int(s) for s, _ in loss], [v for _, v in loss], color=TRAIN_COLOR,
                linewidth=1.2, label="train loss")
    key = next((k for k in LOSS_KEYS if any(k in m for _, m in _eval_points(results))), None)
    if key is not None:
        points = [(s, m[key]) for s, m in _eval_points(results) if key in m]
        ax.plot([s for s, _ in points], [v for _, v in points], color=EVAL_COLOR, marker="o",
                markersize=3.5, linewidth=1.2, label=f"held-out {key.replace('_', ' ')}")
    final = results.get("eval") or {}
    planted = next((final[k] for k in PLANTED_LOSS_KEYS if k in final), None)
    if planted is not None:
        ax.axhline(planted, color=PLANTED_COLOR, linestyle="--", linewidth=1.2,
                   label=f"planted model loss {planted:.4f}")
    ax.set_ylabel("loss")
    _plain_axis(ax)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8, framealpha=0.85)


def _metric_panel(ax: Axes, results: Mapping[str, Any], keys: Sequence[str]) -> None:
    best = restored_best(results)
    points = _eval_points(results, with_final=best is None)
    final = results.get("eval") or {}
    for i, key in enumerate(keys[:len(METRIC_COLORS)]):
        label = "held-out AUC" if key == "auc" else key.replace("_", " ")
        xy = [(s, m[key]) for s, m in points if key in m]
        if xy:
            ax.plot([s for s, _ in xy], [v for _, v in xy], color=METRIC_COLORS[i],
                    marker="o", markersize=3.5, linewidth=1.2, label=label)
        if best is not None and key in final:  # the restored model's: not on the curve
            ax.plot([end_step(results)], [final[key]], color=METRIC_COLORS[i], marker="D",
                    markersize=5, linestyle="none",
                    label=f"{label}, final: the best model (step {best[0]}) restored")
    if best is not None:
        ax.plot([best[0]], [best[1]], color="black", marker="*", markersize=11,
                linestyle="none",
                label=f"best valid mrr {best[1]:.4f} at step {best[0]}: restored at the end")
    if "planted_auc" in final:
        ax.axhline(final["planted_auc"], color=PLANTED_COLOR, linestyle="--", linewidth=1.2,
                   label=f"planted model AUC {final['planted_auc']:.4f}")
    ax.set_ylabel("AUC" if all("auc" in k for k in keys) else
                  "MRR" if all("mrr" in k for k in keys) else "held-out metric")
    _plain_axis(ax)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.85)


def save_loss_curve(results: Mapping[str, Any], path: str | Path) -> str:
    """Write the run's figure (build_figure) as a PNG; returns the path."""
    import matplotlib.pyplot as plt

    fig = build_figure(results)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2):
        print("usage: python -m worker.report.plot RESULTS.json [OUT.png]", file=sys.stderr)
        return 2
    results = json.loads(Path(args[0]).read_text())
    out = args[1] if len(args) == 2 else plot_path(args[0])
    print(save_loss_curve(results, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
