"""The same-node arena sized from the run's own pushes (worker/sync/arena.py size_arena,
Task.rows_pushed_per_step): K+3 steps of them, at least 64 MiB, within /dev/shm's room; an
explicit --same-node-mb that holds fewer steps warns with the size that would. End to end:
KGE 1vsAll pushes every owned row every step, and with pushes of ~18 MB a rank the old
64 MiB default overflows (pushes go inline) while the sized arena holds every push."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridps import arena_layout as layout
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import run
from worker.config.task_defaults import config_with_task_defaults
from worker.sync import arena as arena_client
from worker.sync.arena import AUTO_MIN_BYTES, arena_bytes_needed, region_bytes, size_arena
from worker.tasks.kge.hierarchy import write_hierarchy
from worker.tasks.kge.task import KGETask

MIB = 1 << 20


def test_needed_bytes_are_k_plus_3_steps_of_every_units_push() -> None:
    per_step = region_bytes(1000, 64) + region_bytes(10, 8)
    assert per_step == (1000 * 8 + 2 * 1000 * 64 * 4) + (128 + 2 * 10 * 8 * 4)  # aligned
    assert arena_bytes_needed([(1000, 64), (10, 8)], 1, torch.float32, torch.float32) == (
        layout.HEADER_BYTES + 4 * per_step)
    half = arena_bytes_needed([(1000, 64)], 0, torch.bfloat16, torch.float32)
    assert half == layout.HEADER_BYTES + 3 * region_bytes(1000, 64, torch.bfloat16)


def test_size_policy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    free = str(tmp_path)
    # the task cannot say: the flag, or 64 MiB
    assert size_arena(0, None, staleness=1, local_ranks=2, directory=free) == (AUTO_MIN_BYTES,
                                                                                None)
    assert size_arena(8 * MIB, None, staleness=1, local_ranks=2, directory=free) == (8 * MIB,
                                                                                     None)
    # sized: at least 64 MiB, else what the pushes need
    assert size_arena(0, 10 * MIB, staleness=1, local_ranks=2, directory=free)[0] == (
        AUTO_MIN_BYTES)
    assert size_arena(0, 300 * MIB, staleness=1, local_ranks=2, directory=free) == (300 * MIB,
                                                                                    None)
    # a given size is used as given; too small, it says the size that would hold them
    size, warning = size_arena(64 * MIB, 300 * MIB + 1, staleness=1, local_ranks=2,
                               directory=free)
    assert size == 64 * MIB and warning is not None
    assert "--same-node-mb 64 holds fewer than 4 steps" in warning
    assert "use --same-node-mb 301" in warning
    # no room in the directory: what there is, said in one line
    room = SimpleNamespace(f_bavail=100, f_frsize=MIB)  # 100 MiB free
    monkeypatch.setattr(arena_client.os, "statvfs", lambda _: room)
    size, warning = size_arena(0, 300 * MIB, staleness=1, local_ranks=2, directory="/dev/shm")
    assert size == int(100 * MIB * 0.8 / 2) and warning is not None
    assert "/dev/shm has room for 40 MiB a rank (2 ranks)" in warning


def test_kge_pushes_every_owned_row_with_1vsall(tmp_path: Path) -> None:
    graph = tmp_path / "g"
    write_hierarchy(graph, 1001, seed=3, held_out=5)
    cfg = config_with_task_defaults(task="kge", data_dir=str(graph), local_optimizer=True,
                                    training="1vsall", batch_size=4, neg_ratio=3)
    task = KGETask(cfg)
    assert task.rows_pushed_per_step(2) == {"entity": math.ceil(task.num_entities / 2)}
    neg = KGETask(config_with_task_defaults(task="kge", data_dir=str(graph), batch_size=4,
                                            local_optimizer=True, training="negsample",
                                            neg_ratio=3))
    assert neg.rows_pushed_per_step(2) == {"entity": 2 * 4 * (2 + 3)}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.isdir(layout.SHM_DIR), reason="no /dev/shm")
def test_kge_pushes_overflow_64_mib_and_the_sized_arena_holds_them(
        server: PsServer, tmp_path: Path) -> None:
    graph = tmp_path / "g"
    # 4,500 rows a rank at dim 512: 18.5 MB a push; at K = 2 four are live at once (74 MB)
    write_hierarchy(graph, 9000, seed=3, held_out=10)
    common = ["--ps", server.address, "--task", "kge", "--data-dir", str(graph),
              "--training", "1vsall", "--model", "distmult", "--dim", "512", "--steps", "6",
              "--batch-size", "8", "--staleness", "2", "--eval-test", "false",
              "--keep-best", "false"]
    old = tmp_path / "old.json"
    proc = run([*common, "--run-id", "mib64", "--same-node-mb", "64", "--results", str(old)])
    sync = json.loads(old.read_text())["sync"]
    assert sync["shm"] == "on" and sync["shm_inline_pushes"] > 0  # the old default overflows
    warned = [x for x in proc.stderr.splitlines() if "event=same_node_arena" in x]
    assert len(warned) == 1 and "--same-node-mb 64 holds fewer than 5 steps" in warned[0]
    sized = tmp_path / "sized.json"
    proc = run([*common, "--run-id", "sized", "--results", str(sized)])  # --same-node-mb 0
    sync = json.loads(sized.read_text())["sync"]
    assert sync["shm"] == "on" and sync["shm_inline_pushes"] == 0
    assert sync["shm_pushes"] == sync["pushes"] > 0
    assert "event=same_node_arena" not in proc.stderr and "shm_full" not in proc.stderr
