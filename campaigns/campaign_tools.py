"""What the fault campaigns share (campaigns/server_kill_campaign.py, fuzz/fuzz_proto.py,
campaigns/soak.py): a shard server that can be SIGKILLed and started again on the same port,
torchrun'd worker commands, its RSS, and bitwise comparisons of two runs' final states.

    from campaign_tools import PsProcess, worker_cmd, state_differences  # campaigns/ on sys.path

Child processes get the environment without any HYBRIDPS_* variable (a campaign says
every flag it means; HYBRIDPS_FAULT_* only when it asks for a fault) and one OpenMP
thread per process.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hybridps.admin import get_shard_stats  # noqa: E402
from hybridps.checkpoint import read_shard, step_dir  # noqa: E402
from hybridps.v1 import admin_pb2  # noqa: E402

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
WORKER = str(REPO / "worker" / "main.py")
STARTUP_TIMEOUT_S = 60.0
# A small CTR job: 4 tables (2000 rows of the largest), steps of a few ms on a CPU.
SMALL_JOB = ["--num-rows", "2000", "--dim", "8", "--batch-size", "48", "--log-every", "5",
             "--eval-batches", "1", "--eval-every", "0", "--progress", "false"]


def child_env(**extra: str) -> dict[str, str]:
    """This environment without HYBRIDPS_* variables, one OpenMP thread, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def worker_cmd(args: list[str], *, world: int = 2, max_restarts: int = 0) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc_per_node", str(world),
            "--max-restarts", str(max_restarts), WORKER, *args]


class PsProcess:
    """`python -m ps` on 127.0.0.1 (port 0: a free one; else that port, e.g. the port of a
    server that was just killed); its log in DIRECTORY/ps.log."""

    def __init__(self, directory: Path, *args: str, port: int = 0) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        port_file = directory / "ps.port"
        port_file.unlink(missing_ok=True)
        self.log_path = directory / "ps.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port", str(port),
                 "--port-file", str(port_file), *args],
                cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"shard server did not start:\n{self.log_tail()}")
            time.sleep(0.02)
        self.port = int(port_file.read_text().strip())
        self.address = f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL and reap."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a graceful stop), SIGKILL after `timeout`; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def rss_kib(self) -> dict[str, int]:
        """VmRSS and its parts (RssAnon, RssFile, RssShmem) in KiB, from /proc."""
        out = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0])
        return out

    def stats(self, run_id: str = "", timeout: float = 5.0) -> admin_pb2.ShardStats:
        return get_shard_stats(self.address, timeout=timeout, run_id=run_id)


def children(pid: int) -> list[int]:
    """The processes `pid` started and that still run (/proc/PID/task/*/children)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(out)


class ProcessTree:
    """A process and all its descendants (torchrun, its agent and the ranks it starts, each
    rank in a session of its own), paused and resumed together with SIGSTOP / SIGCONT.

    A campaign pauses the run while it reads the server's stats, so that a run whose steps
    take a few ms cannot finish between the step the campaign aims at and its kill."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def pids(self) -> list[int]:
        """The root first, then its descendants (parents before children)."""
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop(0)
            out.append(pid)
            todo += children(pid)
        return out

    def _signal(self, pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def pause(self) -> None:
        """SIGSTOP every process of the tree, again until no new child appeared (a parent
        caught in the middle of starting one)."""
        stopped: set[int] = set()
        while True:
            new = [pid for pid in self.pids() if pid not in stopped]
            if not new:
                return
            self._signal(new, signal.SIGSTOP)
            stopped.update(new)

    def resume(self) -> None:
        self._signal(self.pids(), signal.SIGCONT)


def min_last_step(stats: admin_pb2.ShardStats) -> int | None:
    """The step every partition of the stats applied (None: no partition)."""
    steps = [p.last_step for p in stats.partitions]
    return min(steps) if steps else None


def state_differences(a_path: Path, b_path: Path) -> list[str]:
    """What differs, bitwise, between two --dump-state files (rows and dense weights)."""
    a, b = torch.load(a_path), torch.load(b_path)
    out = []
    for part in ("tables", "dense"):
        if set(a[part]) != set(b[part]):
            out.append(f"{part}: keys {sorted(set(a[part]) ^ set(b[part]))}")
            continue
        out += [f"{part} {key}" for key in sorted(a[part])
                if not torch.equal(a[part][key], b[part][key])]
    return out


def server_state_differences(ck_a: Path, ck_b: Path, step: int) -> list[str]:
    """What differs between the servers' optimizer state (m, v, the Adam step and the last
    step of every partition) in the checkpoints of `step` of two runs."""
    out = []
    files = sorted(p.relative_to(step_dir(ck_a, step))
                   for p in (step_dir(ck_a, step) / "optim").glob("*.pt"))
    if not files:
        return [f"no optimizer files in {step_dir(ck_a, step)}"]
    for rel in files:
        x: dict[str, Any] = read_shard(step_dir(ck_a, step) / rel)
        try:
            y: dict[str, Any] = read_shard(step_dir(ck_b, step) / rel)
        except Exception as exc:  # a missing or damaged file is a difference, named
            out.append(f"{rel}: {exc}")
            continue
        for key in ("adam_step", "last_step"):
            if x["meta"][key] != y["meta"][key]:
                out.append(f"{rel} {key} {x['meta'][key]} != {y['meta'][key]}")
        for key in ("m", "v"):
            if not torch.equal(x["tensors"][key], y["tensors"][key]):
                out.append(f"{rel} {key}")
    return out


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


def end_campaign(failures: list[Any], figures: dict[str, Any], json_path: str, work: Path,
                 keep_work: bool) -> int:
    """The end of every campaign: its failures printed, its figures written to `json_path`
    (if given), its work directory removed unless asked to keep it; exit code 1 on a
    failure."""
    for failure in failures[:20]:
        print(f"  FAIL {failure}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(figures, indent=2) + "\n")
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if not failures else 1
