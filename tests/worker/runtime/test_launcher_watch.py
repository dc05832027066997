"""A rank ends within seconds of its launcher's death (worker/runtime/launcher_watch.py), and the
server then takes a `--resume` of the run.

Unit: who is watched, the watch's stop and its exit after the grace.
End to end (real processes): `kill -9` of `hybridps-run` (and of a bare torchrun's agent)
during a 2-rank run: both ranks are gone within seconds, and a `--resume` of the run is
accepted by the same server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.testing.helpers import REPO, start_ps_server
from worker.runtime import launcher_watch
from worker.runtime.launcher_watch import LauncherWatch

MAIN = str(REPO / "worker" / "main.py")
LAUNCH = [sys.executable, "-m", "worker.launch"]  # hybridps-run
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # its agent is the ranks' parent
GONE_WITHIN_S = 15.0  # launcher_watch.GONE_GRACE_S, and a loaded machine's slack


# -- unit ---------------------------------------------------------------------------------

def test_only_a_rank_a_launcher_started_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launcher_watch.LAUNCHER_PID_ENV, raising=False)
    monkeypatch.delenv(launcher_watch.AGENT_ENV, raising=False)
    assert launcher_watch.launcher_pid() is None  # `python -m worker.main` from a shell
    monkeypatch.setenv(launcher_watch.AGENT_ENV, "0")  # a bare torchrun's rank
    assert launcher_watch.launcher_pid() == os.getppid()
    monkeypatch.setenv(launcher_watch.LAUNCHER_PID_ENV, "4242")  # hybridps-run's
    assert launcher_watch.launcher_pid() == 4242


def test_the_watch_stops_the_rank_and_exits_after_the_grace() -> None:
    stopped = threading.Event()
    exits: list[tuple[int, float]] = []
    started = time.monotonic()
    # re-parented: the parent it started under is not its parent any more
    watch = LauncherWatch(os.getppid() + 1, None, grace_s=0.3, poll_s=0.01,
                          on_gone=stopped.set,
                          exit_now=lambda code: exits.append((code, time.monotonic())))
    watch.start()
    watch.join(10)
    assert stopped.is_set()
    assert [code for code, _ in exits] == [launcher_watch.GONE_EXIT_CODE]
    assert exits[0][1] - started >= 0.3  # the graceful stop had its time first


def test_a_live_launcher_is_left_alone() -> None:
    calls: list[str] = []
    watch = LauncherWatch(os.getppid(), os.getpid(), poll_s=0.01,
                          on_gone=lambda: calls.append("gone"),
                          exit_now=lambda code: calls.append("exit"))
    watch.start()
    time.sleep(0.2)
    watch.stopped.set()
    watch.join(5)
    assert calls == [] and not watch.is_alive()


# -- end to end ---------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks in /proc")
@pytest.mark.parametrize("launcher", [LAUNCH, [TORCHRUN]], ids=["hybridps-run", "torchrun"])
def test_kill_9_of_the_launcher_ends_its_ranks_and_the_run_resumes(
        launcher: list[str], tmp_path: Path) -> None:
    server = start_ps_server(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HYBRIDPS_") or k in ("HYBRIDPS_CHECKPOINT_ROOT",
                                                     "HYBRIDPS_SAME_NODE_MB")}
    env.pop("LOGLEVEL", None)
    env["PYTHONUNBUFFERED"] = "1"
    checkpoints = tmp_path / "ck"
    run = [*launcher, "--standalone", "--nproc_per_node", "2", MAIN, "--ps", server.address,
           "--run-id", "launcher-killed", "--num-rows", "2000",
           "--batch-size", "32", "--dim", "8", "--log-every", "5", "--progress", "false",
           "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "5"]
    err = tmp_path / "w.err"
    ranks: list[int] = []
    try:
        with open(err, "w") as fe:
            proc = subprocess.Popen([*run, "--steps", "100000"], cwd=REPO, env=env,
                                    stdout=subprocess.DEVNULL, stderr=fe)
        deadline = time.monotonic() + 200
        while not list(checkpoints.glob("step-*/manifest.json")):  # training, a checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.3)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        proc.send_signal(signal.SIGKILL)  # the launcher, torchrun's agent in it
        killed = time.monotonic()
        while any(_running(r) for r in ranks) and time.monotonic() - killed < GONE_WITHIN_S:
            time.sleep(0.2)
        assert not any(_running(r) for r in ranks), (
            f"ranks still running {GONE_WITHIN_S:.0f}s after the launcher's kill -9\n"
            + err.read_text()[-3000:])
        proc.wait(30)
        # the server freed the ranks' streams: the run resumes (at a step past --steps 3:
        # it registers, restores, has nothing to do and finishes)
        resumed = subprocess.run([*run, "--steps", "3", "--resume"], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=200, check=False)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "Sync connection(s) use it" not in resumed.stderr
    finally:
        if "proc" in locals() and proc.poll() is None:
            proc.kill()
            proc.wait()
        for rank in ranks:
            if _running(rank):
                os.kill(rank, signal.SIGKILL)
        server.terminate()
