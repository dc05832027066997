"""Checkpoint parts (worker/checkpoint/parts.py): the manifest's `parts`, the draft the parts
record into, the Checkpointer's sequence over parts, and the data position's part (a task
that keeps a reading position: unit, and end to end across a resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hybridps.checkpoint import (
    FileEntry,
    Manifest,
    ManifestShard,
    ManifestTable,
    PartEntry,
    ShardInfo,
    read_manifest,
    step_dir,
    verify_files,
    write_manifest,
)
from hybridps.dynamic import DynamicSpec
from hybridps.errors import CorruptCheckpoint
from hybridps.optim import OptimizerSpec
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.data import DataPart, data_file
from worker.checkpoint.parts import CheckpointPart, ManifestDraft
from worker.checkpoint.source import SourcePart
from worker.checkpoint.tables import TablesPart
from worker.checkpoint.writer import Stage, SyncWriter, Written
from worker.config.train_config import TrainConfig
from worker.config.update_kinds import kind_named
from worker.tasks.base import Batch, HybridModel, TableConfig, Task

REPO = Path(__file__).resolve().parents[3]


# -- the manifest's parts ---------------------------------------------------------------

def _manifest(**fields: Any) -> Manifest:
    return Manifest(step=9, tables={"t": ManifestTable(4, 2, ())}, world_size=2, **fields)


def test_a_manifest_without_parts_still_loads(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"step": 9, "tables": {}, "world_size": 1})  # older code
    manifest = Manifest.read(tmp_path)
    assert manifest.parts == () and manifest.part("data") is None
    assert "parts" not in manifest.as_dict()  # and none is written back


def test_parts_round_trip(tmp_path: Path) -> None:
    parts = (PartEntry("tables"), PartEntry("data", ((1, FileEntry("data/r00001.pt", 5,
                                                                   "0000abcd")),)))
    _manifest(parts=parts).write(tmp_path)
    manifest = Manifest.read(tmp_path)
    assert manifest.parts == parts
    assert manifest.part("data") == parts[1]
    assert read_manifest(tmp_path)["parts"][1] == {
        "name": "data", "files": [{"rank": 1, "file": "data/r00001.pt", "bytes": 5,
                                   "crc32": "0000abcd"}]}


@pytest.mark.parametrize("parts", [
    {"name": "data"},                                   # not a list
    [{"files": []}],                                    # no name
    [{"name": "", "files": []}],                        # an empty name
    [{"name": "data", "files": "data/r00000.pt"}],      # files not a list
    [{"name": "data", "files": [{"file": "x"}]}],       # a file without its rank
    [{"name": "data"}, {"name": "data"}],               # a part twice
])
def test_malformed_parts_are_corrupt(tmp_path: Path, parts: Any) -> None:
    write_manifest(tmp_path, {"step": 9, "tables": {}, "parts": parts})
    with pytest.raises(CorruptCheckpoint, match="malformed manifest"):
        Manifest.read(tmp_path)


def test_a_parts_own_files_are_verified(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "r00000.pt").write_bytes(b"position")
    entry = FileEntry("data/r00000.pt", 8, "00000000")  # a wrong crc32
    _manifest(parts=(PartEntry("data", ((0, entry),)),)).write(tmp_path)
    with pytest.raises(CorruptCheckpoint, match=r"r00000.pt has crc32 .* the manifest says"):
        verify_files(tmp_path, read_manifest(tmp_path))


# -- the draft ------------------------------------------------------------------------

def test_the_draft_joins_every_parts_files_into_the_shards() -> None:
    draft = ManifestDraft(step=4, world_size=2, run_id="r", task="x", seed=1)
    draft.table("t", 10, 2)
    for rank, (lo, hi) in enumerate([(0, 5), (5, 10)]):
        draft.shard_files("t", 1 - rank, {"optim": FileEntry(f"optim/t.r{1 - rank}")})
        draft.shard("t", rank, lo, hi, {"rows": FileEntry(f"rows/t.r{rank}")})
    draft.part("tables")
    draft.part("data", [(1, FileEntry("data/r00001.pt"))])
    draft.part("data", [(0, FileEntry("data/r00000.pt"))])
    manifest = draft.build()
    assert manifest.next_step == 5 and manifest.world_size == 2
    assert [(s.rank, s.row_start, s.row_end, sorted(s.files)) for s in
            manifest.tables["t"].shards] == [(0, 0, 5, ["optim", "rows"]),
                                             (1, 5, 10, ["optim", "rows"])]
    assert [p.name for p in manifest.parts] == ["tables", "data"]
    assert [r for r, _ in manifest.parts[1].files] == [1, 0]


def test_the_draft_refuses_files_of_a_shard_without_rows() -> None:
    draft = ManifestDraft(step=4, world_size=1, run_id="r", task="x", seed=1)
    draft.table("t", 10, 2)
    draft.shard_files("t", 0, {"ids": FileEntry("ids/t.r0")})
    with pytest.raises(ValueError, match=r"files of shards \[\('t', 0\)\] without a row range"):
        draft.build()


# -- the checkpointer's sequence ----------------------------------------------------------

class Recorder:
    """A part that records what the checkpointer asks of it in `log`."""

    def __init__(self, name: str, log: list[str], problem: str | None = None) -> None:
        self.name, self.log, self.problem = name, log, problem

    def snapshot(self, directory: Path, step: int, stage: Stage,
                 since: int | None = None) -> Written:
        self.log.append(f"snapshot {self.name} {step}")

        def write() -> Any:
            self.log.append(f"write {self.name}")
            return {"saved": self.name}

        return stage.write(write)

    def record(self, saved_by_rank: Sequence[Any], draft: ManifestDraft) -> None:
        self.log.append(f"record {self.name} {list(saved_by_rank)}")
        if self.name == "rows":
            draft.table("t", 3, 1)
            draft.shard("t", 0, 0, 3, {"rows": FileEntry("rows/t")})

    def verify(self, directory: Path, manifest: Manifest) -> str | None:
        self.log.append(f"verify {self.name}")
        return self.problem

    def restore(self, directory: Path, manifest: Manifest, step: int) -> None:
        self.log.append(f"restore {self.name} {step}")


def _checkpointer(tmp_path: Path, parts: Sequence[CheckpointPart],
                  asynchronous: bool = False) -> Checkpointer:
    cfg = TrainConfig.of(checkpoint_dir=str(tmp_path), checkpoint_every=5, batch_size=4,
                         local_optimizer=True, checkpoint_async=asynchronous)
    ctx = SimpleNamespace(rank=0, world_size=1)
    checkpointer = Checkpointer(cfg, ctx, run_id="run-x", sparse_spec=None)  # type: ignore[arg-type]
    checkpointer.attach(parts)
    return checkpointer


@pytest.mark.parametrize("asynchronous", [False, True])
def test_the_checkpointer_runs_the_parts_in_order(tmp_path: Path, asynchronous: bool) -> None:
    log: list[str] = []
    checkpointer = _checkpointer(tmp_path, [Recorder("rows", log), Recorder("other", log)],
                                 asynchronous)
    assert checkpointer.due(4) and not checkpointer.due(5)
    directory = checkpointer.save(4)
    checkpointer.wait()
    # synchronous: each part writes inside its snapshot; asynchronous: every snapshot
    # first, then the writes (in the background)
    writes = (["snapshot rows 4", "snapshot other 4", "write rows", "write other"]
              if asynchronous else
              ["snapshot rows 4", "write rows", "snapshot other 4", "write other"])
    assert log == [*writes, "record rows [{'saved': 'rows'}]",
                   "record other [{'saved': 'other'}]"]
    manifest = Manifest.read(directory)
    assert [p.name for p in manifest.parts] == ["rows", "other"]
    assert (manifest.step, manifest.run_id, manifest.tables["t"].num_rows) == (4, "run-x", 3)
    log.clear()
    checkpointer.restore_local(directory, 4)
    assert log == ["verify rows", "verify other", "restore rows 4", "restore other 4"]
    assert checkpointer.resumed_step == 4 and not checkpointer.due(4)


def test_a_part_that_cannot_use_the_checkpoint_stops_every_restore(tmp_path: Path) -> None:
    log: list[str] = []
    saving = _checkpointer(tmp_path, [Recorder("rows", log), Recorder("other", log)])
    directory = saving.save(4)
    log.clear()
    refusing = _checkpointer(tmp_path, [Recorder("rows", log),
                                        Recorder("other", log, problem="no good")])
    with pytest.raises(ValueError, match="no good"):
        refusing.restore_local(directory, 4)
    assert log == ["verify rows", "verify other"]  # nothing restored


def test_two_parts_of_one_name_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"name a part twice"):
        _checkpointer(tmp_path, [Recorder("rows", []), Recorder("rows", [])])


# -- the tables' and the source's parts ---------------------------------------------------

def test_the_tables_part_names_a_table_this_run_cannot_take(tmp_path: Path) -> None:
    dynamic = DynamicSpec()
    emb = SimpleNamespace(tables={"t": TableConfig("t", 4, 2), "u": TableConfig("u", 6, 2)})
    part = TablesPart(emb, "fp32")  # type: ignore[arg-type]
    saved = {"t": ManifestTable(4, 2, ()), "u": ManifestTable(6, 2, ())}
    assert part.verify(tmp_path, Manifest(step=1, tables=saved)) is None
    for tables, problem in [
            ({"t": saved["t"]}, "table 'u' is missing; this run has 6x2"),
            ({**saved, "u": ManifestTable(6, 3, ())}, "table 'u' is of another shape"),
            ({**saved, "u": ManifestTable(6, 2, (), {"dynamic": {}})},
             "table 'u' is dynamic there and not dynamic in this run")]:
        assert problem in str(part.verify(tmp_path, Manifest(step=1, tables=tables)))
    emb.tables["u"] = TableConfig("u", 6, 2, dynamic=dynamic)
    assert "table 'u' is not dynamic there and dynamic in this run" in str(
        part.verify(tmp_path, Manifest(step=1, tables=saved)))


def test_the_source_part_records_its_kind_and_optimizer() -> None:
    spec = OptimizerSpec(kind="adamw", lr=0.02)
    part = SourcePart(SimpleNamespace(), kind_named("local"), spec)  # type: ignore[arg-type]
    draft = ManifestDraft(step=4, world_size=1, run_id="r", task="x", seed=1)
    draft.shard("t", 0, 0, 3, {"rows": FileEntry("rows/t")})
    draft.table("t", 3, 1)
    part.record([{"t": {"optim": ShardInfo("t", 0, 0, 3, "optim/t", 9, "00000001")}}], draft)
    manifest = draft.build()
    assert manifest.mode == "local-optimizer" and manifest.optimizer["kind"] == "adamw"
    assert manifest.shards("t", "optim")[0].bytes == 9
    assert part.verify(Path("ck"), manifest) is None
    bare = Manifest(step=4, tables={"t": ManifestTable(3, 1, (ManifestShard(0, 0, 3, {}),))})
    assert "lists no optim file" in str(part.verify(Path("ck"), bare))


# -- the data position ------------------------------------------------------------------

class Position(Task):
    """Only the data position: `position` is saved; what a resume gets is in `loaded`."""

    def __init__(self, position: int | None) -> None:
        super().__init__(TrainConfig.of(batch_size=4, local_optimizer=True))
        self.position = position
        self.loaded: tuple[list[Any], int] | None = None

    def tables(self) -> list[TableConfig]:
        return []

    def build_dense(self) -> nn.Module:
        return nn.Identity()

    def global_batch(self, step: int, world_size: int) -> Batch:
        raise NotImplementedError

    def loss(self, model: HybridModel, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def data_state(self, next_step: int) -> dict[str, Any] | None:
        return None if self.position is None else {"offset": self.position,
                                                   "next": next_step}

    def load_data_state(self, states_by_rank: Sequence[dict[str, Any] | None],
                        next_step: int) -> None:
        self.loaded = (list(states_by_rank), next_step)


def _save_positions(directory: Path, positions: list[int | None], step: int) -> Manifest:
    world = len(positions)
    parts = [DataPart(Position(p), rank=r, world_size=world, batch_size=4)
             for r, p in enumerate(positions)]
    saved = [part.snapshot(directory, step, SyncWriter().stage()).result() for part in parts]
    draft = ManifestDraft(step=step, world_size=world, run_id="r", task="x", seed=0)
    parts[0].record(saved, draft)
    draft.build().write(directory)
    return Manifest.read(directory)


def test_the_data_part_hands_every_ranks_position_to_the_resume(tmp_path: Path) -> None:
    manifest = _save_positions(tmp_path, [70, None, 12], step=9)
    assert manifest.data == {"step": 9, "samples_seen": 10 * 4 * 3}
    entry = manifest.part("data")
    assert entry is not None
    assert [(r, f.file) for r, f in entry.files] == [(0, data_file(0)), (2, data_file(2))]
    verify_files(tmp_path, read_manifest(tmp_path))  # listed with size and crc32
    for world in (1, 2, 3):  # any world size gets them all, to re-split
        task = Position(None)
        part = DataPart(task, rank=0, world_size=world, batch_size=4)
        assert part.verify(tmp_path, manifest) is None
        part.restore(tmp_path, manifest, 9)
        assert task.loaded == ([{"offset": 70, "next": 10}, None,
                                {"offset": 12, "next": 10}], 10)


def test_tasks_without_a_position_write_no_data_files(tmp_path: Path) -> None:
    manifest = _save_positions(tmp_path, [None, None], step=3)
    assert manifest.part("data") == PartEntry("data") and not (tmp_path / "data").exists()
    task = Position(None)
    DataPart(task, rank=0, world_size=2, batch_size=4).restore(tmp_path, manifest, 3)
    assert task.loaded == ([None, None], 4)


def test_a_checkpoint_from_before_parts_resumes_with_no_position(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"step": 3, "tables": {}, "world_size": 2})
    task = Position(None)
    DataPart(task, rank=0, world_size=1, batch_size=4).restore(tmp_path,
                                                                Manifest.read(tmp_path), 3)
    assert task.loaded == ([None, None], 4)


def test_a_position_of_another_step_is_refused(tmp_path: Path) -> None:
    manifest = _save_positions(tmp_path, [5], step=3)
    part = DataPart(Position(None), rank=0, world_size=1, batch_size=4)
    with pytest.raises(ValueError, match="is not rank 0's data position before step 8"):
        part.restore(tmp_path, manifest, 7)


def test_data_files_of_ranks_the_checkpoint_lacks_are_refused(tmp_path: Path) -> None:
    manifest = _save_positions(tmp_path, [5, 6], step=3)
    entry = manifest.part("data")
    assert entry is not None
    bad = Manifest.from_dict({**manifest.as_dict(), "world_size": 1})
    part = DataPart(Position(None), rank=0, world_size=1, batch_size=4)
    assert "of ranks [0, 1], not distinct ranks of its world size 1" in str(
        part.verify(tmp_path, bad))


# -- end to end: a task's reading position across a resume -------------------------------

def _train(tmp_path: Path, name: str, task: str, *args: str) -> Path:
    out = tmp_path / f"{name}.pt"
    cmd = [sys.executable, "-m", "worker.main", "--task", f"tests.testing.cursor_task:{task}",
           "--num-rows", "2000", "--dim", "8", "--batch-size", "32", "--log-every", "5",
           "--eval-batches", "1", "--progress", "false", "--staleness", "1",
           "--local-optimizer", "--checkpoint-dir", str(tmp_path / "ck"),
           "--dump-state", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          check=False, env={**_clean_env(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}


def _same(a: Path, b: Path) -> bool:
    x, y = torch.load(a), torch.load(b)
    return all(torch.equal(x[p][k], y[p][k]) for p in ("tables", "dense") for k in x[p])


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_resumed_run_reads_on_from_the_saved_position(tmp_path: Path) -> None:
    straight = _train(tmp_path, "straight", "CursorTask", "--steps", "12",
                      "--checkpoint-every", "6")
    manifest = json.loads((step_dir(tmp_path / "ck", 5) / "manifest.json").read_text())
    assert [p["name"] for p in manifest["parts"]] == [
        "tables", "dynamic", "window", "source", "dense", "data"]
    (data,) = manifest["parts"][-1]["files"]
    saved = torch.load(step_dir(tmp_path / "ck", 5) / data["file"], weights_only=True)
    assert saved["state"] == {"cursor": 6, "next_step": 6}
    resumed = _train(tmp_path, "resumed", "CursorTask", "--steps", "12",
                     "--resume-from", str(step_dir(tmp_path / "ck", 5)))
    assert _same(straight, resumed)  # bitwise: the rows, the dense part
    # the control: a task that drops the position on resume reads other batches
    forgetful = _train(tmp_path, "forgetful", "ForgetfulCursorTask", "--steps", "12",
                       "--resume-from", str(step_dir(tmp_path / "ck", 5)))
    assert not _same(straight, forgetful)
