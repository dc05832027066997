"""Crash recovery by `torchrun --max-restarts`, and the fp16 loss scale across a resume.

(a) a worker rank SIGKILLs itself at a chosen step (HYBRIDPS_FAULT_KILL, first incarnation
    only); torchrun restarts both ranks, they re-join the process group (a fresh store
    namespace per incarnation: worker/runtime/rendezvous.py), --resume loads the last complete
    checkpoint, the server rolls the partitions back to it (Register.restore), and the
    final rows, dense weights and the server's m, v, step counts equal an uninterrupted run
    of the same seed and steps, bitwise;
(b) the process-group handshake itself, in-process: stale keys of a dead incarnation in
    the store never make a rank join the wrong generation;
(c) the same on two torchrun agents ("nodes"), whose restart counts may disagree;
(d) --precision fp16: the GradScaler's scale and growth tracker are part of the
    checkpoint, so a resumed fp16 run equals an uninterrupted one.
"""

from __future__ import annotations

import datetime
import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridps.checkpoint import complete_checkpoints, read_shard, step_dir
from ps.admin import get_shard_stats
from tests.testing.helpers import PsServer
from tests.worker.checkpoint.test_checkpoint import (
    COMMON,
    GLOBAL_BATCH,
    MAIN,
    REPO,
    TORCHRUN,
    _env,
    assert_states,
    run,
    worker_cmd,
)
from worker.runtime.faults import KILL_ENV, kill_point
from worker.runtime.rendezvous import agree_generation

TABLES = ("user", "item", "category", "tag")


