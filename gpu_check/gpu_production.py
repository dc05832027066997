"""Stage `production_job` of gpu_check/check.py: the job of gpu_check/gpu_prod_job.py at
production size on one GPU capped to a 40 GiB device (docs/gpu_check.md).

Sub-stages, each with its own time budget (SUBSTAGES; one that the stage's time left
cannot hold is recorded as not run, one that fails records its error and the next
starts), in this process, one shard server on this machine:
a. tables both designs hold: hybridps --staleness 1 against the GPU-resident loop
   (gpu_jobs.resident_loop: F.embedding_bag sparse + SparseAdam; rowwise Adagrad on both
   sides), at dim 64 / batch 16k and dim 128 / batch 64k: samples/s and their ratio.
c. servers of 1, 4 and 16 kernel threads serving the dim 128 / 64k job at K=1: the
   time the step waited for updates.
d. bf16 rows against fp32 rows (K=1, dim 64 / 16k).
e. three large tables dynamic (rows on the device, --pipeline: the next step's ids
   handed to the embedding) against the same tables static.
f. the job written to Parquet and fed by --task files (--data-workers 2; batches go to
   the device through pinned buffers with non-blocking copies: Batch.to).
g. a torch.profiler summary of K=1 steps: top ops and kernels, the device's idle gaps.
b. tables 2.5x what the resident design holds under the cap: the resident design tried
   (out of memory), then hybridps trains them: samples/s, max_memory_allocated.
b runs last: it needs about 8 bytes an element of host memory for the server's Adam
state (about 70 GB at 40 GiB), and a host that runs out ends the process.
"""

from __future__ import annotations

import gc
import itertools
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_common import StageReport, Timer, log, pick_device
from gpu_jobs import resident_loop, train_in_process
from gpu_prod_job import (
    CAP_GIB,
    DYNAMIC_TABLES,
    GIB,
    HYBRID_BYTES,
    REPLAY_BATCHES,
    RESIDENT_BYTES,
    ProductionTask,
    a2a_bytes_per_step,
    job_args,
    owner_pooled_bag_bytes,
    sizes_from_cap,
    table_rows,
)

# name -> (what it answers, budget on the GPU in s, the least time worth starting it with)
SUBSTAGES: dict[str, tuple[str, int, int]] = {
    "a_both_hold": ("hybridps K=1 vs the GPU-resident loop on tables both hold", 80, 30),
    "c_server_threads": ("the step's wait for updates at K=1, servers of 1-16 threads", 45, 15),
    "d_bf16": ("bf16 rows against fp32 rows", 20, 8),
    "e_dynamic": ("dynamic tables on the device, next ids prefetched, vs static", 30, 10),
    "f_parquet": ("the job fed from Parquet (--task files), pinned copies", 30, 10),
    "g_profile": ("torch.profiler: top ops, kernels, the device's idle gaps", 20, 8),
    "b_larger": ("tables 2.5x what the resident design holds under the cap", 100, 50),
}
STAGE_LIMIT_S = sum(b for _, b, _ in SUBSTAGES.values()) + 10
SHAPES = [(64, 16384), (128, 65536)]          # (dim, batch a GPU)
DRY_SHAPES = [(8, 64), (16, 128)]
DRY_CAP_BYTES = 24 << 20                       # the dry run's pretend device
DRY_TOP_MLP = [32, 16]
STEPS, DRY_STEPS = 20, 3
THREADS, DRY_THREADS = [1, 4, 16], [2]
THREAD_STEPS = 10  # at 1 thread a step's update may take most of a second
DEVICE_PREFETCH = ("not built: with the rows on the device a dynamic table's translation "
                   "(admission, eviction, paging through the shard server) runs at the "
                   "step's lookup on the training thread; --pipeline only sets the pin rule "
                   "(worker/embedding/dynamic/prefetch.py: the helper thread runs for the "
                   "in-process store with fp32 rows on the CPU at world size 1)")


@dataclass
class Env:
    """What every sub-stage is given."""

    ctx: Any
    device: torch.device
    ps: list[str]
    dry_run: bool
    work: Path
    sizes: dict[str, Any]

    @property
    def steps(self) -> int:
        return DRY_STEPS if self.dry_run else STEPS

    @property
    def shapes(self) -> list[tuple[int, int]]:
        return DRY_SHAPES if self.dry_run else SHAPES

    def rows(self, elements_key: str, dim: int) -> dict[str, int]:
        return table_rows(self.sizes[elements_key], dim, 50 if self.dry_run else 1000)

    def job(self, rows: dict[str, int], dim: int, batch: int,
            dynamic: tuple[str, ...] = ()) -> list[str]:
        """The job's flags; in a dry run with a small top MLP (DRY_TOP_MLP)."""
        args = job_args(rows, dim, batch, dynamic)
        if self.dry_run:
            config = self.work / "dry_top_mlp.json"
            config.write_text(json.dumps({"top_mlp": DRY_TOP_MLP}))
            args += ["--model-config", str(config)]
        return args


