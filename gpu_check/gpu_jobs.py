"""Stages b and c of gpu_check/check.py: the default job on one GPU rank against the same
model with its rows AND Adam state on the GPU, and the largest table a GPU budget holds.

b. `default_job`: hybridps (one rank, this process, a shard server on this machine) at
   --staleness 0, 1, 2 with fp32 rows and at 1 with bf16 rows, next to the plain loop with
   everything on the GPU (tests/testing/reference_trainer.py's LocalEmbedding, i.e. nn.Embedding /
   F.embedding_bag with sparse=True, + torch.optim.SparseAdam, the same dense model and
   Adam, the same batches). Samples/s; the time the step waited for updates; GPU bytes
   per embedding element = (torch.cuda.max_memory_allocated - the dense part) / the
   tables' elements, the dense part being its parameters, their gradients and Adam's two
   moments (so activations and a step's gradients count against the tables: an upper
   bound). Repeats interleave the variants; the median run of each is reported.
c. `table_budget`: per design, the most rows of width D whose training step runs inside a
   fixed GPU budget (torch.cuda.set_per_process_memory_fraction; OutOfMemoryError = does
   not fit), found by bisection: hybridps keeps the rows (fp32 or bf16) on the GPU and its
   step sends the gradients to the host and applies an update from it
   (worker/runtime/device_copy.py); the plain design keeps rows, m and v (SparseAdam). On the
   CPU (dry run) a table "fits" when its rows and state take at most the budget.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gpu_common import StageReport, Timer, log, pick_device, sync
from torch import nn

BASELINE = "sparse_adam (rows + Adam on the GPU)"


def parse_cfg(args: Sequence[str], steps: int, device: torch.device) -> Any:
    from hybridps.cli import parse_config
    from worker.config.task_defaults import task_defaults
    from worker.config.train_config import TrainConfig

    return parse_config(TrainConfig, [*args, "--steps", str(steps), "--progress", "false",
                                      "--eval-batches", "1", "--log-every", "50",
                                      "--device", device.type],
                        defaults=task_defaults, environ={})


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def dense_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, as many bytes of their gradients, and the optimizer's state tensors."""
    params = list(module.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return 2 * _bytes(params) + _bytes(state)


class GpuMemory:
    """Peak and held bytes on the device since `start()`, less a baseline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            gc.collect()  # a previous run's trainer (reference cycles) frees its tensors
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def figures(self, elements: int, dense: int) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {"gpu_bytes_per_element": None, "embedding_elements": elements,
                    "note": "no GPU memory on the CPU"}
        peak = torch.cuda.max_memory_allocated(self.device) - self.base
        held = torch.cuda.memory_allocated(self.device) - self.base
        return {"gpu_peak_mib": round(peak / 2**20, 1), "dense_mib": round(dense / 2**20, 2),
                "gpu_peak_bytes": peak, "embedding_elements": elements,
                "gpu_bytes_per_element": round((peak - dense) / elements, 3),
                "held_bytes_per_element": round((held - dense) / elements, 3)}


def train_in_process(ctx: Any, args: Sequence[str], steps: int,
                     around_train: Any = None) -> dict[str, Any]:
    """worker/train/trainer.py's Trainer on `ctx` (a world of one), `around_train` (a context
    manager) around its loop; what a run reports, with the GPU memory it took."""
    from worker.train.trainer import Trainer

    cfg = parse_cfg(args, steps, ctx.device)
    memory = GpuMemory(ctx.device)
    memory.start()
    trainer = Trainer(cfg, ctx)
    try:
        with around_train if around_train is not None else contextlib.nullcontext():
            trainer.train()
        sync(ctx.device)
        st = trainer.window.stats
        ran = trainer.last_step + 1 - trainer.start_step
        elements = sum(w.numel() for w in trainer.embedding.weights.values())
        out = {"steps": ran, "batch": cfg.run.batch_size,
               "samples_per_s": ran * cfg.run.batch_size / trainer.record.train_s,
               "step_ms": trainer.record.train_s / ran * 1000, "wait_s": st.wait_s,
               "waits": st.waits,
               "wait_ms_per_step": st.wait_s / ran * 1000,
               "rows_pushed_per_step": trainer.source.stats.push_rows / ran,
               "step_time_ms": {k: round(v / ran * 1000, 3)
                                for k, v in trainer.record.times.items()},
               "pipeline": trainer.inputs.describe(),
               **memory.figures(elements, dense_bytes(trainer.dense_parallel.module,
                                                      trainer.dense_opt))}
        trainer.source.end_run(trainer.last_step)
        return out
    finally:
        trainer.close()


def resident_loop(device: torch.device, args: Sequence[str], steps: int,
                  random_rows: bool = False, deadline: float | None = None
                  ) -> dict[str, Any]:
    """The same model with rows AND optimizer state on the device: the reference's sparse
    optimizer of --optimizer on the rows (SparseAdam for adam; rowwise_adagrad: the torch
    row kernels, tests/testing/reference_trainer.py), the worker's dense optimizer, this
    rank's batches of the task, its loss logged as often. `deadline` (time.monotonic()):
    the loop stops there, and says after how many steps."""
    import time

    from tests.testing.reference_trainer import LocalEmbedding, make_sparse_optimizer
    from worker.dense.optimizer import make_dense_optimizer
    from worker.tasks import build_task
    from worker.tasks.base import HybridModel, build_dense_seeded

    cfg = parse_cfg(["--local-optimizer", *args], steps, device)
    task = build_task(cfg)
    memory = GpuMemory(device)
    memory.start()
    if random_rows:  # only the speed matters: rows drawn on the device, not made on the host
        emb = LocalEmbedding([], seed=0, init_std=1.0, device=device)
        for t in task.tables():
            emb.tables[t.name] = nn.Embedding(t.num_rows, t.dim, sparse=True, device=device)
    else:
        emb = LocalEmbedding(task.tables(), seed=cfg.run.seed, init_std=cfg.optim.init_std,
                             device=device)
    dense = build_dense_seeded(task, cfg.run.seed).to(device)
    model = HybridModel(emb, dense)
    sparse_opt = make_sparse_optimizer(cfg, list(emb.parameters()))
    dense_opt = make_dense_optimizer(cfg.optim, dense.parameters())
    window_loss = torch.zeros((), device=device)
    clock = Timer()
    ran = 0
    for step in range(steps):
        if deadline is not None and step and time.monotonic() > deadline:
            break
        ran += 1
        batch = task.batch(step, 0, 1).to(device)
        loss = task.loss(model, batch)
        loss.backward()
        dense_opt.step()
        sparse_opt.step()
        dense_opt.zero_grad(set_to_none=True)
        sparse_opt.zero_grad(set_to_none=True)
        window_loss += loss.detach()
        if (step + 1) % cfg.output.log_every == 0:
            float(window_loss)
            window_loss.zero_()
    sync(device)
    train_s = clock()
    elements = sum(p.numel() for p in emb.parameters())
    return {"steps": ran, "batch": cfg.run.batch_size,
            "samples_per_s": ran * cfg.run.batch_size / train_s,
            "step_ms": train_s / ran * 1000, "wait_s": 0.0, "waits": 0,
            "wait_ms_per_step": 0.0,
            **memory.figures(elements, dense_bytes(dense, dense_opt))}


# -- b. the default job --------------------------------------------------------------------

def stage_default_job(rep: StageReport, dry_run: bool, work: Path) -> None:
    from harness import Server

    from worker.runtime.dist import destroy_distributed, init_distributed

    device = pick_device(dry_run)
    steps, repeats = (10, 1) if dry_run else (300, 3)  # 3: a median, not the lower of 2
    job = ["--num-rows", "5000"] if dry_run else []  # else the default job as it is
    rep.set(job=job or "the default job (synthetic task, 4 tables, batch 256, dim 16)",
            steps=steps, repeats=repeats, device=str(device))
    ctx = init_distributed(device.type)
    try:
        with Server(work / "ps_default_job") as server:
            ps = ["--ps", server.address]
            variants: dict[str, list[str] | None] = {
                BASELINE: None,
                "hybridps fp32 K=0": [*ps, "--staleness", "0"],
                "hybridps fp32 K=1": [*ps, "--staleness", "1"],
                "hybridps fp32 K=2": [*ps, "--staleness", "2"],
                "hybridps bf16 K=1": [*ps, "--staleness", "1", "--row-dtype", "bf16"],
            }
            if not dry_run:
                log("warm-up: CUDA kernels, cuBLAS, the server")  # untimed, not reported
                resident_loop(device, job, 20)
                train_in_process(ctx, [*ps, "--staleness", "1", *job], 20)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
            for i in range(repeats):
                for name, args in variants.items():
                    log(f"{name} ({i + 1}/{repeats})")
                    res = (resident_loop(device, job, steps) if args is None
                           else train_in_process(ctx, [*args, *job], steps))
                    runs[name].append(res)
                    rep.set(variants=_medians(runs))
            rep.set(**_paired_ratios(runs))
            sizes = (5000, 10000) if dry_run else (1_000_000, 2_000_000)
            rep.set(marginal_bytes_per_element=marginal_bytes(
                ctx, device, variants, sizes, 5 if dry_run else 30),
                    marginal_between_num_rows=sizes)
    finally:
        destroy_distributed()
    rep.finish(True)


def marginal_bytes(ctx: Any, device: torch.device, variants: dict[str, list[str] | None],
                   sizes: tuple[int, int], steps: int) -> dict[str, float | None]:
    """GPU bytes per embedding element as the tables' own cost: the growth of
    torch.cuda.max_memory_allocated from the job at --num-rows sizes[0] to sizes[1] over
    the growth of its elements (the dense part, activations and a step's working set do
    not grow with the tables, so they drop out). None on the CPU."""
    out: dict[str, float | None] = {}
    for name in (BASELINE, "hybridps fp32 K=1", "hybridps bf16 K=1"):
        args = variants[name]
        runs = []
        for rows in sizes:
            size = ["--num-rows", str(rows)]
            runs.append(resident_loop(device, size, steps) if args is None
                        else train_in_process(ctx, [*args, *size], steps))
        grown = runs[1]["embedding_elements"] - runs[0]["embedding_elements"]
        peaks = [r.get("gpu_peak_bytes") for r in runs]
        out[name] = (None if peaks[0] is None or peaks[1] is None or grown <= 0
                     else round((peaks[1] - peaks[0]) / grown, 3))
        log(f"{name}: {out[name]} GPU bytes per element")
    return out


def _paired_ratios(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each variant's samples/s over the baseline's of the same repeat (run back to back),
    and the median of those per variant: the machine's drift between repeats cancels."""
    base = [r["samples_per_s"] for r in runs[BASELINE]]
    each = {name: [round(r["samples_per_s"] / b, 3) for r, b in zip(tried, base, strict=True)]
            for name, tried in runs.items()}
    return {"samples_per_s_vs_sparse_adam": {n: statistics.median(v) for n, v in each.items()},
            "samples_per_s_vs_sparse_adam_repeats": each}


