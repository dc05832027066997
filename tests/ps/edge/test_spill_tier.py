"""The disk tier end to end (--spill-dir, ps/core/spill.py): a real shard server whose run
share holds about a third of each rank's optimizer state spills the rest to its spill
files, and 2-rank jobs at staleness 0, 1 and 2 (a static and a dynamic table, Adam and
Adagrad) end bitwise equal to the same job on a server with every byte in memory: rows,
dense part and every checkpoint file. kill -9 of the spilling server mid-run, a new one on
the same --spill-dir and port: the ranks resume from the checkpoint (the spill files are
never the recovery source; the dead server's are removed at start) and end bitwise equal
too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hybridps.step_dirs import step_dir
from tests.ps.edge.test_paged_budget import _tensors
from tests.testing.helpers import PsServer, start_ps_server
from tests.worker.checkpoint.test_checkpoint import REPO, _env, assert_states, worker_cmd
from worker.runtime.faults import FAULT_ENV

pytestmark = [pytest.mark.e2e]

ARGS = ["--task", "tables", "--num-rows", "300", "--dim", "8", "--progress", "false",
        "--eval-batches", "1", "--log-every", "5", "--batch-size", "16",
        "--tables", "user:40:dynamic:lru,s:4000", "--steps", "30",
        "--checkpoint-every", "10"]
# Each rank holds 2,000 rows of `s` (64 bytes of Adam or 32 of Adagrad state a row, plus
# the 20 slots of `user`) and touches ~190 of them: a run share of 96 KiB over 2 ranks
# keeps ~140 rows of it in memory (the hot set is row-granular: it must be smaller than
# the rows a rank touches for the disk to be used) and leaves the paged-out rows of `user`
# room for all of them (no drop: the same run unbounded).
RUN_SHARE = 96 << 10
SPILL = ["--max-run-state-bytes", str(RUN_SHARE), "--run-shares", "1",
         "--spill-page-kb", "1"]
# about a third of that share (and the flags, two bytes a row): its memory alone would hold
# fewer of the paged-out rows of `user` than a rank pages out; they spill to the disk
# --spill-max-gb gives (10 MiB)
SPILL_PAGED = ["--max-run-state-bytes", str(60 << 10), "--run-shares", "1",
               "--spill-page-kb", "1", "--spill-max-gb", "0.01"]


def _run(server: PsServer, tmp_path: Path, name: str, extra: list[str]) -> None:
    cmd = worker_cmd([*ARGS, *extra, "--ps", server.address, "--run-id", name,
                      "--checkpoint-dir", str(tmp_path / f"ck-{name}"),
                      "--dump-state", str(tmp_path / f"{name}.pt"),
                      "--results", str(tmp_path / f"{name}.json")], 2)
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _same_checkpoints(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*.pt"))
    assert any("paged" in str(f) for f in files) and any("optim" in str(f) for f in files)
    for rel in files:
        ta, tb = _tensors(torch.load(a / rel)), _tensors(torch.load(b / rel))
        assert ta.keys() == tb.keys(), rel
        for key, t in ta.items():
            assert t.equal(tb[key]), (rel, key)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("staleness,optimizer,flags", [
    (0, "adam", SPILL), (1, "adagrad", SPILL), (2, "adam", SPILL),
    pytest.param(2, "adam", SPILL_PAGED, id="2-adam-paged")])
def test_a_spilling_server_trains_bitwise_like_one_in_memory(
        tmp_path: Path, staleness: int, optimizer: str, flags: list[str]) -> None:
    extra = ["--staleness", str(staleness), "--optimizer", optimizer]
    with start_ps_server(tmp_path) as server:
        _run(server, tmp_path, "mem", extra)
    spill_dir = tmp_path / "spill"
    with start_ps_server(tmp_path, *flags, "--spill-dir", str(spill_dir)) as server:
        _run(server, tmp_path, "spill", extra)
        assert list(spill_dir.glob("ps-*/*.pages"))  # the live server's spill files
    assert not list(spill_dir.glob("ps-*"))  # a cache of the process: gone with it
    stats = json.loads((tmp_path / "spill.json").read_text())["server_stats"]
    rows = stats["partitions"]
    static = [r for r in rows if r["table"] == "s"]
    assert len(static) == 2 and all(r["spilled"] for r in static), rows
    assert all(r["spill_spills"] > 0 and r["spill_fills"] > 0 for r in static), static
    assert all(r["spill_disk_bytes"] > 0 for r in static)
    assert all(r["spill_frames"] < r["spill_pages"] for r in static)
    user = [r for r in rows if r["table"] == "user"]
    assert all(r.get("dynamic_dropped", 0) == 0 for r in user), user  # none dropped
    if flags is SPILL_PAGED:  # the paged-out rows went to disk beyond the memory
        assert all(r["spilled"] and r["spill_disk_bytes"] > 0 for r in user), user
    assert_states(tmp_path / "mem.pt", tmp_path / "spill.pt", exact=True)
    _same_checkpoints(tmp_path / "ck-mem", tmp_path / "ck-spill")


@pytest.mark.timeout(1800)
def test_kill_9_of_a_spilling_server_resumes_bitwise(tmp_path: Path) -> None:
    with start_ps_server(tmp_path) as server:
        _run(server, tmp_path, "mem", ["--staleness", "1"])
    spill_dir = tmp_path / "spill"
    first = start_ps_server(tmp_path / "ps0", *SPILL, "--spill-dir", str(spill_dir))
    servers = [first]
    ck = tmp_path / "ck"
    args = [*ARGS, "--staleness", "1", "--ps", first.address, "--run-id", "crash",
            "--checkpoint-dir", str(ck), "--resume", "--ps-timeout", "20",
            "--dump-state", str(tmp_path / "crash.pt")]
    log_path = tmp_path / "workers.log"
    try:
        with open(log_path, "w") as log:
            # every rank sleeps 1 s at the start of the step-19 checkpoint: the kill finds
            # the run alive, with pages spilled
            proc = subprocess.Popen(worker_cmd(args, 2, max_restarts=2), cwd=REPO,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    env=_env({FAULT_ENV: "19:start:sleep=1"}))
            try:
                deadline = time.monotonic() + 300
                while not (step_dir(ck, 9) / "manifest.json").exists():
                    assert proc.poll() is None and time.monotonic() < deadline, \
                        log_path.read_text()[-6000:]
                    time.sleep(0.02)
                time.sleep(0.3)
                assert list(spill_dir.glob("ps-*/*.pages"))  # mid-spill
                os.kill(first.proc.pid, signal.SIGKILL)
                first.proc.wait()
                dead = list(spill_dir.glob("ps-*"))
                assert dead  # what kill -9 left behind
                servers.append(start_ps_server(tmp_path / "ps1", *SPILL, "--spill-dir",
                                               str(spill_dir), "--port", str(first.port)))
                assert not any(d.exists() for d in dead)  # not trusted: removed at start
                returncode = proc.wait(600)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        for server in servers:
            server.terminate()
    text = log_path.read_text()
    assert returncode == 0, text[-8000:]
    assert text.count("resumed from") >= 2, text[-8000:]
    assert_states(tmp_path / "mem.pt", tmp_path / "crash.pt", exact=True)
