"""The scale run (issue 47): a dynamic table whose rows and Adam state exceed this machine's
memory, paged to the shard server and spilled to disk, trained from start, checkpointed,
killed with kill -9, resumed and exported; each phase's time, peak memory and disk use.

    python bench/scale_run.py --quick                      # ~200k ids, dim 64 (~1-2 min)
    python bench/scale_run.py --distinct 2000000           # a pilot: 2M ids (1.5 GB of
                                                           # rows + state), budget 1/4
    python bench/scale_run.py --distinct 35000000 --budget-mb 8192 --json runs/scale.json
                                                           # the full run: ~27 GB

One table `t0:SLOTS*WORLD:POOL:dynamic:lru` (`--task tables` with uniform ids:
bench_memory_tier's UniformTablesTask) over --raw-ids popularity ranks hashed to raw int64
ids (500M by default: nearly every id a step draws is new), 2 gloo ranks
(`torchrun worker/main.py`), Adam at --staleness 1 on a real shard server (`python -m ps
--port 0`) with --memory-budget-mb M (default a quarter of the rows + state the run ends
with, or, if more, the least whose store keeps every id by the server's own arithmetic),
--run-shares 1, --spill-dir under the work directory and --spill-max-gb (default what a
log holding every id reserves: twice its pages, hybridps/spilled_rows.py; the file is
sparse, so the reservation takes no disk until written). STEPS is what reaches --distinct
ids over the raw id space (uniform draws: R (1 - exp(-draws / R)) distinct); the run
checkpoints every STEPS/2 steps (full, then incremental; --checkpoint-async false: every
byte written before the loop goes on). The phases:

  train       launch -> the step directory of the first checkpoint appears (set-up included)
  checkpoint  -> its manifest (the checkpointer's own seconds are parsed from the log too)
  kill        training goes on --kill-after steps past the checkpoint, then the server, the
              launcher and every rank get SIGKILL at once
  resume      a new server on the same --spill-dir (it removes the dead server's files), a
              new launch with --resume: the restore, training to STEPS, the last checkpoint
  export      `python -m worker.export --checkpoint DIR` (the newest: full + incremental)

Per phase: wall seconds; the VmHWM of the server, of each rank and of the export (from
/proc: the process's peak so far, read at the phase's end; an exited export's is its
wait4 ru_maxrss) and the largest VmRSS sampled in the phase; the machine's used memory
(MemTotal - MemAvailable, its peak); the disk the spill and checkpoint directories take
(allocated blocks and apparent size, their peaks); and from the server's stats the ids held
(on a slot or paged out), the paged bytes, the spilled bytes on disk and the ids dropped.
The resumed run must start at the checkpoint's step + 1 (checked: exit code 1 otherwise).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_memory_tier import UNIFORM_TASK, vm_hwm_bytes
from harness import (
    REPO,
    TORCHRUN,
    WORKER,
    Server,
    bench_parser,
    child_env,
    descendants,
    log,
    machine,
    write_json,
)

if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from hybridps.admin import get_shard_stats, message_dict
from hybridps.paged_rows import PagedRows, quota_rows
from hybridps.step_dirs import step_dir
from ps.core.partition import TableSpec
from ps.core.spill import SpillTier

BENCH_DIR = Path(__file__).resolve().parent
WORLD = 2
MIB, GIB = 2**20, 2**30
MANIFEST = "manifest.json"
RUN_ID = "scale"
SERVER_START_TIMEOUT_S = 600.0
CHECKPOINT_LINE = re.compile(r"checkpoint step (\d+) -> \S+: .* in ([\d.]+)s")
# (distinct ids, slots a rank, dim, ids a sample, batch a rank, sample seconds)
SIZES = {"default": (35_000_000, 2_000_000, 64, 16, 4096, 1.0),
         "quick": (200_000, 20_000, 64, 8, 512, 0.1)}
ADAM_FLOATS = 3  # a paged id's row, m and v (fp32, dim each)


def steps_for(distinct: int, raw_ids: int, ids_per_step: int) -> int:
    """Steps whose uniform draws over `raw_ids` reach `distinct` distinct ids (the
    expected count after n draws is R (1 - exp(-n / R)))."""
    if distinct >= raw_ids:
        raise ValueError(f"--distinct {distinct} must be below --raw-ids {raw_ids}")
    draws = -raw_ids * math.log1p(-distinct / raw_ids)
    return max(4, math.ceil(draws / ids_per_step))


def paged_layout(dim: int) -> list[tuple[str, int]]:
    return [("m", dim), ("v", dim)]  # Adam's state of a row


def paged_rows_held(budget_mb: int, spill_max_gb: float, slots: int, dim: int) -> int:
    """The paged-out ids a rank's store keeps before it drops any, under the server's
    --memory-budget-mb and --spill-max-gb (--run-shares 1), by the server's own arithmetic
    (ps/core/limits.py's share less the slots' fixed state, ps/core/spill.py's quota of a
    spilled store); 0 when the slots' state takes more than half the share (it would
    spill too: not this run's shape)."""
    share = budget_mb * MIB // WORLD
    fixed = TableSpec("t0", slots, dim, 0, slots).state_bytes("adam", False)
    if fixed > share // 2:
        return 0
    row_bytes = PagedRows(dim, paged_layout(dim)).row_bytes
    quota, _ = SpillTier("", 0).paged_quota(dim, paged_layout(dim), share - fixed,
                                            int(spill_max_gb * GIB) // WORLD, slots,
                                            row_bytes)
    return quota_rows(quota, row_bytes, slots)


