"""What the stages of gpu_check/check.py share: where a stage writes its figures, the
device, the sizes of a dry run, and a trainer run in this process.

A stage runs as `python gpu_check/gpu_stages.py STAGE --work DIR [--dry-run]` (gpu_check/
is sys.path[0]) and writes DIR/STAGE.json after every figure it gets, so a stage stopped at
its time limit still hands back what it measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# the benchmarks' shard server (bench/harness.py: Server), after everything else
if str(REPO / "bench") not in sys.path:
    sys.path.append(str(REPO / "bench"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class StageReport:
    """A stage's figures, written to `path` (JSON) after every change."""

    def __init__(self, path: Path, dry_run: bool) -> None:
        self.path, self.dry_run = path, dry_run
        self.data: dict[str, Any] = {"ok": None, "error": None, "figures": {},
                                     "dry_run": dry_run}
        self._write()

    @property
    def figures(self) -> dict[str, Any]:
        return self.data["figures"]  # type: ignore[no-any-return]

    def set(self, **figures: Any) -> None:
        self.figures.update(figures)
        self._write()

    def finish(self, ok: bool, error: str | None = None) -> None:
        self.data["ok"], self.data["error"] = ok, error
        self._write()

    @contextmanager
    def failing_on_error(self) -> Iterator[None]:
        """The block's exception becomes the stage's error (ok: false), its traceback on
        stderr (the stage's log)."""
        try:
            yield
        except BaseException as exc:
            traceback.print_exc()
            self.finish(False, f"{type(exc).__name__}: {exc}"[:2000])
            raise SystemExit(1) from None

    @staticmethod
    def load(path: Path) -> dict[str, Any]:
        """A stage's JSON as written so far ({} when it wrote none)."""
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return data

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def pick_device(dry_run: bool) -> Any:
    """cuda:0, or the CPU in a dry run (even where CUDA is there)."""
    import torch

    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available to this python (torch "
                           f"{torch.__version__}, built for CUDA {torch.version.cuda}); "
                           "run with --dry-run to check the stages on the CPU")
    return torch.device("cuda", 0)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without HYBRIDPS_* and torchrun's variables, unbuffered."""
    skip = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HYBRIDPS_") and k not in skip}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
