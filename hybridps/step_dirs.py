"""How a checkpoint's step directory is named (`step-<s>`, zero-padded): no torch import,
so the worker's pre-check of the paths a run writes (before any torch import) reads the
same rule that hybridps/checkpoint.py writes and finds checkpoints by."""

from __future__ import annotations

import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:010d}"