def _slim(run: dict[str, Any]) -> dict[str, Any]:
    keep = ("steps", "batch", "samples_per_s", "step_ms", "waits", "wait_ms_per_step",
            "rows_pushed_per_step", "gpu_peak_mib", "step_time_ms", "note")
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()
            if k in keep}


def _hybrid(env: Env, args: list[str], steps: int | None = None,
            around: Any = None, ps: list[str] | None = None) -> dict[str, Any]:
    return train_in_process(env.ctx, [*(env.ps if ps is None else ps), *args],
                            steps or env.steps, around_train=around)


# -- a. both designs hold the tables -----------------------------------------------------

def sub_both_hold(env: Env, deadline: float) -> dict[str, Any]:
    if not env.dry_run:  # untimed: CUDA kernels, cuBLAS, the server's first run
        warm = env.job(table_rows(1e6, 16), 16, 1024)
        resident_loop(env.device, warm, 5, random_rows=True)
        _hybrid(env, [*warm, "--staleness", "1"], 5)
    out: dict[str, Any] = {"runs": {}, "ratio_vs_resident": {}}
    for dim, batch in env.shapes[:1] if env.dry_run else env.shapes:  # dry: the plumbing
        job = env.job(env.rows("both_hold_elements", dim), dim, batch)
        shape = f"dim {dim} batch {batch}"
        for optimizer in ("adam", "rowwise_adagrad"):
            opt = ["--optimizer", optimizer]
            if time.monotonic() > deadline:
                out["runs"][f"{shape} {optimizer}"] = "not run: the sub-stage's budget"
                continue
            resident = resident_loop(env.device, [*job, *opt], env.steps, random_rows=True,
                                     deadline=deadline)
            hybrid = _hybrid(env, [*job, *opt, "--staleness", "1"])
            out["runs"][f"{shape} {optimizer}"] = {"resident": _slim(resident),
                                                  "hybridps K=1": _slim(hybrid)}
            out["ratio_vs_resident"][f"{shape} {optimizer}"] = round(
                hybrid["samples_per_s"] / resident["samples_per_s"], 3)
    out["baseline"] = ("F.embedding_bag / nn.Embedding sparse=True with rows drawn on the "
                       "device; SparseAdam (adam) or the torch row kernels (rowwise_adagrad)")
    return out


# -- c. the server's threads ---------------------------------------------------------------

def sub_server_threads(env: Env, deadline: float) -> dict[str, Any]:
    from harness import Server  # bench/ is on sys.path (gpu_common)

    dim, batch = env.shapes[-1]
    job = env.job(env.rows("both_hold_elements", dim), dim, batch)
    out: dict[str, Any] = {"job": f"dim {dim} batch {batch}, K=1", "threads": {}}
    for n in DRY_THREADS if env.dry_run else THREADS:
        if time.monotonic() > deadline:
            out["threads"][str(n)] = "not run: the sub-stage's budget"
            continue
        with Server(env.work / f"ps_threads_{n}", "--update-threads", "1",
                    "--kernel-threads", str(n)) as server:
            run = _hybrid(env, [*job, "--staleness", "1"], ps=["--ps", server.address],
                          steps=DRY_STEPS if env.dry_run else THREAD_STEPS)
        fig = _slim(run)
        fig["rows_per_s_applied"] = round(run["rows_pushed_per_step"] * run["samples_per_s"]
                                          / run["batch"])
        out["threads"][str(n)] = fig
    done = {n: f for n, f in out["threads"].items() if isinstance(f, dict)}
    waited = [int(n) for n, f in done.items()
              if f["wait_ms_per_step"] > 0.02 * f["step_ms"]]
    out["waits_over_2pct_of_the_step_at_threads"] = waited
    keeps = [int(n) for n, f in done.items() if int(n) not in waited]
    out["keeps_up_from_threads"] = min(keeps) if keeps else None
    out["server"] = "--update-threads 1 --kernel-threads N"
    return out


# -- d. bf16 rows --------------------------------------------------------------------------

def bf16_supported() -> bool:
    import typing

    from worker.config.train_config import OptimConfig

    hints = typing.get_type_hints(OptimConfig)
    return "bf16" in typing.get_args(hints.get("row_dtype", str))


