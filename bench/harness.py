"""What the benchmarks share: the command line, a shard server, a torchrun'd worker, the
JSON they write, and the median of repeats.

    from harness import Server, bench_parser, run_worker, write_json   # bench/ is sys.path[0]

A benchmark runs as a script (`python bench/bench_x.py`), so this module is imported by
its plain name. Child processes get the environment without any HYBRIDPS_* variable (a
benchmark says every flag it means) and one OpenMP thread per process.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
WORKER = str(REPO / "worker" / "main.py")
STARTUP_TIMEOUT_S = 60.0
T = TypeVar("T")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_parser(doc: str | None, *, quick: str = "a shorter run") -> argparse.ArgumentParser:
    """A parser with the flags every benchmark has: --quick and --json PATH."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def child_env(**extra: str) -> dict[str, str]:
    """This environment without HYBRIDPS_* variables, one OpenMP thread, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDPS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (children, theirs, ...; Linux /proc), not `pid`."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += children
            todo += children
    return out


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds so far of every process under `pid` (a launcher's ranks), not its own."""
    if process_cpu_s(pid) is None:
        return None
    return sum(cpu for cpu in map(process_cpu_s, descendants(pid)) if cpu is not None)


class CpuSampler:
    """Samples a process's CPU seconds (process_cpu_s; `tree`: those of every process under
    it, tree_cpu_s) every `every_s` on a thread, so the CPU it used in a span of
    wall-clock time (e.g. another process's training loop) can be read afterwards:
    `cpu_between(t0, t1)`. Read processes that start or end inside the span would count
    wrong: a launcher's ranks live from before a training loop to after it."""

    def __init__(self, pid: int, every_s: float = 0.02, *, tree: bool = False) -> None:
        self.pid, self.every_s = pid, every_s
        self.read = tree_cpu_s if tree else process_cpu_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            cpu = self.read(self.pid)
            if cpu is None:
                return
            self.samples.append((time.time(), cpu))
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_between(self, start: float, end: float) -> float | None:
        """CPU seconds used in [start, end] (wall clock), interpolated between samples."""
        if len(self.samples) < 2 or not self.samples[0][0] <= start < end <= self.samples[-1][0]:
            return None
        times = [t for t, _ in self.samples]

        def at(x: float) -> float:
            i = max(1, bisect.bisect_left(times, x))
            (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
            return c0 + (c1 - c0) * ((x - t0) / (t1 - t0) if t1 > t0 else 0.0)

        return at(end) - at(start)


class Server:
    """`python -m ps` on a free port of 127.0.0.1; its log in DIRECTORY/ps.log."""

    def __init__(self, directory: Path, *args: str,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        port_file = directory / "ps.port"
        port_file.unlink(missing_ok=True)  # a file left by an earlier run is not this port
        self.log = open(directory / "ps.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port", "0",
             "--port-file", str(port_file), *args],
            cwd=REPO, env=child_env(), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout_s
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"shard server did not start; see {directory / 'ps.log'}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{port_file.read_text().strip()}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_sampled(cmd: Sequence[str], timeout: float) -> tuple[int, str, str, CpuSampler]:
    """Run `cmd` (a launcher: torchrun) to its end, sampling the CPU of every process under
    it; (exit code, stdout, stderr, the sampler)."""
    proc = subprocess.Popen(list(cmd), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sampler = CpuSampler(proc.pid, tree=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    finally:
        sampler.stop()
    return proc.returncode, out, err, sampler


def run_worker(args: Sequence[str], results: Path, log_path: Path, *, world: int = 2,
               timeout: float = 3600.0) -> dict[str, Any]:
    """torchrun `world` ranks of worker/main.py with `args` and --results; the results
    JSON plus "process_wall_s" and "ranks_train_cpu_s" (the CPU of all ranks, every
    thread, during rank 0's training loop; None where /proc cannot say) (RuntimeError with
    the log's tail when it fails)."""
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(world), WORKER, *args,
           "--progress", "false", "--results", str(results)]
    t0 = time.perf_counter()
    code, out, err, sampler = run_sampled(cmd, timeout)
    wall = time.perf_counter() - t0
    log_path.write_text(out + err)
    if code != 0:
        raise RuntimeError(f"worker run failed ({code}), see {log_path}:\n{err[-3000:]}")
    res: dict[str, Any] = json.loads(results.read_text())
    res["process_wall_s"] = wall
    span = res.get("train_span_unix_s")
    res["ranks_train_cpu_s"] = sampler.cpu_between(*span) if span else None
    return res


def median_of(runs: Sequence[T], key: str) -> T:
    """The run with the median `key` (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: getattr(r, key))
    return ordered[(len(ordered) - 1) // 2]


def machine(load_before: tuple[float, float, float], **extra: Any) -> dict[str, Any]:
    """What the JSON says about the machine a benchmark ran on."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(), **extra}


def write_json(path: Path | None, payload: dict[str, Any],
               args: argparse.Namespace | None = None) -> None:
    """Write `payload` (+ the command line's arguments) to `path` when one is given."""
    if path is None:
        return
    if args is not None:
        payload = {**payload, "args": {k: str(v) for k, v in vars(args).items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {path}")