def spill_gb_for(ids_a_rank: int, slots: int, dim: int) -> float:
    """--spill-max-gb whose part a rank holds `ids_a_rank` paged rows (and a call's):
    the log of a spilled store reserves twice the pages its rows fill (sparse)."""
    layout = [("rows", dim), *paged_layout(dim)]
    return WORLD * SpillTier("", 0).disk_bytes(ids_a_rank + slots, layout) / GIB + 0.01


def budget_mb_for(ids_a_rank: int, spill_max_gb: float, slots: int, dim: int) -> int:
    """The least --memory-budget-mb whose store keeps `ids_a_rank` paged ids a rank."""
    lo, hi = 1, 16
    while paged_rows_held(hi, spill_max_gb, slots, dim) < ids_a_rank:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if paged_rows_held(mid, spill_max_gb, slots, dim) < \
            ids_a_rank else (lo, mid)
    return hi


def disk_use(path: Path) -> tuple[int, int]:
    """(allocated bytes, apparent bytes) of the files under `path` (0, 0 when missing)."""
    allocated = apparent = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # removed meanwhile
                continue
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


def machine_used_bytes() -> int:
    """MemTotal - MemAvailable of /proc/meminfo (the page cache is not counted)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rank_of(pid: int) -> str | None:
    """`rank N` for a process running worker/main.py under torchrun (its RANK), else None."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if not any(part.endswith(b"worker/main.py") for part in cmd):
            return None
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((e[5:].decode() for e in env if e.startswith(b"RANK=")), "?")
    return f"rank {rank}"


@dataclass
class Peaks:
    """One phase's peaks (Watch)."""

    vm_hwm: dict[str, int] = field(default_factory=dict)    # label -> bytes
    max_rss: dict[str, int] = field(default_factory=dict)
    machine_used: int = 0
    disk: dict[str, tuple[int, int]] = field(default_factory=dict)  # dir -> (alloc, apparent)


