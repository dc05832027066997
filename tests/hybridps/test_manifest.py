"""The typed manifest (hybridps/checkpoint.py `Manifest`) reads what the dict-based code
wrote, and writes the same JSON back: the on-disk format did not change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridps.checkpoint import MANIFEST, Manifest, read_manifest, write_manifest
from hybridps.errors import CorruptCheckpoint, NotFound

# A manifest as worker/checkpoint/checkpointer.py wrote it before the typed class (2 ranks,
# one table).
OLD = {
    "step": 9, "next_step": 10, "world_size": 2, "run_id": "r1", "mode": "server",
    "row_dtype": "fp32",
    "optimizer": {"kind": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-08,
                  "weight_decay": 0.0},
    "task": "synthetic", "seed": 0, "data": {"step": 9, "samples_seen": 960},
    "created_unix": 1700000000.5,
    "tables": {"user": {"num_rows": 10, "dim": 4, "shards": [
        {"rank": r, "row_start": 5 * r, "row_end": 5 * r + 5,
         "rows": {"file": f"rows/user.r{r:05d}.pt", "bytes": 100 + r, "crc32": "0000abcd"},
         "optim": {"file": f"optim/user.r{r:05d}.pt", "bytes": 200 + r, "crc32": "1234abcd"}}
        for r in range(2)]}},
    "dense": {"files": [{"file": "dense/.metadata", "bytes": 7, "crc32": "00000001"}],
              "grad_scaler": None},
    "pending": {"staleness": 1, "applied_through": 8, "files": [
        {"rank": r, "file": f"pending/r{r:05d}.pt", "bytes": 50, "crc32": "000000ff"}
        for r in range(2)]},
}


def test_an_old_manifest_reads_and_writes_back_the_same(tmp_path: Path) -> None:
    write_manifest(tmp_path, OLD)
    manifest = Manifest.read(tmp_path)
    assert manifest.step == 9 and manifest.world_size == 2
    assert manifest.pending is not None and manifest.pending.applied_through == 8
    shards = manifest.shards("user", "optim")
    assert [(s.rank, s.row_start, s.row_end, s.file, s.bytes) for s in shards] == [
        (0, 0, 5, "optim/user.r00000.pt", 200), (1, 5, 10, "optim/user.r00001.pt", 201)]
    assert manifest.as_dict() == OLD
    again = tmp_path / "again"
    manifest.write(again)
    assert read_manifest(again) == read_manifest(tmp_path)


def test_minimal_and_broken_manifests(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"step": 2, "tables": {}})  # what some tests write
    manifest = Manifest.read(tmp_path)
    assert (manifest.row_dtype, manifest.pending, manifest.optimizer) == ("fp32", None, {})
    with pytest.raises(NotFound, match="no table 'user'"):
        manifest.shards("user", "rows")
    write_manifest(tmp_path, {"step": 2, "tables": {"t": {"num_rows": 3}}})
    with pytest.raises(CorruptCheckpoint, match="malformed manifest"):
        Manifest.read(tmp_path)
    data = json.loads((tmp_path / MANIFEST).read_text())
    assert data["format"] == "hybridps-checkpoint-v1"