def _medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each variant's median run (by samples/s), with every repeat's samples/s."""
    out = {}
    for name, tried in runs.items():
        if not tried:
            continue
        ordered = sorted(tried, key=lambda r: r["samples_per_s"])
        pick = dict(ordered[(len(ordered) - 1) // 2])
        pick["repeats_samples_per_s"] = [round(r["samples_per_s"]) for r in tried]
        out[name] = {k: round(v, 3) if isinstance(v, float) else v for k, v in pick.items()}
    return out


# -- c. the largest table in a GPU budget ------------------------------------------------

DESIGNS = {"hybridps fp32": (torch.float32, 4), "hybridps bf16": (torch.bfloat16, 2),
           "sparse_adam": (torch.float32, 12)}  # row dtype, guessed bytes per element
IDS_PER_STEP = 4096


def one_design_step(design: str, rows: int, dim: int, device: torch.device) -> None:
    """Two training steps of one table with the design's GPU memory: its rows (and for
    sparse_adam its m and v), a lookup of IDS_PER_STEP ids, the sparse gradient and, for
    hybridps, the gradients' copy to the host and an update back."""
    from hybridps.optim import apply_update_
    from worker.runtime.device_copy import grads_to_host, to_device

    dtype, _ = DESIGNS[design]
    weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype, device=device).normal_())
    opt = (torch.optim.SparseAdam([weight], lr=1e-3) if design == "sparse_adam" else None)
    gen = torch.Generator(device=device).manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, rows, (IDS_PER_STEP,), device=device, generator=gen)
        F.embedding(ids, weight, sparse=True).float().square().mean().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
            continue
        assert weight.grad is not None
        grad = weight.grad.coalesce()
        weight.grad = None
        host = grads_to_host({"t": (grad.indices()[0], grad.values().float())})
        host.wait()
        ids_U, grads_UD = host.grads["t"]
        with torch.no_grad():
            apply_update_(weight.data, to_device(ids_U, device),
                          to_device(grads_UD * -1e-3, device), 1.0)
    sync(device)


