"""What rank 0 shows on the console: the progress bar's fields, log lines routed around the
bar, and the checkpoint entries of the end-of-run summary.

The bar fits the terminal (COLUMNS, else the terminal's width as tqdm reads it): its
fields are shown most useful first (the train loss, the headline evaluation, speed,
staleness, then the other metrics) while the whole line fits with a bar of at least ten
characters; the fields left out go to a `progress` log line every PROGRESS_LINE_EVERY
updates of the bar (every field when the bar is off: `--progress false`).

Log records written while the bar is on screen go through tqdm.write (tqdm's
logging_redirect_tqdm): the bar is cleared, the line printed, the bar redrawn, so a log
line never lands inside the bar. Other processes (other ranks, a shard server sharing
the terminal) cannot be coordinated that way; the worker's `--log-level auto` keeps them
quiet on a terminal (hybridps/logs.py). A run that stops before its planned steps (early
stopping, a time budget, SIGTERM) ends its bar at the step it stopped after, saying why.

Steps are numbered from 0 everywhere a step is named (log lines, checkpoints, the results
JSON, the summary, the plot, the export): `steps 1000` counts them, steps 0..999. The
summary's lines are cut between fields to fit the terminal (hybridps/wrap.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from tqdm.utils import disp_len

from hybridps.logs import kv
from hybridps.wrap import wrap_report

BAR_KEYS = ("loss", "sps", "stale", "lag", "waits")
RUN_KEYS = ("sps", "stale", "lag", "waits")
# evaluation metrics shown right after the train loss; the others come after RUN_KEYS
HEADLINE_METRICS = ("eval_loss", "auc", "valid_mrr", "test_mrr", "mrr")
MAX_CHECKPOINT_LINES = 10
BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
              "[{elapsed}<{remaining}{postfix}]")
PROGRESS_LINE_EVERY = 10  # bar updates (--log-every steps each) between `progress` lines
# columns kept free: the fields are chosen again at each update (--log-every steps), and
# tqdm cuts a line that outgrew the width in between (its times at the hour: "1:00:00")
TIME_MARGIN = 1

log = logging.getLogger("worker.console")


def route_logs_around(bar: tqdm) -> contextlib.AbstractContextManager[Any]:
    """While the bar shows, console log records go through tqdm.write (root logger)."""
    if bar.disable:
        return contextlib.nullcontext()
    return logging_redirect_tqdm()


def bar_postfix(loss: float, evals: Mapping[str, float], samples_per_s: float, stale: int,
                lag: float, waits: int) -> dict[str, str]:
    """The bar's fields, most useful first: the train loss, the headline evaluation metrics
    (`eval_loss` when a metric shares a name with a bar field; the planted model's, a
    constant, left out), speed and staleness, then the other evaluation metrics."""
    metrics = {(f"eval_{k}" if k in BAR_KEYS else k): f"{v:.4f}" for k, v in evals.items()
               if not k.startswith("planted")}
    out = {"loss": f"{loss:.4f}"}
    out.update({k: metrics[k] for k in HEADLINE_METRICS if k in metrics})
    out.update(sps=f"{samples_per_s:.0f}", stale=str(stale), lag=f"{lag:.2f}",
               waits=str(waits))
    out.update({k: v for k, v in metrics.items() if k not in HEADLINE_METRICS})
    return out


def postfix_text(fields: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def bar_layout() -> dict[str, Any]:
    """tqdm's layout options: the width (COLUMNS when set, else the terminal's, read at each
    redraw) and the format, without tqdm's steps/s (the `sps` field says the speed)."""
    env = os.environ.get("COLUMNS", "")
    width: dict[str, Any] = ({"ncols": int(env)} if env.isdigit() and int(env) > 0
                             else {"dynamic_ncols": True})
    return {**width, "bar_format": BAR_FORMAT}


def terminal_columns(bar: tqdm) -> int | None:
    """The width the bar must fit: COLUMNS when set, else what tqdm measured (None: no
    terminal and no COLUMNS, so no limit)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    ncols = bar.format_dict.get("ncols")
    return int(ncols) if ncols else None


def fit_fields(bar: tqdm, fields: Mapping[str, str], width: int | None
               ) -> tuple[dict[str, str], dict[str, str]]:
    """(shown, left out): the longest prefix of the fields that fits on one line of `width`
    columns with the bar's other parts and a bar of at least ten characters."""
    if width is None:
        return dict(fields), {}
    meter = dict(bar.format_dict)
    meter["ncols"] = None  # unbounded: the bar is drawn 10 characters wide

    def length(shown: Mapping[str, str]) -> int:
        return disp_len(bar.format_meter(**{**meter, "postfix": postfix_text(shown)}))

    shown: dict[str, str] = {}
    for key, value in fields.items():  # the most useful first: stop at the first too long
        if length({**shown, key: value}) + TIME_MARGIN > width:
            break
        shown[key] = value
    return shown, {k: v for k, v in fields.items() if k not in shown}


