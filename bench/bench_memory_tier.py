"""The shard server's memory tier side by side: a budget 4x smaller than the optimizer state
(the rest spilled to disk) against the same run with every byte in memory.

    python bench/bench_memory_tier.py --quick       # ids20, Zipf ids, 1 repeat (~3 min)
    python bench/bench_memory_tier.py               # ids20 and dlrm, Zipf and uniform ids,
                                                    # 1 repeat (~10-15 min)
    python bench/bench_memory_tier.py --jobs ids20 --repeats 5 --json runs/bench/tier.json

Two jobs, `--task tables` as bench_vs_torchrec.py's (2 gloo ranks, batch 1024 a rank,
Adam on a real shard server `python -m ps --port 0` at --staleness 1):
  ids20  one ROWS x 64 table (--ids20-rows), 20 ids a sample, mean-pooled
  dlrm   its 26 tables x 16, their rows scaled by --dlrm-scale (3 of them multi-hot)
each with the task's ids (bounded Zipf 1.1 over popularity ranks, scattered over the rows)
and, the worst case of a page cache, uniform ids (`UniformTablesTask`; --ids picks). Each
(job, ids) trains twice, memory then tier, after the other (job, ids)'s pair within a
repeat, each run on a fresh server (a repeat's servers start together, before any run):
  memory  no budget of its own (the default, 3/4 of the host's memory): all state in memory;
  tier    --memory-budget-mb a quarter of the job's optimizer state (Adam's m and v and the
          touched flag of every row, ps.core.partition.TableSpec.state_bytes), --run-shares
          1 (the one run gets the whole budget), --spill-dir under the work directory and
          --spill-max-gb three times the state (a log of page files reserves twice a
          partition's state, see hybridps/spilled_rows.py): what does not fit spills there.
Printed per (job, ids): samples/s of both (medians of the repeats), the median of the
per-repeat ratios tier / memory (goal >= 0.8x), the server's peak resident memory (VmHWM of
its /proc/<pid>/status, read after the run, before the server stops; the server's stats do
not report it) against the budget plus the job's fixed overhead, the excess VmHWM - (budget
+ overhead) of the tier run and whether it is <= 0 (the goal), the spill hit rate (page
accesses found in memory), pages read back from disk, and whether the two runs ended
bitwise equal (PASS/FAIL): every tensor of the rows and dense part (--dump-state) and of a
full checkpoint of the last step (--checkpoint-every STEPS, written in place: the ranks'
rows and the server's optimizer state, spilled pages read back). samples/s = steps x
global batch / (the training loop's time less that checkpoint's stall): the checkpoint is
the check's, not the workload's (--no-check: neither).

The fixed overhead of a job: the VmHWM of a server with the tier's flags (the job's budget)
running the same job's traffic (the same ranks, batch, ids a sample, dim, staleness,
threads, steps, checkpoint and --dump-state) on tables cut to one spill page of optimizer
state a rank (`minimal_job`; a table already smaller keeps its rows): what the server holds
whatever the table's size (the interpreter, torch's libraries, gRPC, its threads, the
messages and answers of a step at that table's few rows), once a job, on the first
repeat. A second table says where each run's VmHWM goes: what the budget counts (the
server's stats' state and master bytes, on the run's last GetShardStats), the overhead,
and the rest; and the peak of each part of its resident memory, sampled every SAMPLE_S
from /proc/<pid>/status while it trains: RssAnon (the heap: state, copies, buffers),
RssFile (mapped libraries) and RssShmem (the same-node arenas the ranks offer, mapped by
the server and counted in its VmRSS: a page of a ring the server touched stays resident
while it is mapped).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import REPO, Server, bench_parser, log, machine, run_worker, write_json

if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import torch

from hybridps.optim_kinds import state_floats_per_row
from hybridps.spilled_rows import page_rows_for
from ps.core.partition import TableSpec
from worker.config.task_options import parse_table_list
from worker.tasks.tables import TablesTask

BENCH_DIR = Path(__file__).resolve().parent
WORLD = 2
MIB = 2**20
GOAL_RATIO = 0.8
STATE_OVER_BUDGET = 4
OPTIMIZER = "adam"
DLRM_ROWS = [1_000_000, 800_000, 500_000, 300_000, 200_000, 100_000, 60_000, 30_000, 10_000,
             5_000, 3_000, 2_000, 1_000, 1_000, 500, 300, 200, 100, 100, 50, 30, 20, 10, 10,
             4, 3]  # bench_vs_torchrec.py's dlrm job
DLRM_POOL = {3: 8, 7: 4, 11: 3}  # table index -> ids a sample (mean-pooled)
UNIFORM_TASK = "bench_memory_tier:UniformTablesTask"
SAMPLE_S = 0.02  # how often a run's server's /proc/<pid>/status is read while it trains
RSS_PARTS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")  # of /proc/<pid>/status
SERVER_START_TIMEOUT_S = 600.0  # servers start together on a loaded machine
# (jobs, ids, ids20 rows, dlrm scale, steps, repeats): the default and --quick (this
# machine's process starts, about 45 s a run under load, bound how many runs fit)
SIZES = {"default": ("ids20,dlrm", "zipf,uniform", 200_000, 0.1, 12, 1),
         "quick": ("ids20", "zipf", 100_000, 0.05, 8, 1)}
IDS = ("zipf", "uniform")


class UniformTablesTask(TablesTask):
    """`--task tables` with uniform ids over each table: the worst case of a page cache
    (imported by the ranks as `--task bench_memory_tier:UniformTablesTask`)."""

    zipf_s = 0.0


def jobs(ids20_rows: int, dlrm_scale: float) -> dict[str, list[str]]:
    dlrm = ",".join(f"c{i}:{max(2, round(rows * dlrm_scale))}"
                    + (f":{DLRM_POOL[i]}" if i in DLRM_POOL else "")
                    for i, rows in enumerate(DLRM_ROWS))
    return {"ids20": ["--tables", f"t0:{ids20_rows}:20", "--dim", "64", "--batch-size", "1024"],
            "dlrm": ["--tables", dlrm, "--dim", "16", "--batch-size", "1024"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def state_bytes(job_args: list[str]) -> int:
    """The server's optimizer state of a job (every table, all ranks): Adam's m and v and
    the touched flag a row, as a partition allocates it."""
    dim = int(flag(job_args, "--dim"))
    return sum(TableSpec(name, rows, dim, 0, rows).state_bytes(OPTIMIZER, False)
               for name, rows, _ in parse_table_list(flag(job_args, "--tables")))


def minimal_job(job_args: list[str]) -> list[str]:
    """The job with every table cut to one spill page of optimizer state a rank (a table
    with fewer rows keeps them), the rest of its flags (batch, ids a sample, dim) the same:
    the fixed overhead's run (module doc)."""
    dim = int(flag(job_args, "--dim"))
    rows = WORLD * page_rows_for(4 * state_floats_per_row(OPTIMIZER, dim))
    tables = ",".join(f"{name}:{min(n, rows)}" + (f":{pool}" if pool > 1 else "")
                      for name, n, pool in parse_table_list(flag(job_args, "--tables")))
    out = list(job_args)
    out[out.index("--tables") + 1] = tables
    return out