def fits(design: str, rows: int, dim: int, budget: int, device: torch.device) -> bool:
    if device.type != "cuda":
        held = rows * dim * (DESIGNS[design][1])
        if held > budget:
            return False
        one_design_step(design, rows, dim, device)
        return True
    torch.cuda.empty_cache()
    try:
        one_design_step(design, rows, dim, device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def largest_rows(design: str, dim: int, budget: int, device: torch.device) -> tuple[int, int]:
    """(the most rows that fit, tries): up by 1.25x from the guess until one does not fit,
    then bisection to within 0.5%."""
    n = budget // (DESIGNS[design][1] * dim)
    lo, hi, tries = 0, None, 0
    while tries < 24:
        tries += 1
        if fits(design, n, dim, budget, device):
            lo = n
        else:
            hi = n
        if hi is None:
            n = int(n * 1.25)
        elif hi - lo <= max(lo // 200, 64):
            break
        else:
            n = (lo + hi) // 2
    return lo, tries


def stage_table_budget(rep: StageReport, dry_run: bool) -> None:
    device = pick_device(dry_run)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = min(8 << 30, int(total * 0.8))
        torch.cuda.set_per_process_memory_fraction(budget / total, device)
    else:
        budget = 16 << 20
    dims = [16] if dry_run else [16, 64]
    rep.set(budget_gib=round(budget / 2**30, 3), ids_per_step=IDS_PER_STEP,
            measured_by="the CUDA caching allocator's limit" if device.type == "cuda"
            else "dry run: rows and state bytes against the budget")
    out: dict[str, dict[str, Any]] = {}
    try:
        for dim in dims:
            out[str(dim)] = {}
            for design in DESIGNS:
                clock = Timer()
                rows, tries = largest_rows(design, dim, budget, device)
                out[str(dim)][design] = {
                    "rows": rows, "rows_per_gib": round(rows / (budget / 2**30)),
                    "bytes_per_element": round(budget / max(rows * dim, 1), 3),
                    "tries": tries, "seconds": round(clock(), 1)}
                rep.set(dims=out)
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    rep.set(rows_vs_sparse_adam={
        dim: {d: round(v["rows"] / max(found["sparse_adam"]["rows"], 1), 3)
              for d, v in found.items()} for dim, found in out.items()})
    empty = [f"{d} at dim {dim}" for dim, found in out.items() for d, v in found.items()
             if v["rows"] == 0]
    rep.finish(not empty, f"no table fits the budget: {', '.join(empty)}" if empty else None)