@pytest.fixture(scope="module")
def straight(server: PsServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks x 20 steps, uninterrupted, checkpoints every 5 steps."""
    d = tmp_path_factory.mktemp("straight")
    run(["--ps", server.address, "--run-id", "restart-straight", "--steps", "20",
         "--checkpoint-every", "5", "--checkpoint-dir", str(d / "ck"),
         "--dump-state", str(d / "state.pt")])
    return d


def _assert_server_state_equal(a: Path, b: Path, step: int) -> None:
    for table in TABLES:
        for rank in (0, 1):
            name = f"optim/{table}.r{rank:05d}.pt"
            x, y = read_shard(step_dir(a, step) / name), read_shard(step_dir(b, step) / name)
            assert x["meta"]["adam_step"] == y["meta"]["adam_step"] == step + 1, name
            assert x["meta"]["last_step"] == y["meta"]["last_step"] == step, name
            for key in ("m", "v"):
                assert torch.equal(x["tensors"][key], y["tensors"][key]), (name, key)


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("rank", "step"), [(1, 13), (0, 7)])
def test_worker_kill_is_restarted_by_torchrun(server: PsServer, straight: Path,
                                              tmp_path: Path, rank: int, step: int) -> None:
    """kill -9 of one rank after it pushed `step` (so the server applied pushes past the
    last checkpoint): torchrun --max-restarts 1 brings the group back, it resumes from the
    last complete checkpoint and ends bitwise equal to the uninterrupted run. The checkpoints
    are written in place, so the one before the kill is complete when it comes (a kill
    during a background write: tests/worker/checkpoint/test_checkpoint_async.py)."""
    run_id = f"restart-kill-{rank}-{step}"
    args = [*COMMON, "--batch-size", str(GLOBAL_BATCH // 2), "--ps", server.address,
            "--run-id", run_id, "--steps", "20", "--checkpoint-every", "5",
            "--checkpoint-async", "false",
            "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
            "--dump-state", str(tmp_path / "state.pt")]
    proc = subprocess.run(worker_cmd(args, 2, max_restarts=1), cwd=REPO,
                          env=_env({KILL_ENV: f"{rank}:{step}"}), capture_output=True,
                          text=True, timeout=400, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    assert f"SIGKILL at step {step}" in log
    resumed_at = (step + 1) // 5 * 5 - 1  # the last checkpoint before the kill
    assert log.count(f"(step {resumed_at}, saved by world 2)") == 2, log[-8000:]
    assert_states(straight / "state.pt", tmp_path / "state.pt", exact=True)
    assert [s for s, _ in complete_checkpoints(tmp_path / "ck")][-1] == 19
    _assert_server_state_equal(straight / "ck", tmp_path / "ck", 19)
    stats = get_shard_stats(server.address, run_id=run_id)
    assert {p.rank: p.last_step for p in stats.partitions} == {0: 19, 1: 19}


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_worker_kill_on_one_of_two_nodes(server: PsServer, straight: Path,
                                         tmp_path: Path) -> None:
    """Two torchrun agents ("nodes" of one rank each, c10d rendezvous); rank 1 dies after
    pushing step 13. Its agent restarts it as a failure (restart count 1); the other agent
    often restarts its rank for the membership change without counting it (restart count
    0), so a store namespace keyed by TORCHELASTIC_RESTART_COUNT would split the group.
    The generation handshake puts both in generation 2, and the run ends bitwise equal."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    agents = []
    for i in range(2):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", endpoint, "--rdzv-id", "restart-two-nodes", "--local-addr",
               "127.0.0.1", "--max-restarts", "1", MAIN, *COMMON,
               "--batch-size", str(GLOBAL_BATCH // 2), "--ps", server.address,
               "--run-id", "restart-two-nodes", "--steps", "20", "--checkpoint-every", "5",
               "--checkpoint-async", "false",  # step 9's checkpoint complete at the kill
               "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
               "--dump-state", str(tmp_path / "state.pt")]
        log = open(tmp_path / f"agent{i}.log", "w")  # noqa: SIM115 - closed below
        agents.append((subprocess.Popen(cmd, cwd=REPO, env=_env({KILL_ENV: "1:13"}),
                                        stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)  # the first agent hosts the rendezvous store
    for proc, log in agents:
        try:
            proc.wait(400)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = [(tmp_path / f"agent{i}.log").read_text() for i in range(2)]
    for i, (proc, _) in enumerate(agents):
        assert proc.returncode == 0, logs[i][-6000:]
    both = logs[0] + logs[1]
    assert "SIGKILL at step 13" in both
    assert both.count("(step 9, saved by world 2)") == 2, both[-8000:]
    # (The node that hosts the store may change between rounds; then the counter restarts
    # in a fresh store, so only "one generation per incarnation" is asserted.)
    joined = re.findall(r"rank (\d): process group generation (\d+)", both)
    last = {rank: gen for rank, gen in joined}
    assert len(joined) == 4 and last["0"] == last["1"], joined
    assert_states(straight / "state.pt", tmp_path / "state.pt", exact=True)
    _assert_server_state_equal(straight / "ck", tmp_path / "ck", 19)


def test_kill_point_only_in_the_first_incarnation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KILL_ENV, "1:5")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    kill_point(1, 5)  # a restarted rank passes the step again and lives
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    kill_point(0, 5)
    kill_point(1, 4)
    monkeypatch.setenv(KILL_ENV, "1-5")
    with pytest.raises(ValueError, match="1-5"):
        kill_point(1, 5)


def test_generation_handshake_ignores_stale_keys() -> None:
    """A store holding a dead incarnation's handshake keys (as torchrun's shared store does
    after a restart): the new ranks still agree on a new generation."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))  # a rank left waiting fails the test

    def join(world: int) -> list[int]:
        got = [-1] * world
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            try:
                got[rank] = agree_generation(store, rank, world, timeout_s=30)
            except BaseException as exc:  # reported below, in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
        threads[0].start()
        time.sleep(0.3)  # rank 0 first: it sees the previous incarnation's hellos
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return got

    assert join(3) == [1, 1, 1]
    # The next incarnation: rank 0 finds the dead ranks' hellos (and their acks of
    # generation 1) in the store before the new ranks overwrite them.
    assert join(3) == [2, 2, 2]
    assert join(1) == [3]


# -- fp16: the GradScaler state ------------------------------------------------------------

FP16 = ["--precision", "fp16", "--loss-scale-init", str(2.0**24), "--local-optimizer",
        "--checkpoint-every", "10"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_fp16_resume_restores_the_loss_scale(tmp_path: Path) -> None:
    """The initial scale 2^24 overflows the fp16 gradients: steps 0-5 are skipped and the
    scale halves each time (2^18 by the step-9 checkpoint). A resume that restarted the
    scaler at 2^24 would skip 6 more steps and end elsewhere."""
    run([*FP16, "--steps", "20", "--checkpoint-dir", str(tmp_path / "a"),
         "--dump-state", str(tmp_path / "straight.pt"), "--results",
         str(tmp_path / "straight.json")])
    run([*FP16, "--steps", "10", "--checkpoint-dir", str(tmp_path / "b")])
    run([*FP16, "--steps", "20", "--checkpoint-dir", str(tmp_path / "b"), "--resume",
         "--dump-state", str(tmp_path / "resumed.pt"), "--results",
         str(tmp_path / "resumed.json")])
    manifest = json.loads((step_dir(tmp_path / "b", 9) / "manifest.json").read_text())
    assert manifest["dense"]["grad_scaler"]["scale"] == 2.0**18
    straight_dense = json.loads((tmp_path / "straight.json").read_text())["dense"]
    resumed_dense = json.loads((tmp_path / "resumed.json").read_text())["dense"]
    assert straight_dense["skipped_steps"] == 6 and resumed_dense["skipped_steps"] == 0
    assert resumed_dense["loss_scale"] == straight_dense["loss_scale"]
    assert_states(tmp_path / "straight.pt", tmp_path / "resumed.pt", exact=True)