def show_progress(bar: tqdm, fields: Mapping[str, str], *, step: int, update: int) -> None:
    """Put the fields that fit on the bar; every PROGRESS_LINE_EVERY-th `update`, log the
    others (all of them when the bar is off) as one `progress` line."""
    shown: dict[str, str]
    if bar.disable:
        shown, left = {}, dict(fields)
    else:
        shown, left = fit_fields(bar, fields, terminal_columns(bar))
        bar.set_postfix_str(postfix_text(shown), refresh=False)
    if left and update % PROGRESS_LINE_EVERY == 0:
        log.info(kv("progress", step=step, **left))


def end_bar(bar: tqdm, reason: str, planned: int) -> None:
    """Training stopped before its `planned` steps: the bar ends full at the step it
    stopped after, its description saying why, instead of standing at a fraction."""
    if bar.disable:
        return
    bar.total = bar.n
    bar.set_description_str(f"train ({reason}; {planned} planned)", refresh=False)
    fields = dict(f.split("=", 1) for f in (bar.postfix or "").split(", ") if "=" in f)
    shown, _ = fit_fields(bar, fields, terminal_columns(bar))
    bar.set_postfix_str(postfix_text(shown), refresh=False)
    bar.refresh()


def summary_width() -> int | None:
    """The width the summary is wrapped to: COLUMNS when set, else the terminal's when
    standard output is one; None (no wrapping) for a file or a pipe, one line per item."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else None
    except (OSError, ValueError):  # no file descriptor (a captured stdout)
        return None


def wrap_summary(lines: Sequence[str], width: int | None) -> str:
    """The summary's lines cut between fields to fit `width` (None: as they are)."""
    return "\n".join(wrap_report(list(lines), width))


def run_extent(res: Mapping[str, Any]) -> str:
    """How far training went: `steps N` when every planned step ran, else the step it
    stopped after (from 0, as the logs and checkpoints number them) and why; an early stop
    names the best evaluated step (restored: the model reported and exported is its)."""
    planned = int(res["steps"])
    last = res.get("last_step")
    if last is None or int(last) + 1 >= planned or int(last) < 0:
        return f"steps {planned}"
    last = int(last)
    hooks = res.get("hooks") or {}
    ran = f"{last + 1} of {planned} steps"
    if not hooks.get("stopped_early"):
        return f"stopped after step {last} ({ran})"
    best = hooks.get("best_step")
    if best is None or int(best) < 0:
        return f"stopped early after step {last} ({ran})"
    restored = ", restored" if hooks.get("restored_best") else ""
    return f"stopped early after step {last} ({ran}; best step {best}{restored})"


def optimizer_line(res: Mapping[str, Any]) -> str:
    """The optimizers: the rows' (kind, lr, weight decay when set) and the dense part's."""
    opt = res.get("optimizer") or {}

    def one(o: Mapping[str, Any]) -> str:
        decay = float(o.get("weight_decay") or 0.0)
        return f"{o['kind']} lr {float(o['lr']):g}" + (f" weight_decay {decay:g}" if decay
                                                       else "")

    parts = [f"optimizer {one(opt['rows'])}"] if "rows" in opt else []
    if "dense" in opt:
        parts.append(f"dense {one(opt['dense'])}")
    return "  ".join(parts)


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path` (what a checkpoint occupies, as this process sees it)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def checkpoint_entry(step: int, path: Path, seconds: float) -> dict[str, Any]:
    """One written checkpoint, for the log line, the summary and the results JSON."""
    return {"step": step, "path": str(path), "bytes": directory_bytes(path),
            "seconds": round(seconds, 3)}


def checkpoint_lines(written: Sequence[Mapping[str, Any]]) -> list[str]:
    """The summary's lines for the checkpoints written (the first ten, then a count)."""
    if not written:
        return []
    total = sum(int(w["bytes"]) for w in written)
    lines = [f"checkpoints: {len(written)} written ({human_bytes(total)}, "
             f"{sum(float(w['seconds']) for w in written):.2f}s)"]
    for w in written[:MAX_CHECKPOINT_LINES]:
        lines.append(f"  step {w['step']}: {w['path']}  {human_bytes(int(w['bytes']))}  "
                     f"{float(w['seconds']):.2f}s")
    if len(written) > MAX_CHECKPOINT_LINES:
        lines.append(f"  ... {len(written) - MAX_CHECKPOINT_LINES} more (all in the results "
                     "JSON, checkpoint.written)")
    return lines
