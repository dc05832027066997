"""Read a checkpoint's optimizer state as a restore sees it: an incremental link composed
with its chain, so a test can compare it with a full checkpoint's file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridps.checkpoint import OptimState, load_optim_state


def composed_like(directory: Path, step: int, full_shard: dict[str, Any],
                  master: bool = False) -> OptimState:
    """The optimizer state at checkpoint `directory` (step `step`, a full checkpoint or a
    chain's link) of the rows a full checkpoint's shard `full_shard` (read_shard) holds,
    for the optimizer that shard records."""
    return load_optim_state(directory, table=full_shard["table"],
                            num_rows=full_shard["num_rows"], dim=full_shard["dim"],
                            row_start=full_shard["row_start"], row_end=full_shard["row_end"],
                            step=step, optimizer=full_shard["meta"]["optimizer"],
                            master=master)