class Watch:
    """Samples every `every_s` on a thread: the VmHWM and VmRSS of the processes watched
    (`watch(label, pid)`; `launcher(pid)`: the ranks under it, labelled by their RANK), the
    machine's used memory and the disk of `dirs`. `phase()` answers the peaks since the
    last one (VmHWM: each process's peak so far, at that moment)."""

    def __init__(self, dirs: dict[str, Path], every_s: float) -> None:
        self.dirs, self.every_s = dirs, every_s
        self.pids: dict[int, str] = {}
        self.launchers: list[int] = []
        self.peaks = Peaks()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scale-watch", daemon=True)
        self._thread.start()

    def watch(self, label: str, pid: int) -> None:
        with self._lock:
            self.pids[pid] = label

    def launcher(self, pid: int) -> None:
        with self._lock:
            self.launchers.append(pid)

    def forget(self) -> None:
        """Stop watching every process (they ended or were killed)."""
        with self._lock:
            self.pids.clear()
            self.launchers.clear()

    def sample(self) -> None:
        with self._lock:
            for launcher in self.launchers:
                for pid in descendants(launcher):
                    if pid not in self.pids and (label := rank_of(pid)) is not None:
                        self.pids[pid] = label
            pids = dict(self.pids)
        got = {}
        for pid, label in pids.items():
            try:
                got[label] = (vm_hwm_bytes(pid), rss_bytes(pid))
            except (OSError, RuntimeError, ValueError, IndexError):  # gone
                continue
        used = machine_used_bytes()
        disk = {name: disk_use(path) for name, path in self.dirs.items()}
        with self._lock:
            p = self.peaks
            for label, (hwm, rss) in got.items():
                p.vm_hwm[label] = max(p.vm_hwm.get(label, 0), hwm)
                p.max_rss[label] = max(p.max_rss.get(label, 0), rss)
            p.machine_used = max(p.machine_used, used)
            for name, (alloc, apparent) in disk.items():
                a0, b0 = p.disk.get(name, (0, 0))
                p.disk[name] = (max(a0, alloc), max(b0, apparent))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def phase(self) -> Peaks:
        """The peaks since the last call (sampled once more now), and a fresh start."""
        self.sample()
        with self._lock:
            out, self.peaks = self.peaks, Peaks()
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def held(stats: dict[str, Any] | None) -> dict[str, int]:
    """What the server's stats say the run holds: ids on a slot or paged out, paged bytes,
    spilled bytes on disk, ids dropped, the state bytes of the partitions."""
    parts = (stats or {}).get("partitions", [])
    dyn = [p for p in parts if p.get("dynamic")]
    return {"ids_held": sum(p["dynamic_occupied"] + p["dynamic_paged_rows"] for p in dyn),
            "ids_paged": sum(p["dynamic_paged_rows"] for p in dyn),
            "paged_bytes": sum(p["dynamic_paged_bytes"] for p in dyn),
            "paged_held_bytes": sum(p["dynamic_held_bytes"] for p in dyn),
            "dropped": sum(p["dynamic_dropped"] + p["dynamic_expired"] for p in dyn),
            "state_bytes": int((stats or {}).get("state_bytes_total", 0)),
            "spill_disk_bytes": int((stats or {}).get("spill_disk_bytes_total", 0)),
            "spill_fills": sum(p.get("spill_fills", 0) for p in parts),
            "spill_spills": sum(p.get("spill_spills", 0) for p in parts)}


def server_stats(server: Server) -> dict[str, Any] | None:
    try:
        return message_dict(get_shard_stats(server.address, timeout=30.0, run_id=RUN_ID))
    except Exception:  # a busy or dying server: no stats this time
        return None


def min_last_step(stats: dict[str, Any] | None) -> int | None:
    steps = [p["last_step"] for p in (stats or {}).get("partitions", [])]
    return min(steps) if steps else None


def phase_record(name: str, seconds: float, peaks: Peaks, **extra: Any) -> dict[str, Any]:
    return {"phase": name, "seconds": seconds, "vm_hwm_bytes": peaks.vm_hwm,
            "max_rss_bytes": peaks.max_rss, "machine_used_bytes": peaks.machine_used,
            "disk_bytes": {k: {"allocated": a, "apparent": b}
                           for k, (a, b) in peaks.disk.items()}, **extra}


def wait_until(what: str, done: Any, proc: subprocess.Popen[Any], deadline: float,
               log_path: Path, every_s: float) -> None:
    """Poll `done()` until true; RuntimeError naming `what` (and the log's tail) when the
    launch ended first or the deadline passed."""
    while not done():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
            why = "ended" if proc.poll() is not None else "timed out"
            raise RuntimeError(f"{what}: the launch {why} first; {log_path}:\n{tail}")
        time.sleep(every_s)


def kill9(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def launch(args: list[str], log_path: Path) -> subprocess.Popen[Any]:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(WORLD), WORKER, *args]
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=out,
                                stderr=subprocess.STDOUT)