def sub_bf16(env: Env, deadline: float) -> dict[str, Any]:
    if not bf16_supported():
        return {"supported": False, "note": "not supported: no bf16 --row-dtype"}
    dim, batch = env.shapes[0]
    job = [*env.job(env.rows("both_hold_elements", dim), dim, batch), "--staleness", "1"]
    fp32 = _hybrid(env, job)
    bf16 = _hybrid(env, [*job, "--row-dtype", "bf16"])
    out = {"supported": True, "job": f"dim {dim} batch {batch}, K=1",
           "fp32": _slim(fp32), "bf16": _slim(bf16),
           "samples_per_s_bf16_over_fp32": round(bf16["samples_per_s"] / fp32["samples_per_s"],
                                                 3)}
    if fp32.get("gpu_peak_mib"):
        out["gpu_peak_bf16_over_fp32"] = round(bf16["gpu_peak_mib"] / fp32["gpu_peak_mib"], 3)
    return out


# -- e. dynamic tables on the device ----------------------------------------------------

def sub_dynamic(env: Env, deadline: float) -> dict[str, Any]:
    dim, batch = env.shapes[0]
    rows = env.rows("both_hold_elements", dim)
    ids = ["--num-rows", str(2 * max(rows[n] for n in DYNAMIC_TABLES)), "--pipeline", "true",
           "--staleness", "1"]
    static = _hybrid(env, [*env.job(rows, dim, batch), *ids])
    dynamic = _hybrid(env, [*env.job(rows, dim, batch, DYNAMIC_TABLES), *ids])
    return {"job": f"dim {dim} batch {batch}, K=1, --pipeline true; dynamic: "
                   f"{', '.join(DYNAMIC_TABLES)} (LRU, admit all; raw ids drawn from twice "
                   "their capacity)",
            "static": _slim(static), "dynamic": _slim(dynamic),
            "dynamic_over_static": round(dynamic["samples_per_s"] / static["samples_per_s"], 3),
            "prefetched_lookups": dynamic["pipeline"]["prefetched_lookups"],
            "device_prefetch": DEVICE_PREFETCH}


# -- f. Parquet ----------------------------------------------------------------------------

