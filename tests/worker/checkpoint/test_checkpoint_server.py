"""Checkpoints with shard servers, end to end: the two-step Checkpoint (shard.proto
`deferred`, then CheckpointDone) and chains over two servers.

- two servers (`--ps A,B`, one rank a node: LOCAL_WORLD_SIZE 1): a run resumed from an
  incremental link of a chain (3 <- 7 <- 11), each server having written its rank's
  optimizer state, is bitwise the run straight through;
- with --checkpoint-async the step loop does not wait for the server's write (a server
  whose write of step 7 sleeps: the checkpoint held the loop for less than the sleep;
  written in place it held it for more), and the manifest appears only after the server
  confirmed its files (none while the server is still writing them);
- a failed server write is raised at the next checkpoint's wait and its checkpoint is
  never restorable; a SIGKILL of the server during its write leaves the previous
  checkpoint the newest restorable one, and the resume from it is bitwise the straight run.

The server's write is slowed or broken by its fault point (ps/core/checkpoint.py
WRITE_FAULT_ENV: after each file it writes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridps.checkpoint import MANIFEST, Manifest, complete_checkpoints, step_dir
from ps.core.faults import WRITE_FAULT_ENV
from tests.testing.helpers import PsServer, start_ps_server
from tests.testing.spawn_helpers import free_port
from tests.worker.checkpoint.test_checkpoint import (
    COMMON,
    GLOBAL_BATCH,
    REPO,
    _env,
    assert_states,
    run,
    worker_cmd,
)

CHAIN = ["--steps", "16", "--checkpoint-every", "4"]  # 3 (full) <- 7 <- 11 <- 15
SHORT = ["--steps", "12", "--checkpoint-every", "4"]  # 3 (full) <- 7 <- 11
SLEEP_S = 4.0


def _two_nodes(servers: list[PsServer], args: list[str], *, expect: int = 0,
               timeout: float = 300.0) -> list[str]:
    """Two ranks, each alone on its node (RANK, LOCAL_WORLD_SIZE 1), so `--ps A,B` gives
    rank r server r; returns their logs."""
    port = free_port()
    ps = ",".join(s.address for s in servers)
    procs = []
    for rank in range(2):
        env = _env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                    "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "worker.main", *COMMON, "--batch-size",
             str(GLOBAL_BATCH // 2), "--ps", ps, *args], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, text in zip(procs, logs, strict=True):
        assert (p.returncode == 0) == (expect == 0), f"exit {p.returncode}:\n{text[-6000:]}"
    return logs


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_chain_over_two_servers_resumes_bitwise(tmp_path: Path) -> None:
    servers = [start_ps_server(tmp_path / f"node{i}") for i in range(2)]
    try:
        ck = tmp_path / "ck"
        _two_nodes(servers, [*CHAIN, "--run-id", "two-ck", "--checkpoint-dir", str(ck),
                             "--dump-state", str(tmp_path / "straight.pt")])
        assert [s for s, _ in complete_checkpoints(ck)] == [3, 7, 11, 15]
        manifest = Manifest.read(step_dir(ck, 11))
        assert manifest.parent is not None and manifest.parent.step == 7
        for i, server in enumerate(servers):  # each server wrote its own rank's state
            log = server.stderr() + server.stdout()
            assert "event=checkpoint" in log and f"ranks={i} " in log, log[-3000:]
            assert f"ranks={1 - i} " not in log
        _two_nodes(servers, ["--steps", "16", "--run-id", "two-resumed", "--resume-from",
                             str(step_dir(ck, 11)), "--checkpoint-dir", str(tmp_path / "ck2"),
                             "--dump-state", str(tmp_path / "resumed.pt")])
        assert_states(tmp_path / "straight.pt", tmp_path / "resumed.pt", exact=True)
    finally:
        for server in servers:
            server.terminate()


def _results(path: Path) -> dict:
    return json.loads(path.read_text())["checkpoint"]


def _first_server_file(ck: Path, step: int, proc: subprocess.Popen[str],
                       timeout: float = 240.0) -> Path:
    """Wait until the server wrote a first optimizer file of the checkpoint of `step`
    (its fault point then sleeps); returns it."""
    deadline = time.monotonic() + timeout
    optim = step_dir(ck, step) / "optim"
    while time.monotonic() < deadline:
        done = list(optim.glob("*.pt")) if optim.is_dir() else []
        if done:
            return done[0]
        assert proc.poll() is None, proc.communicate()[0][-6000:]
        time.sleep(0.02)
    raise AssertionError(f"no server file of step {step} after {timeout:g}s")


def _worker(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(worker_cmd([*COMMON, "--batch-size", str(GLOBAL_BATCH // 2),
                                        *args], 2), cwd=REPO, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_step_loop_does_not_wait_for_the_server_write(tmp_path: Path) -> None:
    server = start_ps_server(tmp_path / "ps", env={WRITE_FAULT_ENV: f"7:sleep={SLEEP_S}"})
    try:
        ck = tmp_path / "ck"
        proc = _worker(["--ps", server.address, *SHORT, "--run-id", "slow-async",
                        "--checkpoint-dir", str(ck), "--checkpoint-async", "true",
                        "--results", str(tmp_path / "async.json")])
        first = _first_server_file(ck, 7, proc)
        # the server sleeps after this file: not confirmed, so no manifest yet
        assert not (step_dir(ck, 7) / MANIFEST).exists(), f"manifest before {first}"
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, out[-6000:]
        stats = _results(tmp_path / "async.json")
        assert stats["stall_s"][1] < SLEEP_S, stats  # the checkpoint of step 7
        assert stats["save_s"][1] > SLEEP_S, stats  # complete only after the server's write
        assert [s for s, _ in complete_checkpoints(ck)] == [3, 7, 11]
        run(["--ps", server.address, *SHORT, "--run-id", "slow-sync", "--checkpoint-dir",
             str(tmp_path / "ck-sync"), "--checkpoint-async", "false", "--results",
             str(tmp_path / "sync.json")])
        stats = _results(tmp_path / "sync.json")
        assert stats["stall_s"][1] > SLEEP_S, stats  # in place: the loop waits for it
    finally:
        server.terminate()


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_failed_server_write_is_raised_at_the_wait_and_never_restorable(
        tmp_path: Path) -> None:
    server = start_ps_server(tmp_path / "ps", env={WRITE_FAULT_ENV: "7:fail"})
    try:
        ck = tmp_path / "ck"
        proc = run(["--ps", server.address, *SHORT, "--run-id", "broken", "--checkpoint-dir",
                    str(ck), "--checkpoint-async", "true"], expect=1)
        log = proc.stdout + proc.stderr
        assert "CheckpointDone of step 7" in log and "injected checkpoint write failure" in log
        assert [s for s, _ in complete_checkpoints(ck)] == [3]
        assert not (step_dir(ck, 7) / MANIFEST).exists()
        assert not (step_dir(ck, 11) / MANIFEST).exists()  # raised at its wait
    finally:
        server.terminate()


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_server_killed_during_its_write_leaves_the_previous_checkpoint(
        tmp_path: Path) -> None:
    server = start_ps_server(tmp_path / "ps")
    try:
        run(["--ps", server.address, *SHORT, "--run-id", "straight", "--checkpoint-dir",
             str(tmp_path / "ck0"), "--dump-state", str(tmp_path / "straight.pt")])
    finally:
        server.terminate()
    doomed = start_ps_server(tmp_path / "ps-doomed", env={WRITE_FAULT_ENV: "7:sleep=60"})
    ck = tmp_path / "ck"
    try:
        proc = _worker(["--ps", doomed.address, *SHORT, "--run-id", "killed",
                        "--checkpoint-dir", str(ck), "--checkpoint-async", "true",
                        "--ps-timeout", "10"])
        _first_server_file(ck, 7, proc)
        os.kill(doomed.proc.pid, signal.SIGKILL)
        doomed.proc.wait(30)
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode != 0, out[-6000:]
    finally:
        doomed.terminate()
    assert [s for s, _ in complete_checkpoints(ck)] == [3]
    assert step_dir(ck, 7).exists() and not (step_dir(ck, 7) / MANIFEST).exists()
    server = start_ps_server(tmp_path / "ps-again")
    try:
        run(["--ps", server.address, *SHORT, "--run-id", "resumed", "--checkpoint-dir",
             str(ck), "--resume", "--dump-state", str(tmp_path / "resumed.pt")])
    finally:
        server.terminate()
    assert_states(tmp_path / "straight.pt", tmp_path / "resumed.pt", exact=True)