def checkpoint_seconds(log_path: Path) -> dict[int, float]:
    """The checkpointer's own seconds by step, from rank 0's log lines."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return {int(m.group(1)): float(m.group(2)) for m in CHECKPOINT_LINE.finditer(text)}


@dataclass(frozen=True)
class Plan:
    raw_ids: int
    distinct: int
    slots: int      # a rank's
    dim: int
    pool: int
    batch: int      # a rank's
    budget_mb: int
    spill_max_gb: float
    steps: int
    every: int      # --checkpoint-every
    kill_after: int

    @property
    def ids_per_step(self) -> int:
        return WORLD * self.batch * self.pool

    @property
    def state_bytes(self) -> int:
        """Rows and Adam state of the ids the run ends with (4 bytes a float)."""
        return self.distinct * ADAM_FLOATS * self.dim * 4

    def worker_args(self, work: Path) -> list[str]:
        table = f"t0:{self.slots * WORLD}:{self.pool}:dynamic:lru"
        return ["--task", UNIFORM_TASK, "--tables", table, "--num-rows", str(self.raw_ids),
                "--dim", str(self.dim), "--batch-size", str(self.batch), "--optimizer",
                "adam", "--staleness", "1", "--steps", str(self.steps), "--run-id", RUN_ID,
                "--checkpoint-dir", str(work / "ck"), "--checkpoint-every", str(self.every),
                "--checkpoint-async", "false", "--checkpoint-keep", "0",
                "--eval-every", "0", "--eval-batches", "1", "--log-every",
                str(max(1, self.every // 4)), "--progress", "false"]

    def server_args(self, work: Path) -> list[str]:
        return ["--checkpoint-root", str(work), "--memory-budget-mb", str(self.budget_mb),
                "--run-shares", "1", "--spill-dir", str(work / "spill"),
                "--spill-max-gb", f"{self.spill_max_gb:.3f}"]


def run_phases(plan: Plan, work: Path, every_s: float, timeout_s: float,
               keep_export: bool) -> dict[str, Any]:
    """The five phases (module doc); their records and what the runs held."""
    ck = work / "ck"
    ck.mkdir(parents=True, exist_ok=True)
    watch = Watch({"spill": work / "spill", "checkpoint": ck, "export": work / "export"},
                  every_s)
    phases: list[dict[str, Any]] = []
    first_ck = plan.every - 1
    try:
        # (a)-(c): train from start, the checkpoint, kill -9 mid-training after it
        server = Server(work / "ps0", *plan.server_args(work),
                        startup_timeout_s=SERVER_START_TIMEOUT_S)
        watch.watch("server", server.proc.pid)
        log0 = work / "train.log"
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        proc = launch([*plan.worker_args(work), "--ps", server.address], log0)
        watch.launcher(proc.pid)
        try:
            wait_until("the first checkpoint's start", step_dir(ck, first_ck).exists, proc,
                       deadline, log0, every_s)
            t1 = time.monotonic()
            phases.append(phase_record("train", t1 - t0, watch.phase(),
                                       steps=plan.every, **held(server_stats(server))))
            wait_until("the first checkpoint's manifest",
                       (step_dir(ck, first_ck) / MANIFEST).exists, proc, deadline, log0,
                       every_s)
            t2 = time.monotonic()
            phases.append(phase_record(
                "checkpoint", t2 - t1, watch.phase(), step=first_ck,
                checkpointer_s=checkpoint_seconds(log0).get(first_ck)))
            target = first_ck + plan.kill_after
            last: dict[str, Any] | None = None

            def past_target() -> bool:
                nonlocal last
                last = server_stats(server)
                step = min_last_step(last)
                return step is not None and step >= target

            wait_until(f"step {target}", past_target, proc, deadline, log0, every_s)
            watch.sample()
            victims = [proc.pid, *descendants(proc.pid), server.proc.pid]
            t3 = time.monotonic()
            kill9(victims)
            proc.wait()
            server.proc.wait()
            phases.append(phase_record("kill", t3 - t2, watch.phase(),
                                       killed_at_step=min_last_step(last),
                                       killed=len(victims), **held(last)))
        finally:
            if proc.poll() is None:
                kill9([proc.pid, *descendants(proc.pid)])
                proc.wait()
            server.close()
        watch.forget()
        left = sorted(p.name for p in (work / "spill").glob("ps-*"))
        # (d): a new server on the same spill dir, the ranks resume from the checkpoint
        t4 = time.monotonic()
        server = Server(work / "ps1", *plan.server_args(work),
                        startup_timeout_s=SERVER_START_TIMEOUT_S)
        removed = [name for name in left if not (work / "spill" / name).exists()]
        watch.watch("server", server.proc.pid)
        log1, results = work / "resume.log", work / "resume.json"
        try:
            proc = launch([*plan.worker_args(work), "--ps", server.address, "--resume",
                           "--results", str(results)], log1)
            watch.launcher(proc.pid)
            try:
                code = proc.wait(max(1.0, deadline + timeout_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill9([proc.pid, *descendants(proc.pid)])
                proc.wait()
                raise RuntimeError(f"the resumed run timed out; see {log1}") from None
            stats = server_stats(server)
            t5 = time.monotonic()
        finally:
            server.close()
        if code != 0:
            tail = log1.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the resumed run failed ({code}); {log1}:\n{tail}")
        res = json.loads(results.read_text())
        ckr = res.get("checkpoint") or {}
        phases.append(phase_record(
            "resume", t5 - t4, watch.phase(), start_step=start_step(res),
            resumed_step=ckr.get("resumed_step"),
            restore_s=ckr.get("restore_s"), train_s=res.get("train_time_s"),
            setup_s=res.get("setup_time_s"), checkpoint_save_s=ckr.get("save_s"),
            last_step=res.get("last_step"), stale_spill_dirs_removed=removed,
            stale_spill_dirs_left=left, **held(stats or res.get("server_stats"))))
        watch.forget()
        # (e): export the newest checkpoint (the full one and the resumed run's delta)
        out = work / "export" / "model.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        t6 = time.monotonic()
        with open(work / "export.log", "wb") as export_log:
            exporter = subprocess.Popen(
                [sys.executable, "-m", "worker.export", "--checkpoint", str(ck), "--out",
                 str(out)], cwd=REPO, env=child_env(), stdout=export_log,
                stderr=subprocess.STDOUT)
        watch.watch("export", exporter.pid)
        _, status, usage = os.wait4(exporter.pid, 0)
        exporter.returncode = os.waitstatus_to_exitcode(status)
        t7 = time.monotonic()
        peaks = watch.phase()
        peaks.vm_hwm["export"] = max(peaks.vm_hwm.get("export", 0), usage.ru_maxrss * 1024)
        if exporter.returncode != 0:
            raise RuntimeError(f"the export failed ({exporter.returncode}); see "
                               f"{work / 'export.log'}")
        phases.append(phase_record("export", t7 - t6, peaks, ids=exported_ids(out),
                                   bytes=out.stat().st_size))
        if not keep_export:
            out.unlink()
    finally:
        watch.stop()
    return {"phases": phases, "resume_log": str(log1), "train_log": str(log0)}


def start_step(res: dict[str, Any]) -> int:
    """The first step a run's results say it ran: its last step + 1 less the steps its
    samples count."""
    ran = res["samples"] // (res["world_size"] * res["config"]["batch_size"])
    return int(res["last_step"]) + 1 - int(ran)


def exported_ids(path: Path) -> int:
    """Ids of the export's dynamic table (memory-mapped: the file is not read whole)."""
    import torch

    state = torch.load(path, mmap=True, weights_only=True)
    return sum(int(t.numel()) for k, t in state.items()
               if k.startswith("embedding.dynamic.") and k.endswith(".ids"))


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def table(record: dict[str, Any]) -> str:
    head = (f"{'phase':<10} {'s':>8} {'server VmHWM':>12} {'ranks VmHWM':>14} "
            f"{'export':>7} {'machine':>8} {'spill disk':>10} {'ck disk':>8} "
            f"{'ids held':>10} {'paged GB':>8}   (GB)")
    lines = [head]
    for p in record["phases"]:
        hwm = p["vm_hwm_bytes"]
        ranks = sorted(v for k, v in hwm.items() if k.startswith("rank"))
        disk = p["disk_bytes"]
        lines.append(
            f"{p['phase']:<10} {p['seconds']:>8.1f} {gb(hwm.get('server', 0)):>12} "
            f"{'/'.join(gb(r) for r in ranks) or '-':>14} {gb(hwm.get('export', 0)):>7} "
            f"{gb(p['machine_used_bytes']):>8} "
            f"{gb(disk.get('spill', {}).get('allocated', 0)):>10} "
            f"{gb(disk.get('checkpoint', {}).get('allocated', 0)):>8} "
            f"{p.get('ids_held', p.get('ids', '-'))!s:>10} "
            f"{gb(p['paged_bytes']) if 'paged_bytes' in p else '-':>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="200k ids, 20k slots a rank, dim 64 (the test's size)")
    p.add_argument("--distinct", type=int, default=0,
                   help="distinct ids the run ends with (default 35M; quick 200k)")
    p.add_argument("--raw-ids", type=int, default=500_000_000,
                   help="the raw id space the ids are drawn from, uniformly")
    p.add_argument("--slots", type=int, default=0,
                   help="device slots a rank (default 2M; quick 20k)")
    p.add_argument("--dim", type=int, default=0, help="row width (default 64)")
    p.add_argument("--pool", type=int, default=0, help="ids a sample (default 16; quick 8)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="samples a rank and step (default 4096; quick 512)")
    p.add_argument("--budget-mb", type=int, default=0,
                   help="the server's --memory-budget-mb (default: a quarter of the rows + "
                   "state the run ends with, or the least that keeps every id if more)")
    p.add_argument("--spill-max-gb", type=float, default=0.0,
                   help="the server's --spill-max-gb (default: the reservation of a log "
                   "holding every id: twice their pages, sparse)")
    p.add_argument("--kill-after", type=int, default=0,
                   help="steps past the first checkpoint before the kill (default steps/8)")
    p.add_argument("--sample-s", type=float, default=0.0,
                   help="seconds between samples of memory and disk (default 1; quick 0.1)")
    p.add_argument("--timeout-s", type=float, default=6 * 3600.0,
                   help="the most the launch before the kill, and the resumed one, may take")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the runs write (default: a temp dir)")
    p.add_argument("--keep", action="store_true",
                   help="keep the work directory (and the export) at the end")
    args = p.parse_args(argv)
    distinct, slots, dim, pool, batch, every_s = SIZES["quick" if args.quick else "default"]
    distinct, slots = args.distinct or distinct, args.slots or slots
    dim, pool, batch = args.dim or dim, args.pool or pool, args.batch_size or batch
    every_s = args.sample_s or every_s
    if min(distinct, slots, dim, pool, batch, args.raw_ids) < 1:
        p.error("--distinct, --slots, --dim, --pool, --batch-size and --raw-ids must be >= 1")
    if distinct >= args.raw_ids:
        p.error(f"--distinct {distinct} must be below --raw-ids {args.raw_ids}")
    steps = steps_for(distinct, args.raw_ids, WORLD * batch * pool)
    steps += steps % 2  # two checkpoints: steps/2 - 1 and steps - 1
    state = distinct * ADAM_FLOATS * dim * 4
    # a rank's paged ids, with room: the owner of an id is a hash of it
    ids_a_rank = int(distinct / WORLD * 1.02) + 1000
    spill_gb = args.spill_max_gb or spill_gb_for(ids_a_rank, slots, dim)
    least_mb = budget_mb_for(ids_a_rank, spill_gb, slots, dim)
    budget_mb = args.budget_mb or max(least_mb, state // 4 // MIB)
    if budget_mb < least_mb:
        log(f"note: --budget-mb {budget_mb} holds fewer than {ids_a_rank:,} paged ids a "
            f"rank ({least_mb} would): the oldest are dropped")
    plan = Plan(args.raw_ids, distinct, slots, dim, pool, batch, budget_mb, spill_gb,
                steps, steps // 2, args.kill_after or max(1, steps // 8))
    if plan.kill_after >= plan.every:
        p.error(f"--kill-after {plan.kill_after} must be below the checkpoint interval "
                f"{plan.every} (steps {steps})")
    # the ranks import UniformTablesTask from bench/
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="hybridps-scale-"))
    if (work / "ck").exists():
        p.error(f"--work-dir {work} holds a run already (ck/): give an empty one")
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    log(f"scale run: {distinct:,} ids over {args.raw_ids:,} raw ids, {steps} steps of "
        f"{plan.ids_per_step:,} ids, {slots:,} slots a rank, dim {dim}, rows + Adam state "
        f"{state / GIB:.2f} GiB, budget {plan.budget_mb} MiB, spill max "
        f"{plan.spill_max_gb:.2f} GiB, checkpoint every {plan.every}, kill at step "
        f"{plan.every - 1 + plan.kill_after}; in {work}")
    started = time.monotonic()
    try:
        record = run_phases(plan, work, every_s, args.timeout_s, args.keep)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    resume = next(r for r in record["phases"] if r["phase"] == "resume")
    ok = resume["start_step"] == plan.every and resume["resumed_step"] == plan.every - 1
    print(f"scale run: {WORLD} gloo ranks, dynamic table {slots * WORLD:,} slots, dim {dim}, "
          f"Adam at K=1, {steps} steps x {plan.ids_per_step:,} ids (uniform over "
          f"{args.raw_ids:,}), rows + state {state / 1e9:.2f} GB, budget {plan.budget_mb} MiB")
    print(table(record))
    print(f"resumed at step {resume['start_step']} (checkpoint {resume['resumed_step']}): "
          f"{'ok' if ok else 'WRONG'}; {time.monotonic() - started:.0f}s; load average "
          f"{load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}; "
          f"{work if args.keep else '(work dir removed)'}")
    write_json(args.json, {**record, "plan": dataclasses.asdict(plan), "steps": steps,
                           "state_bytes": state, "resumed_ok": ok,
                           "machine": machine(load_before),
                           "elapsed_s": time.monotonic() - started}, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
