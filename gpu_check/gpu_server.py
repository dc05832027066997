"""Stage d of gpu_check/check.py: does the node's shard server keep up with a GPU step?

On this host, the server's row kernel (hybridps.optim.apply_rows_, native when built, with
check_finite as the server runs it, on state laid out like the server's) at 1, 2, 4, 8 and
16 threads:
- rows/s at dim 64 and 128 on batches of BATCH_ROWS distinct rows of a TABLE_ROWS table;
- for two jobs, the default one and a DLRM-shaped one (26 tables, dim 64, batch 2048), the
  time to apply one step's real pushes (the coalesced gradients of the job's own batches,
  from a CPU forward/backward of the real model), as rows/s;
next to the rows/s a GPU step asks for: the distinct rows a step pushes times the steps/s
of the same job with rows AND Adam state on the GPU (gpu_jobs.resident_loop; the speed a
GPU user has without hybridps). The server keeps up from the fewest threads whose rows/s
reach it. The kernel alone: decoding, the wire and the answers are not in these numbers
(stage b's wait time shows them end to end).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from gpu_common import StageReport, Timer, log, pick_device
from gpu_jobs import parse_cfg, resident_loop

JOBS = {"default job": [],
        "DLRM-shaped": ["--task", "dlrm", "--table-rows", "200000", "--dim", "64",
                        "--batch-size", "2048"]}
DRY_JOBS = {"default job": ["--num-rows", "5000"],
            "DLRM-shaped": ["--task", "dlrm", "--table-rows", "1000", "--dim", "16",
                            "--batch-size", "256"]}
TABLE_ROWS, BATCH_ROWS = 1_000_000, 16384
SAMPLED_STEPS = 6


def job_pushes(args: list[str], steps: int) -> tuple[list[Any], dict[str, tuple[int, int]]]:
    """The pushes of the job's first `steps` steps on one rank (CPU forward/backward of the
    real model), and each unit's (rows, dim)."""
    from worker.embedding.sharded import ShardedEmbedding
    from worker.tasks import build_task
    from worker.tasks.base import HybridModel, build_dense_seeded

    cfg = parse_cfg(["--local-optimizer", *args], steps, torch.device("cpu"))
    task = build_task(cfg)
    emb = ShardedEmbedding(task.tables(), device="cpu", seed=cfg.run.seed,
                           init_std=cfg.optim.init_std)
    model = HybridModel(emb, build_dense_seeded(task, cfg.run.seed))
    pushes = []
    for step in range(steps):
        task.loss(model, task.batch(step, 0, 1)).backward()
        pushes.append(emb.pop_grads())
        model.dense.zero_grad(set_to_none=True)
    units = {name: (u.rows, u.dim) for name, u in emb.units.items()}
    return pushes, units


def server_step_rates(pushes: list[Any], units: dict[str, tuple[int, int]],
                      threads: list[int], rounds: int) -> dict[int, float]:
    """Threads -> steps/s applying each sampled step's pushes (median over the steps of
    the best of `rounds`)."""
    from hybridps.optim import OptimizerSpec, apply_rows_
    from hybridps.state_alloc import STATE_OFFSETS, alloc_state

    spec = OptimizerSpec("adam", lr=1e-3)
    state = {name: (alloc_state(r, d, offset=STATE_OFFSETS["m"]),
                    alloc_state(r, d, offset=STATE_OFFSETS["v"])) for name, (r, d) in
             units.items()}
    widest = max(int(g.numel()) for p in pushes for _, g in p.values())
    out = torch.empty(max(widest, 1))
    count = 0
    rates = {}
    for nt in threads:
        per_step = []
        for push in pushes:
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                for name, (ids_U, grads_UD) in push.items():
                    count += 1
                    m, v = state[name]
                    apply_rows_(spec, m, v, ids_U, grads_UD, count, out=out, num_threads=nt,
                                check_finite=True)
                best = min(best, time.perf_counter() - t0)
            per_step.append(best)
        rates[nt] = 1.0 / statistics.median(per_step)
    return rates


def kernel_rows_per_s(dim: int, table_rows: int, batch: int, threads: list[int],
                      calls: int) -> dict[int, float]:
    from hybridps.optim import OptimizerSpec, apply_rows_
    from hybridps.state_alloc import STATE_OFFSETS, alloc_state

    spec = OptimizerSpec("adam", lr=1e-3)
    m = alloc_state(table_rows, dim, offset=STATE_OFFSETS["m"])
    v = alloc_state(table_rows, dim, offset=STATE_OFFSETS["v"])
    gen = torch.Generator().manual_seed(0)
    grads = torch.empty(batch, dim).uniform_(-0.01, 0.01, generator=gen)
    out = torch.empty(batch * dim)
    step = 0
    rates = {}
    for nt in threads:
        times = []
        for _ in range(calls + 1):
            ids = torch.randperm(table_rows, generator=gen)[:batch].sort().values
            step += 1
            t0 = time.perf_counter()
            apply_rows_(spec, m, v, ids, grads, step, out=out, num_threads=nt,
                        check_finite=True)
            times.append(time.perf_counter() - t0)
        rates[nt] = batch / statistics.median(times[1:])  # the first warms the pool up
    return rates


def stage_server_threads(rep: StageReport, dry_run: bool, work: Any) -> None:
    from hybridps.optim import kernel_name

    device = pick_device(dry_run)
    threads = [1, 2] if dry_run else [1, 2, 4, 8, 16]
    jobs = DRY_JOBS if dry_run else JOBS
    rep.set(kernel=kernel_name(), threads=threads, device=str(device))
    generic: dict[str, dict[str, float]] = {}
    table_rows, batch = (20_000, 1024) if dry_run else (TABLE_ROWS, BATCH_ROWS)
    for dim in (64, 128):
        clock = Timer()
        rates = kernel_rows_per_s(dim, table_rows, batch, threads, 3 if dry_run else 20)
        generic[str(dim)] = {str(nt): round(r) for nt, r in rates.items()}
        log(f"kernel dim {dim}: {generic[str(dim)]} rows/s ({clock():.1f}s)")
        rep.set(kernel_rows_per_s=generic, kernel_batch_rows=batch,
                kernel_table_rows=table_rows)
    verdicts: dict[str, Any] = {}
    for job, args in jobs.items():
        clock = Timer()
        pushes, units = job_pushes(args, 2 if dry_run else SAMPLED_STEPS)
        rows_per_step = statistics.mean(sum(int(i.numel()) for i, _ in p.values())
                                        for p in pushes)
        gpu = resident_loop(device, args, 5 if dry_run else 80, random_rows=True)
        needed = rows_per_step * gpu["samples_per_s"] / gpu["batch"]
        rates = server_step_rates(pushes, units, threads, 1 if dry_run else 3)
        served = {str(nt): round(r * rows_per_step) for nt, r in rates.items()}
        enough = [nt for nt in threads if rates[nt] * rows_per_step >= needed]
        top = threads[-1]
        verdicts[job] = {
            "args": args, "dims": sorted({d for _, d in units.values()}),
            "rows_pushed_per_step": round(rows_per_step),
            "gpu_steps_per_s": round(gpu["samples_per_s"] / gpu["batch"], 1),
            "gpu_rows_per_s_needed": round(needed),
            "server_rows_per_s": served,
            "keeps_up_from_threads": enough[0] if enough else None,
            f"served_over_needed_at_{top}": round(rates[top] * rows_per_step / needed, 2),
            "seconds": round(clock(), 1)}
        log(f"{job}: {verdicts[job]}")
        rep.set(jobs=verdicts)
    rep.finish(True)
