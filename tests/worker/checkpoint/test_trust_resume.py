"""The worker side of checkpoint trust: a damaged checkpoint is never loaded.

- every kind of file a checkpoint lists (rows, optim, pending, dense, the manifest) is
  checked against the manifest before anything is applied (unit, on a real checkpoint);
- `--resume` skips a damaged newest checkpoint, names the bad file, resumes from the
  newest intact one (every rank the same) and ends bitwise equal to an uninterrupted run;
- `--resume-from` a damaged checkpoint exits 2 with one line; `--resume` at the run's
  last step says there is nothing to do and exits 0.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridps.checkpoint import (
    complete_checkpoints,
    manifest_entries,
    optim_file,
    read_manifest,
    rows_file,
    step_dir,
    verify_files,
)
from hybridps.errors import CorruptCheckpoint, ShardError
from tests.ps.core.test_trust_core import flip_tensor_bytes
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import assert_states, run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ckpts(server: PsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """2 ranks x 20 steps straight (straight.pt), and a 15-step run with checkpoints at
    steps 4, 9, 14 (ck/)."""
    d = tmp_path_factory.mktemp("trust-resume")
    ps = ["--ps", server.address, "--checkpoint-every", "5", "--staleness", "1"]
    run([*ps, "--run-id", "tr-straight", "--steps", "20", "--checkpoint-dir",
         str(d / "ck_straight"), "--dump-state", str(d / "straight.pt")])
    run([*ps, "--run-id", "tr-first", "--steps", "15", "--checkpoint-dir", str(d / "ck")])
    assert [s for s, _ in complete_checkpoints(d / "ck")] == [4, 9, 14]
    yield d


def _flip(path: Path, at: int, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    at = min(at, max(0, len(data) - n))
    data[at:at + n] = bytes(b ^ 0xA5 for b in data[at:at + n])
    path.write_bytes(bytes(data))


def test_every_listed_file_is_verified(ckpts: Path, tmp_path: Path) -> None:
    """Flip bytes in (and truncate) each file the manifest lists, one at a time."""
    src = step_dir(ckpts / "ck", 9)
    entries = manifest_entries(read_manifest(src))
    kinds = {e["file"].split("/")[0] for e in entries}
    assert kinds == {"rows", "optim", "pending", "dense"}, kinds
    for i, entry in enumerate(entries):
        for damage in ("flip", "truncate"):
            copy = tmp_path / f"{i}-{damage}"
            shutil.copytree(src, copy)
            victim = copy / entry["file"]
            if damage == "flip":
                _flip(victim, victim.stat().st_size // 2)
            else:
                victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
            with pytest.raises(CorruptCheckpoint, match=re.escape(str(victim))):
                verify_files(copy, read_manifest(copy))
            shutil.rmtree(copy)


def test_damaged_newest_is_skipped_and_the_run_ends_bitwise_equal(
        ckpts: Path, server: PsServer, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(ckpts / "ck", ck)
    bad = step_dir(ck, 14) / optim_file("item", 1)  # written by the server, same size
    flip_tensor_bytes(bad, "m")  # only the values change: the file still loads
    proc = run(["--ps", server.address, "--run-id", "tr-skip", "--steps", "20",
                "--checkpoint-every", "5", "--staleness", "1", "--checkpoint-dir", str(ck),
                "--resume", "--dump-state", str(tmp_path / "state.pt")])
    log = proc.stderr
    assert re.search(rf"checkpoint \S*step-0000000014 is damaged, skipped: checkpoint file "
                     rf"{re.escape(str(bad))} has crc32", log), log[-4000:]
    assert re.search(r"resuming from \S*step-0000000009 \(step 9\); skipped 1 damaged", log)
    assert log.count("(step 9, saved by world 2)") == 2, log[-4000:]  # both ranks
    assert_states(ckpts / "straight.pt", tmp_path / "state.pt", exact=True)


def test_resume_from_a_damaged_checkpoint_exits_2_with_one_line(
        ckpts: Path, server: PsServer, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(ckpts / "ck", ck)
    bad = step_dir(ck, 9) / rows_file("user", 0)
    bad.write_bytes(bad.read_bytes()[:1000])  # truncated
    proc = run(["--ps", server.address, "--run-id", "tr-from", "--steps", "20",
                "--resume-from", str(step_dir(ck, 9))], nproc=1, expect=1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("hybridps worker: error: resume_from=")
    assert str(bad) in errors[0] and "manifest says" in errors[0]
    assert "Traceback" not in proc.stderr


def test_resume_when_every_checkpoint_is_damaged_exits_2(ckpts: Path, server: PsServer,
                                                         tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(ckpts / "ck", ck)
    for step in (4, 9, 14):
        (step_dir(ck, step) / "manifest.json").write_text("{ not json")
    proc = run(["--ps", server.address, "--run-id", "tr-none", "--steps", "20",
                "--checkpoint-dir", str(ck), "--resume"], nproc=1, expect=1)
    assert proc.returncode == 2
    assert "no intact checkpoint under" in proc.stderr and "Traceback" not in proc.stderr


def test_resume_at_the_last_step_has_nothing_to_do(ckpts: Path, server: PsServer) -> None:
    proc = run(["--ps", server.address, "--run-id", "tr-done", "--steps", "15",
                "--checkpoint-dir", str(ckpts / "ck"), "--resume"])
    assert "nothing to do" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "loss nan" not in proc.stdout and "samples/s" not in proc.stdout


def test_verification_errors_are_shard_errors_not_tracebacks(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"format": "hybridps-checkpoint-v1"}')
    with pytest.raises(ShardError, match="step and tables"):
        read_manifest(tmp_path)