def status_bytes(pid: int, names: tuple[str, ...]) -> dict[str, int]:
    """Fields `names` of /proc/<pid>/status (kB there), in bytes; a missing one is 0."""
    found = dict.fromkeys(names, 0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in found:
            found[key] = int(value.split()[0]) * 1024
    return found


def vm_hwm_bytes(pid: int) -> int:
    """The peak resident memory of a live process (VmHWM of /proc/<pid>/status)."""
    hwm = status_bytes(pid, ("VmHWM",))["VmHWM"]
    if not hwm:
        raise RuntimeError(f"/proc/{pid}/status has no VmHWM line")
    return hwm


class RssSampler:
    """The parts of a process's resident memory (RSS_PARTS), read every SAMPLE_S on a
    thread until `stop`: the peak of each, and all of them at the peak of VmRSS."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peaks = dict.fromkeys(RSS_PARTS, 0)
        self.at_peak = dict.fromkeys(RSS_PARTS, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        try:
            parts = status_bytes(self.pid, RSS_PARTS)
        except (OSError, ValueError, IndexError):  # the process is gone
            return
        self.samples += 1
        for name, value in parts.items():
            self.peaks[name] = max(self.peaks[name], value)
        if parts["VmRSS"] >= self.at_peak["VmRSS"]:
            self.at_peak = parts

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self._sample()
        return {"peaks_bytes": self.peaks, "at_peak_bytes": self.at_peak,
                "samples": self.samples}


def tier_flags(budget_mb: int, state: int, spill_dir: Path) -> list[str]:
    return ["--memory-budget-mb", str(budget_mb), "--run-shares", "1",
            "--spill-dir", str(spill_dir), "--spill-max-gb", f"{3 * state / 2**30 + 0.05:.3f}"]


@dataclass
class Planned:
    """One run of a repeat: where it writes, its server's flags and the worker's."""

    key: str            # job/ids, or job/overhead
    variant: str        # memory | tier | overhead
    directory: Path
    server_flags: list[str]
    worker_args: list[str]
    steps: int
    run_id: str
    check: bool
    server: Server | None = None


def start_servers(runs: list[Planned]) -> None:
    """A fresh server for every run, started together before any trains: an idle server
    takes no CPU to speak of, and a start (importing torch) takes seconds of CPU that
    would otherwise come one after the other."""
    def start(run: Planned) -> None:
        shutil.rmtree(run.directory, ignore_errors=True)
        run.server = Server(run.directory, "--checkpoint-root", str(run.directory),
                            *run.server_flags, startup_timeout_s=SERVER_START_TIMEOUT_S)

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = [pool.submit(start, run) for run in runs]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for run in runs:
            if run.server is not None:
                run.server.close()
        raise RuntimeError(f"{len(failed)} server(s) did not start: {failed[0]}")


def train(run: Planned) -> dict[str, Any]:
    """Run `run` on its server, then stop the server: the worker's results, the server's
    VmHWM (read before it stops) and the parts of its memory sampled while it trained."""
    assert run.server is not None
    d = run.directory
    saving = ["--dump-state", str(d / "state.pt"), "--checkpoint-dir", str(d / "ck"),
              "--checkpoint-every", str(run.steps), "--checkpoint-mode", "full",
              "--checkpoint-async", "false"] if run.check else []
    sampler = RssSampler(run.server.proc.pid)
    try:
        res = run_worker(["--ps", run.server.address, "--run-id", run.run_id, "--steps",
                          str(run.steps), "--staleness", "1", "--eval-batches", "1",
                          "--eval-every", "0", "--log-every", str(run.steps), *saving,
                          *run.worker_args],
                         d / "results.json", d / "worker.log", world=WORLD, timeout=3600)
        rss = sampler.stop()
        hwm = vm_hwm_bytes(run.server.proc.pid)
    finally:
        sampler.stop()
        run.server.close()
    stall = sum(res.get("checkpoint", {}).get("stall_s", []) or [0.0])
    train_s = res["train_time_s"] - stall
    stats = res.get("server_stats") or {}
    parts = [p for p in stats.get("partitions", []) if p.get("spilled")]
    hits = sum(p["spill_hits"] for p in parts)
    misses = sum(p["spill_misses"] for p in parts)
    return {"samples_per_s": res["steps"] * res["world_size"] * res["config"]["batch_size"]
            / train_s, "train_s": train_s, "checkpoint_stall_s": stall,
            "setup_s": res["setup_time_s"], "vm_hwm_bytes": hwm, "rss": rss,
            "server_state_bytes": stats.get("state_bytes_total", 0),
            "server_master_bytes": stats.get("master_bytes_total", 0),
            "spill_disk_bytes": stats.get("spill_disk_bytes_total", 0),
            "spill_hit_rate": hits / (hits + misses) if hits + misses else None,
            "spill_fills": sum(p["spill_fills"] for p in parts),
            "spill_spills": sum(p["spill_spills"] for p in parts),
            "dir": str(d)}


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts, lists and tuples, by its path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{prefix}[{i}]")


def _pt_files(directory: Path) -> dict[str, Path]:
    return {str(p.relative_to(directory)): p for p in sorted(directory.rglob("*.pt"))}


def _difference(a: Path, b: Path) -> str | None:
    """What differs first between the tensors of two .pt files (None: every one is equal,
    dtype and bits)."""
    ta = dict(_tensors(torch.load(a, weights_only=False)))
    tb = dict(_tensors(torch.load(b, weights_only=False)))
    if ta.keys() != tb.keys():
        return f"{a.name}: tensors differ {sorted(ta.keys() ^ tb.keys())[:4]}"
    for key, t in ta.items():
        if t.dtype != tb[key].dtype or not torch.equal(t, tb[key]):
            return f"{a.name}{key} differs"
    return None


def bitwise_equal(a: Path, b: Path) -> tuple[bool, str]:
    """(every tensor of the .pt files under `a` (a file or a directory) equals the same
    under `b`, what differs first or what was compared)."""
    fa, fb = ({"": a}, {"": b}) if a.is_file() else (_pt_files(a), _pt_files(b))
    if not fa or fa.keys() != fb.keys():
        return False, f"files differ: {sorted(fa.keys() ^ fb.keys())[:4]} ({len(fa)} files)"
    for rel in fa:
        diff = _difference(fa[rel], fb[rel])
        if diff is not None:
            return False, f"{rel} {diff}"
    return True, f"{len(fa)} file(s)"


def _counted(run: dict[str, Any]) -> int:
    """What the budget counts of a run's server (its stats' state and master bytes)."""
    return int(run["server_state_bytes"]) + int(run.get("server_master_bytes", 0))


def breakdown(results: dict[str, dict[str, list[dict[str, Any]]]],
              overheads: dict[str, dict[str, Any]]) -> str:
    """Where each run's VmHWM goes (module doc), the run of the highest VmHWM of its
    (job, ids, variant); the overhead runs first."""
    head = (f"{'run':<20} {'VmHWM':>6} {'counted':>7} {'overhead':>8} {'rest':>6}  "
            f"{'peaks: RssAnon':>14} {'RssFile':>7} {'RssShmem':>8}  {'at peak: anon':>13} "
            f"{'shmem':>6}")
    lines = [head]
    rows = [(f"{job}/overhead", run, 0) for job, run in overheads.items()]
    for key, runs in results.items():
        for variant in ("memory", "tier"):
            run = max(runs[variant], key=lambda r: r["vm_hwm_bytes"])
            rows.append((f"{key}/{variant}", run, overheads[key.split("/")[0]]["vm_hwm_bytes"]))
    for name, run, overhead in rows:
        peaks, at = run["rss"]["peaks_bytes"], run["rss"]["at_peak_bytes"]
        hwm, counted = run["vm_hwm_bytes"], _counted(run)
        ovh, rest = (f"{overhead / MIB:.0f}", f"{(hwm - counted - overhead) / MIB:.0f}") \
            if overhead else ("-", "-")
        lines.append(
            f"{name:<20} {hwm / MIB:>6.0f} {counted / MIB:>7.1f} {ovh:>8} {rest:>6}  "
            f"{peaks['RssAnon'] / MIB:>14.0f} {peaks['RssFile'] / MIB:>7.0f} "
            f"{peaks['RssShmem'] / MIB:>8.0f}  {at['RssAnon'] / MIB:>13.0f} "
            f"{at['RssShmem'] / MIB:>6.0f}")
    return "\n".join(lines)


def summarize(results: dict[str, dict[str, list[dict[str, Any]]]],
              budgets: dict[str, dict[str, int]], overheads: dict[str, dict[str, Any]]
              ) -> tuple[str, dict[str, Any]]:
    head = (f"{'job':<6} {'ids':<8} {'state MiB':>9} {'budget':>6} {'memory sps':>10} "
            f"{'tier sps':>9} {'tier/mem':>8} {'goal':>7}  {'VmHWM MiB: mem':>14} "
            f"{'tier':>6} {'overhead':>8} {'budget+ovh':>10} {'excess':>6} {'within':>7}  "
            f"{'hit rate':>8} {'pages in':>8} {'bitwise':>7}")
    lines, summary = [head], {}
    for key, runs in results.items():
        job, ids = key.split("/")
        mem, tier = runs["memory"], runs["tier"]
        ratios = [t["samples_per_s"] / m["samples_per_s"] for m, t in zip(mem, tier, strict=True)]
        ratio = statistics.median(ratios)
        hwm_mem = max(r["vm_hwm_bytes"] for r in mem)
        hwm_tier = max(r["vm_hwm_bytes"] for r in tier)
        overhead = overheads[job]["vm_hwm_bytes"]
        bound = budgets[job]["budget_bytes"] + overhead
        excess = hwm_tier - bound
        checks = [r["bitwise"] for r in tier if "bitwise" in r]
        bitwise = "-" if not checks else "PASS" if all(ok for ok, _ in checks) else "FAIL"
        hit = [r["spill_hit_rate"] for r in tier if r["spill_hit_rate"] is not None]
        summary[key] = {
            "memory_samples_per_s": statistics.median(r["samples_per_s"] for r in mem),
            "tier_samples_per_s": statistics.median(r["samples_per_s"] for r in tier),
            "ratio": ratio, "ratio_per_repeat": ratios, "goal": GOAL_RATIO,
            "met": ratio >= GOAL_RATIO, "vm_hwm_memory_bytes": hwm_mem,
            "vm_hwm_tier_bytes": hwm_tier, "overhead_bytes": overhead,
            "budget_plus_overhead_bytes": bound, "excess_bytes": excess,
            "within": excess <= 0,
            # the memory run against what its budget counts (all its state) + overhead
            "memory_excess_bytes": hwm_mem - max(_counted(r) for r in mem) - overhead,
            "bitwise": bitwise, "bitwise_detail": [d for _, d in checks]}
        lines.append(
            f"{job:<6} {ids:<8} {budgets[job]['state_bytes'] / MIB:>9.1f} "
            f"{budgets[job]['budget_mb']:>6} {summary[key]['memory_samples_per_s']:>10.0f} "
            f"{summary[key]['tier_samples_per_s']:>9.0f} {ratio:>7.3f}x "
            f"{'met' if ratio >= GOAL_RATIO else 'NOT met':>7}  {hwm_mem / MIB:>14.0f} "
            f"{hwm_tier / MIB:>6.0f} {overhead / MIB:>8.0f} {bound / MIB:>10.0f} "
            f"{excess / MIB:>+6.0f} {'yes' if excess <= 0 else 'NO':>7}  "
            f"{statistics.median(hit) if hit else 0.0:>8.1%} "
            f"{statistics.median(r['spill_fills'] for r in tier):>8.0f} {bitwise:>7}")
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="ids20 with Zipf ids only, 100k rows, 8 steps, 1 repeat")
    p.add_argument("--jobs", default="", help="comma list of ids20, dlrm (default both; "
                   "quick ids20)")
    p.add_argument("--ids", default="", help="comma list of zipf, uniform (default both; "
                   "quick zipf)")
    p.add_argument("--repeats", type=int, default=0, help="interleaved repeats, medians "
                   "over them (default 1: a repeat takes 10-15 min on a loaded 2-core VM)")
    p.add_argument("--steps", type=int, default=0, help="steps a run (default 12; quick 8)")
    p.add_argument("--ids20-rows", type=int, default=0,
                   help="rows of the ids20 table (default 200,000; quick 100,000)")
    p.add_argument("--dlrm-scale", type=float, default=0.0,
                   help="the dlrm tables' rows x this (default 0.1; quick 0.05)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the bitwise check (no --dump-state, no checkpoint)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where runs write (default: a temp dir, removed at the end)")
    args = p.parse_args(argv)
    job_list, id_list, rows, scale, steps, repeats = SIZES["quick" if args.quick else "default"]
    rows, scale = args.ids20_rows or rows, args.dlrm_scale or scale
    steps, repeats = args.steps or steps, args.repeats or repeats
    names = [j for j in (args.jobs or job_list).split(",") if j]
    idss = [i for i in (args.ids or id_list).split(",") if i]
    every = jobs(rows, scale)
    for name in names:
        if name not in every:
            p.error(f"--jobs: {name!r} is not one of {', '.join(every)}")
    for ids in idss:
        if ids not in IDS:
            p.error(f"--ids: {ids!r} is not one of {', '.join(IDS)}")
    if not names or not idss:
        p.error(f"--jobs {args.jobs!r} and --ids {args.ids!r} must name at least one")
    if min(rows, steps, repeats) < 1 or not scale > 0:
        p.error(f"--ids20-rows {rows}, --steps {steps} and --repeats {repeats} must be >= 1, "
                f"--dlrm-scale {scale} > 0")
    # the ranks import UniformTablesTask from this file
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="hybridps-bench-tier-"))
    work.mkdir(parents=True, exist_ok=True)
    started, load_before = time.perf_counter(), os.getloadavg()
    budgets: dict[str, dict[str, int]] = {}
    for name in names:
        state = state_bytes(every[name])
        budgets[name] = {"state_bytes": state,
                         "budget_mb": max(1, state // STATE_OVER_BUDGET // MIB)}
        budgets[name]["budget_bytes"] = budgets[name]["budget_mb"] * MIB
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        f"{j}/{ids}": {"memory": [], "tier": []} for j in names for ids in idss}
    overheads: dict[str, dict[str, Any]] = {}
    for i in range(repeats):
        plan = []
        for name in [] if i else names:  # each job's fixed overhead, once (module doc)
            d, minimal = work / f"overhead-{name}", minimal_job(every[name])
            plan.append(Planned(f"{name}/overhead", "overhead", d, tier_flags(
                budgets[name]["budget_mb"], state_bytes(minimal), d / "spill"),
                ["--task", "tables", *minimal], steps, f"{name}-overhead",
                not args.no_check))
        for name in names:
            for ids in idss:
                task = ["--task", UNIFORM_TASK if ids == "uniform" else "tables"]
                for variant in ("memory", "tier"):  # interleaved: memory, tier, memory, ...
                    d = work / f"r{i}-{name}-{ids}-{variant}"
                    flags = [] if variant == "memory" else tier_flags(
                        budgets[name]["budget_mb"], budgets[name]["state_bytes"], d / "spill")
                    plan.append(Planned(f"{name}/{ids}", variant, d, flags,
                                        [*task, *every[name]], steps, f"{name}-{ids}-{i}",
                                        not args.no_check))
        log(f"[{i + 1}/{repeats}] starting {len(plan)} servers")
        start_servers(plan)
        try:
            for run in plan:
                log(f"[{i + 1}/{repeats}] {run.key} {run.variant} ({run.steps} steps)")
                res = train(run)
                if run.variant == "overhead":
                    overheads[run.key.split("/")[0]] = res
                    continue
                mine = results[run.key]
                mine[run.variant].append(res)
                if run.variant == "tier" and run.check:
                    a, b = Path(mine["memory"][-1]["dir"]), run.directory
                    ok, detail = bitwise_equal(a / "ck", b / "ck")
                    if ok:
                        ok, more = bitwise_equal(a / "state.pt", b / "state.pt")
                        detail = f"checkpoint {detail}; --dump-state {more}"
                    res["bitwise"] = (ok, detail)
                    log(f"  bitwise {'PASS' if ok else 'FAIL'}: {detail}")
        finally:
            for run in plan:
                if run.server is not None:
                    run.server.close()
    elapsed = time.perf_counter() - started
    text, summary = summarize(results, budgets, overheads)
    print(f"memory tier: {WORLD} gloo ranks, Adam on a shard server at K=1, {steps} steps a "
          f"run, {repeats} interleaved repeat(s), medians; tier: --memory-budget-mb = state / "
          f"{STATE_OVER_BUDGET}, --run-shares 1, --spill-dir; memory: no budget of its own")
    print(text)
    print("overhead: the VmHWM of a server with the tier's flags running the job's traffic on "
          "tables of one spill page a rank; excess = tier VmHWM - (budget + overhead); goal "
          f"tier/memory >= {GOAL_RATIO}x, excess <= 0; bitwise: the rows, dense part and "
          "last-step checkpoint of tier == memory")
    print("where VmHWM goes (MiB; counted: what the budget counts, the server's stats' state "
          "and master bytes; rest = VmHWM - counted - overhead; peaks of /proc/<pid>/status "
          f"sampled every {SAMPLE_S * 1000:.0f} ms, and the parts at the peak of VmRSS):")
    print(breakdown(results, overheads))
    print(f"load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}; {elapsed:.0f}s; "
          f"runs in {work if args.work_dir else '(a temp dir, removed)'}")
    write_json(args.json, {"summary": summary, "runs": results, "budgets": budgets,
                           "overheads": overheads,
                           "steps": steps, "repeats": repeats, "ids20_rows": rows,
                           "dlrm_scale": scale, "machine": machine(load_before),
                           "elapsed_s": elapsed}, args)
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
