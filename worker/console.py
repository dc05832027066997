"""What rank 0 shows on the console: the progress bar's fields, log lines routed around the
bar, and the checkpoint entries of the end-of-run summary.

Log records written while the bar is on screen go through tqdm.write (tqdm's
logging_redirect_tqdm): the bar is cleared, the line printed, the bar redrawn, so a log
line never lands inside the bar. Other processes (other ranks, a shard server sharing
the terminal) cannot be coordinated that way; the worker's `--log-level auto` keeps them
quiet on a terminal (hybridps/logs.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

BAR_KEYS = ("loss", "sps", "stale", "lag", "waits")
MAX_CHECKPOINT_LINES = 10


def route_logs_around(bar: tqdm) -> contextlib.AbstractContextManager[Any]:
    """While the bar shows, console log records go through tqdm.write (root logger)."""
    if bar.disable:
        return contextlib.nullcontext()
    return logging_redirect_tqdm()


def bar_postfix(loss: float, evals: Mapping[str, float], samples_per_s: float, stale: int,
                lag: float, waits: int) -> dict[str, str]:
    """The bar's fields: the train loss first, then the latest eval metrics (`eval_loss` when
    a metric shares a name with a bar field; the planted model's, a constant, left out),
    speed and staleness."""
    out = {"loss": f"{loss:.4f}"}
    out.update({(f"eval_{k}" if k in BAR_KEYS else k): f"{v:.4f}" for k, v in evals.items()
                if not k.startswith("planted")})
    out.update(sps=f"{samples_per_s:.0f}", stale=str(stale), lag=f"{lag:.2f}",
               waits=str(waits))
    return out


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