def write_parquet(env: Env, rows: dict[str, int], dim: int, batch: int, out: Path
                  ) -> tuple[str, Path]:
    """The job's REPLAY_BATCHES batches as Parquet files (two a file, a row group a
    batch) and the features JSON naming their tables; (the files' glob, the JSON)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from gpu_jobs import parse_cfg

    from worker.tasks.tables import NUM_DENSE

    cfg = parse_cfg(["--local-optimizer", *env.job(rows, dim, batch)], 1, env.device)
    task = ProductionTask(cfg)
    out.mkdir(parents=True, exist_ok=True)
    for f in range(REPLAY_BATCHES // 2):
        writer = None
        for b in (2 * f, 2 * f + 1):
            got = task.batch(b, 0, 1)
            cols: dict[str, Any] = {"label": got.values["label"].numpy()}
            for i, col in enumerate(got.values["dense"].numpy().T):
                cols[f"dense_{i}"] = col
            for name in rows:
                if name in got.ids:
                    cols[name] = got.ids[name].numpy()
                else:
                    ids_N, offsets_B = got.bags[name]
                    ends = np.append(offsets_B.numpy(), ids_N.numel()).astype(np.int32)
                    cols[name] = pa.ListArray.from_arrays(ends, ids_N.numpy())
            table = pa.table(cols)
            if writer is None:
                writer = pq.ParquetWriter(out / f"train-{f}.parquet", table.schema)
            writer.write_table(table, row_group_size=batch)
        assert writer is not None
        writer.close()
    features = out / "features.json"
    features.write_text(json.dumps({
        "label": "label", "dense": [f"dense_{i}" for i in range(NUM_DENSE)],
        "tables": [{"column": n, "rows": r, "dim": dim} for n, r in rows.items()]}))
    return str(out / "train-*.parquet"), features


def sub_parquet(env: Env, deadline: float) -> dict[str, Any]:
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        return {"note": f"not run: pyarrow does not import ({exc}); carry its wheel "
                        "(docs/gpu_check.md)"}
    dim, batch = env.shapes[0]
    rows = env.rows("both_hold_elements", dim)
    clock = Timer()
    files, features = write_parquet(env, rows, dim, batch, env.work / "parquet")
    written_s = clock()
    run = _hybrid(env, ["--task", "files", "--train-files", files, "--features", str(features),
                        "--dim", str(dim), "--batch-size", str(batch), "--shuffle-buffer", "0",
                        "--data-workers", "0" if env.dry_run else "2", "--staleness", "1"])
    fig = _slim(run)
    return {"job": f"dim {dim} batch {batch}, K=1, --task files (its MLP 64-32: not the "
                   "replayed job's model)", "files": REPLAY_BATCHES // 2,
            "rows_written": REPLAY_BATCHES * batch, "write_s": round(written_s, 1),
            "run": fig, "data_ms_per_step": fig.get("step_time_ms", {}).get("data"),
            "copies": "Batch.to: pinned host buffers, non-blocking (worker/runtime/"
                      "device_copy.py to_device)"}


# -- g. torch.profiler ---------------------------------------------------------------------

def profile_summary(prof: Any, top: int = 10) -> dict[str, Any]:
    """The top ops by self time on the host and on the device, the device's kernels, and
    the gaps between consecutive kernels (the device idle, waiting for the host)."""
    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", None)
                     or getattr(e, "self_cuda_time_total", 0) or 0)

    averages = prof.key_averages()
    host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:top]
    dev = sorted(averages, key=lambda e: -device_us(e))[:top]
    out: dict[str, Any] = {
        "top_host_ops_ms": {e.key[:80]: round(e.self_cpu_time_total / 1000, 3) for e in host},
        "top_device_ops_ms": {e.key[:80]: round(device_us(e) / 1000, 3) for e in dev
                              if device_us(e) > 0}}
    kernels = sorted((e for e in prof.events()
                      if str(getattr(e, "device_type", "")).endswith("CUDA")),
                     key=lambda e: e.time_range.start)
    if not kernels:
        out["device_gaps"] = None
        out["note"] = "no device kernels (the CPU)"
        return out
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    gaps = [b.time_range.start - a.time_range.end for a, b in itertools.pairwise(kernels)]
    gaps = [g for g in gaps if g > 0]
    gaps.sort(reverse=True)
    out["device_gaps"] = {
        "kernels": len(kernels), "span_ms": round(span / 1000, 3),
        "busy_share": round(busy / span, 3) if span else None,
        "idle_ms": round(sum(gaps) / 1000, 3),
        "gaps_over_100us": sum(g > 100 for g in gaps),
        "largest_gaps_us": [round(g, 1) for g in gaps[:top]]}
    by_kernel: dict[str, float] = {}
    for e in kernels:
        by_kernel[e.name[:80]] = by_kernel.get(e.name[:80], 0.0) + (
            e.time_range.end - e.time_range.start)
    out["top_kernels_ms"] = {k: round(v / 1000, 3) for k, v in
                             sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]}
    return out


def sub_profile(env: Env, deadline: float) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    dim, batch = env.shapes[0]
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
    prof = profile(activities=activities)
    run = _hybrid(env, [*env.job(env.rows("both_hold_elements", dim), dim, batch),
                        "--staleness", "1"], steps=DRY_STEPS if env.dry_run else 8,
                  around=prof)
    return {"job": f"dim {dim} batch {batch}, K=1, {run['steps']} steps profiled (from "
                   "the first: the first step's allocations included)",
            "run": _slim(run), **profile_summary(prof)}


# -- b. larger than the resident design holds ------------------------------------------

def host_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def sub_larger(env: Env, deadline: float) -> dict[str, Any]:
    dim, batch = env.shapes[0]
    rows = env.rows("larger_elements", dim)
    elements = sum(rows.values()) * dim
    job = env.job(rows, dim, batch)
    out: dict[str, Any] = {"job": f"dim {dim} batch {batch}, K=1", "elements": elements,
                           "hybridps_rows_gib": round(elements * HYBRID_BYTES / GIB, 2),
                           "resident_needs_gib": round(elements * RESIDENT_BYTES / GIB, 2),
                           "cap_gib": env.sizes["cap_gib"]}
    need = elements * 8  # the server's m and v
    have = host_available_bytes()
    out["host_available_gib"] = None if have is None else round(have / GIB, 1)
    if have is not None and have < need * 1.15:
        out["note"] = (f"not run: the server's Adam state needs {need / GIB:.1f} GiB of host "
                       f"memory, {have / GIB:.1f} GiB available")
        return out
    if env.device.type == "cuda":
        try:
            resident_loop(env.device, job, 2, random_rows=True)
            out["resident"] = "FITS: the bound cap / 12 bytes was wrong"
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError, or a library's failed
            # allocation (cuBLAS' workspace) saying so in its own words
            kind = "out of memory, as expected" if isinstance(
                exc, torch.cuda.OutOfMemoryError) else f"failed ({type(exc).__name__})"
            out["resident"] = f"{kind}: {str(exc).splitlines()[0][:200]}"
        gc.collect()
        torch.cuda.empty_cache()
    else:
        out["resident"] = ("dry run: needs "
                           f"{elements * RESIDENT_BYTES / 2**20:.1f} MiB > the pretend cap")
    clock = Timer()
    run = _hybrid(env, [*job, "--staleness", "1"], steps=DRY_STEPS if env.dry_run else 12)
    out["wall_s"] = round(clock(), 1)
    out["hybridps K=1"] = _slim(run)
    if env.device.type == "cuda":
        out["max_memory_allocated_gib"] = round(
            torch.cuda.max_memory_allocated(env.device) / GIB, 2)
    return out


SUBSTAGE_RUNS: dict[str, Callable[[Env, float], dict[str, Any]]] = {
    "a_both_hold": sub_both_hold, "c_server_threads": sub_server_threads, "d_bf16": sub_bf16,
    "e_dynamic": sub_dynamic, "f_parquet": sub_parquet, "g_profile": sub_profile,
    "b_larger": sub_larger}


# -- on paper --------------------------------------------------------------------------------

def paper(world: int = 8) -> dict[str, Any]:
    """All_to_all bytes a rank sends a step at `world` GPUs (every id distinct: the upper
    bound), for each shape of the job."""
    out = {}
    for dim, batch in SHAPES:
        a2a = a2a_bytes_per_step(batch, dim, world)
        out[f"dim {dim} batch {batch}"] = {
            **{k: round(v / 2**20, 1) for k, v in a2a.items()},
            "bag_tables_pooled_at_owner_mib": round(
                owner_pooled_bag_bytes(batch, dim, world) / 2**20, 1)}
    return {"world": world, "a2a_mib_per_rank_step_upper_bound": out}


# -- the stage ---------------------------------------------------------------------------------

def cap_device(device: torch.device) -> int:
    """Bytes of the emulated device: CAP_GIB on CUDA (the caching allocator's limit, from
    the device's total), the dry run's pretend device on the CPU."""
    if device.type != "cuda":
        return DRY_CAP_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, CAP_GIB * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return int(total * fraction)


def stage_production_job(rep: StageReport, dry_run: bool, work: Path, limit_s: float) -> None:
    from harness import Server

    from worker.runtime.dist import destroy_distributed, init_distributed

    device = pick_device(dry_run)
    scale = 3 if dry_run else 1
    deadline = time.monotonic() + (limit_s or STAGE_LIMIT_S * scale) - 5
    cap = cap_device(device)
    sizes = sizes_from_cap(cap)
    rep.set(device=str(device), cap=sizes, emulated=f"{CAP_GIB:g} GiB" if device.type == "cuda"
            else "dry run: a pretend device of 24 MiB (nothing capped)",
            shapes=DRY_SHAPES if dry_run else SHAPES, paper=paper(), substages={})
    results: dict[str, Any] = {}
    ctx = init_distributed(device.type)
    try:
        with Server(work / "ps_production") as server:
            env = Env(ctx, device, ["--ps", server.address], dry_run, work, sizes)
            names = list(SUBSTAGES)
            for i, name in enumerate(names):
                what, budget, least = SUBSTAGES[name]
                reserved = sum(SUBSTAGES[n][2] for n in names[i + 1:])
                left = deadline - time.monotonic()
                allowed = min(budget * scale, left - reserved)
                if allowed < least:
                    results[name] = {"ok": False, "what": what, "error": (
                        f"not run: {left:.0f}s of the stage left, {reserved}s kept for the "
                        "sub-stages after it")}
                    rep.set(substages=results)
                    continue
                log(f"[production_job.{name}] {what} (budget {allowed:.0f}s)")
                clock = Timer()
                try:
                    fig = SUBSTAGE_RUNS[name](env, time.monotonic() + allowed)
                    results[name] = {"ok": True, "what": what, **fig}
                except Exception as exc:
                    traceback.print_exc()
                    results[name] = {"ok": False, "what": what,
                                     "error": f"{type(exc).__name__}: {exc}"[:1500]}
                results[name].update(seconds=round(clock(), 1), budget_s=round(allowed))
                if results[name]["seconds"] > allowed:
                    results[name]["over_budget"] = True
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rep.set(substages=results)
    finally:
        destroy_distributed()
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    bad = [f"{n}: {r['error']}" for n, r in results.items() if not r["ok"]]
    rep.finish(not bad, "; ".join(bad)[:2000] or None)
