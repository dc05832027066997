"""Loss curve (and the --eval-every metrics) of a run as a PNG next to its --results JSON.

    python -m worker.plot results.json            # writes results.png
    from worker.plot import save_loss_curve; save_loss_curve(results_dict, "run.png")

matplotlib with the Agg backend (no display needed); imported lazily so the worker only
pays for it when --results is given.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def plot_path(results_path: str | Path) -> str:
    """The PNG next to a results file: run.json -> run.png."""
    return str(Path(results_path).with_suffix(".png"))


def save_loss_curve(results: Mapping[str, Any], path: str | Path) -> str:
    """Training loss vs step (left axis) and the eval metrics vs step (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = results.get("loss_curve") or []
    evals: Sequence[tuple[int, Mapping[str, float]]] = results.get("eval_curve") or []
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if loss:
        steps, values = zip(*loss, strict=True)
        ax.plot([s + 1 for s in steps], values, color="tab:blue", label="train loss")
    if loss and min(v for _, v in loss) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (mean over ranks)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if evals:
        ax2 = ax.twinx()
        colors = ["tab:orange", "tab:green", "tab:red", "tab:purple"]
        for i, key in enumerate(evals[0][1]):
            xs = [s + 1 for s, m in evals if key in m]
            ys = [m[key] for s, m in evals if key in m]
            ax2.plot(xs, ys, marker="o", linestyle="--", label=key,
                     color=colors[i % len(colors)])
        ax2.set_ylabel("held-out metric")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    cfg = results.get("config") or {}
    title = f"hybridps {cfg.get('task', '')}".strip()
    ev = results.get("eval") or {}
    shown = [f"{k} {v:.4f}" for k, v in ev.items()
             if isinstance(v, float) and any(m in k for m in ("mrr", "auc"))][:3]
    if shown:
        title += " — " + ", ".join(shown)
    ax.set_title(title, fontsize=10)
    if handles:
        ax.legend(handles, labels, loc="center right", fontsize=8, framealpha=0.8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (1, 2):
        print("usage: python -m worker.plot RESULTS.json [OUT.png]", file=sys.stderr)
        return 2
    results = json.loads(Path(args[0]).read_text())
    out = args[1] if len(args) == 2 else plot_path(args[0])
    print(save_loss_curve(results, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
