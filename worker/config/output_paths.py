"""Every path a run writes, checked before the first step: each problem one line naming the
flag, the path and what to do (a run that trains for an hour must not fail at its end
because --results names a directory).

The paths: --results and what is written next to it (the loss plot run.png; --task kge's
id maps run.id_maps/), --dump-state, --tensorboard, and --checkpoint-dir, whose entries
named like a step directory (step-<s>) must be directories. Rank 0 alone writes the
results, the state dump and TensorBoard's files, so the other ranks (possibly on other
hosts) check only the checkpoint directory. The kernel's word on writing is os.access:
as root it passes where only a read-only file system would refuse.

No torch import (worker/config/preflight.py runs this in the launcher and before a rank's torch
imports).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hybridps.path_checks import directory_problem, file_problem
from hybridps.step_dirs import STEP_DIR as STEP_DIR_NAME

if TYPE_CHECKING:
    from worker.config.train_config import TrainConfig

ID_MAPS_SUFFIX = ".id_maps"  # run.json -> run.id_maps/ (worker/tasks/kge/task.py writes there)


def plot_path(results_path: str | Path) -> str:
    """The PNG next to a results file: run.json -> run.png (worker/report/plot.py draws it)."""
    return str(Path(results_path).with_suffix(".png"))


def id_maps_path(results: str) -> str:
    """Where --task kge writes its id maps next to --results (run.json -> run.id_maps)."""
    p = Path(results)
    return str(p.with_name(p.stem + ID_MAPS_SUFFIX))


def step_entries_problem(directory: str) -> str | None:
    """An entry of the checkpoint directory named like a step directory that is not one
    (a file, a link): the checkpoint of that step, or a resume, would fail on it."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return None  # missing (created later) or unreadable (directory_problem said so)
    for entry in entries:
        if STEP_DIR_NAME.match(entry.name) and not entry.is_dir(follow_symlinks=False):
            kind = "a symbolic link" if entry.is_symlink() else "a file"
            return (f"--checkpoint-dir {directory!r} holds {entry.name!r}, which is {kind}, "
                    "not a step directory: move it away or give another --checkpoint-dir")
    return None


def _checks(cfg: TrainConfig, rank0: bool) -> Iterator[str | None]:
    ckpt = cfg.checkpoint.checkpoint_dir
    if ckpt:
        yield directory_problem("--checkpoint-dir", ckpt)
        yield step_entries_problem(ckpt)
    if not rank0:
        return
    out = cfg.output
    if out.results:
        yield file_problem("--results", out.results)
        yield file_problem("--results", plot_path(out.results), "its loss plot")
        if cfg.run.task == "kge":
            yield directory_problem("--results", id_maps_path(out.results), "its id maps")
    if out.dump_state:
        yield file_problem("--dump-state", out.dump_state, example="state.pt")
    if out.tensorboard:
        yield directory_problem("--tensorboard", out.tensorboard)


def output_problem(cfg: TrainConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The first problem of the paths this rank writes (module doc); None when none.
    Outside a rank (the launcher: no RANK) every path is checked."""
    if cfg.sizing.plan:  # --plan writes nothing
        return None
    rank0 = (environ.get("RANK", "0") or "0") == "0"
    return next((found for found in _checks(cfg, rank0) if found is not None), None)
