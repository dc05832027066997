"""Checkpoints written in the background (--checkpoint-async: worker/checkpoint/writer.py).

In process: what a snapshot holds is a copy (the step loop may change the state at once),
one write is in flight at a time, a failed write is raised at the next wait, the manifest
appears only once every part's files are written, and a stop's checkpoint is complete when
`save_on_stop` returns. End to end (2 gloo ranks, --local-optimizer, --staleness 1): a run
resumed from background-written checkpoints is bitwise the synchronous run straight
through; a rank killed while a background write is in progress (the step loop two steps
further) leaves the previous checkpoint the newest complete one, and the resume from it
is bitwise too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hybridps.checkpoint import FileEntry, Manifest, complete_checkpoints, step_dir
from tests.testing.helpers import REPO
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.parts import CheckpointPart, ManifestDraft
from worker.checkpoint.writer import AsyncWriter, Stage, Written
from worker.config.train_config import TrainConfig
from worker.runtime.faults import FAULT_ENV, KILL_ENV

# -- the writer ---------------------------------------------------------------------------


def test_a_snapshot_holds_copies_and_reuses_its_buffers() -> None:
    writer = AsyncWriter(world_size=1)
    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    ids = np.arange(5)
    stage = writer.stage()
    held = stage.hold({"rows": rows[1:3], "ids": ids, "n": 7, "pair": (rows, [ids])})
    rows.add_(100.0)  # the step loop goes on
    ids += 100
    assert torch.equal(held["rows"], torch.arange(3, 9, dtype=torch.float32).reshape(2, 3))
    assert held["ids"].tolist() == [0, 1, 2, 3, 4] and held["n"] == 7
    assert held["pair"][0][0, 0] == 0.0 and held["pair"][1][0][0] == 0
    seen: list[torch.Tensor] = []
    writer.submit(lambda: seen.append(held["rows"]))
    writer.wait()
    assert writer.snapshot_bytes == 2 * 3 * 4 + 4 * 3 * 4 + 2 * ids.nbytes
    again = writer.stage().hold(rows[1:3])  # the same shape: the previous buffer, refilled
    assert again.data_ptr() == seen[0].data_ptr()
    assert torch.equal(again, rows[1:3])
    writer.close()


def test_one_write_in_flight_and_its_error_at_the_next_wait() -> None:
    writer = AsyncWriter(world_size=1)
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        release.wait(10)
        order.append("first")

    writer.stage()
    writer.submit(first)
    assert writer.thread is not None and writer.thread.is_alive()  # submit returned
    threading.Timer(0.2, release.set).start()
    writer.stage()  # waits for the first
    assert order == ["first"]

    def broken() -> None:
        raise OSError("disk full")

    writer.submit(broken)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.close()  # the error was handed over once


# -- the checkpointer with a writer in the background --------------------------------------

class Slow:
    """A part whose write waits for `release` (a background write in progress)."""

    name = "rows"

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.value = torch.zeros(3)

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        held = stage.hold(self.value)

        def write() -> Any:
            assert self.release.wait(20)
            return held.tolist()

        return stage.write(write)

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        draft.table("t", 3, 1)
        draft.shard("t", 0, 0, 3, {"rows": FileEntry(f"rows/{saved_by_rank[0]}")})

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        return None

    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        return None


def _checkpointer(tmp_path: Path, parts: Sequence[CheckpointPart]) -> Checkpointer:
    cfg = TrainConfig.of(checkpoint_dir=str(tmp_path), checkpoint_every=5, batch_size=4,
                         local_optimizer=True, checkpoint_async=True)
    ctx = SimpleNamespace(rank=0, world_size=1)
    checkpointer = Checkpointer(cfg, ctx, run_id="run-x", sparse_spec=None)  # type: ignore[arg-type]
    checkpointer.attach(parts)
    return checkpointer


def test_the_manifest_comes_after_the_background_write(tmp_path: Path) -> None:
    release = threading.Event()
    part = Slow(release)
    checkpointer = _checkpointer(tmp_path, [part])
    directory = checkpointer.save(4)  # returns with the write in progress
    part.value += 1.0  # the next step changes the state
    time.sleep(0.2)
    assert not (directory / "manifest.json").exists()
    assert complete_checkpoints(tmp_path) == []
    release.set()
    checkpointer.wait()
    saved = Manifest.read(directory).tables["t"].shards[0].files["rows"].file
    assert saved == "rows/[0.0, 0.0, 0.0]"  # the state of step 4, not the changed one
    assert checkpointer.saved_step == 4 and len(checkpointer.save_s) == 1
    assert checkpointer.stall_s[0] < checkpointer.save_s[0]


def test_the_stop_checkpoint_is_complete_when_save_on_stop_returns(tmp_path: Path) -> None:
    release = threading.Event()
    checkpointer = _checkpointer(tmp_path, [Slow(release)])
    threading.Timer(0.3, release.set).start()
    directory = checkpointer.save_on_stop(7)
    assert directory is not None and (directory / "manifest.json").exists()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [7]


# -- end to end ---------------------------------------------------------------------------

COMMON = ["--num-rows", "2000", "--dim", "8", "--log-every", "5", "--eval-batches", "1",
          "--progress", "false", "--staleness", "1", "--local-optimizer",
          "--checkpoint-every", "5"]


def _run(tmp_path: Path, name: str, args: list[str], *, nproc: int = 2,
         env: dict[str, str] | None = None, expect: int = 0) -> Path:
    out = tmp_path / f"{name}.pt"
    main = str(REPO / "worker" / "main.py")
    batch = ["--batch-size", str(96 // nproc)]
    cmd = ([sys.executable, "-m", "worker.main"] if nproc == 1 else
           [str(Path(sys.executable).with_name("torchrun")), "--standalone",
            "--nproc_per_node", str(nproc), main])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    proc = subprocess.run([*cmd, *COMMON, *batch, *args, "--dump-state", str(out)], cwd=REPO,
                          env={**clean, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == expect, f"exit {proc.returncode}:\n{proc.stderr[-6000:]}"
    return out


def _same(a: Path, b: Path) -> None:
    x, y = torch.load(a), torch.load(b)
    for part in ("tables", "dense"):
        assert set(x[part]) == set(y[part])
        for key in x[part]:
            assert torch.equal(x[part][key], y[part][key]), f"{part} {key} differs"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """15 steps, checkpoints written synchronously."""
    d = tmp_path_factory.mktemp("straight")
    return _run(d, "straight", ["--steps", "15", "--checkpoint-async", "false",
                                "--checkpoint-dir", str(d / "ck")])


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_resume_from_background_checkpoints_is_bitwise(tmp_path: Path, straight: Path) -> None:
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-async", "true"]
    _run(tmp_path, "first", ["--steps", "10", *ck])
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")] == [4, 9]
    resumed = _run(tmp_path, "resumed", ["--steps", "15", "--resume", *ck])
    _same(straight, resumed)


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(
        tmp_path: Path) -> None:
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-async", "true"]
    # step 9's write sleeps in the background; the step loop goes on to step 11: killed
    _run(tmp_path, "killed", ["--steps", "15", *ck], nproc=1, expect=-signal.SIGKILL,
         env={FAULT_ENV: "9:rows:sleep=60", KILL_ENV: "0:11"})
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")] == [4]
    assert step_dir(tmp_path / "ck", 9).exists()  # torn: no manifest
    resumed = _run(tmp_path, "resumed", ["--steps", "15", "--resume", *ck], nproc=1)
    _same(_run(tmp_path, "straight1", ["--steps", "15", "--checkpoint-async", "false",
                                       "--checkpoint-dir", str(tmp_path / "ck1")], nproc=1),
          resumed)
