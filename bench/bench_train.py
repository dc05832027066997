"""Training throughput: plain PyTorch vs hybridps, async overhead, cost growth.

    python bench/bench_train.py                  # full run
    python bench/bench_train.py --quick          # fewer steps, growth to 10M rows
    python bench/bench_train.py --json runs/bench/bench_train.json

Side by side in one run, for two configurations, the default job (synthetic task, 4
tables, batch 256 per rank) and a TorchRec-like one (`--task tables --dim 64
--batch-size 1024`: one 1M x 64 table, batch 1024 per rank):
  (a) plain: one process, nn.EmbeddingBag(sparse=True) per table + torch.optim.SparseAdam,
      the same dense model + torch.optim.Adam, the same GLOBAL batches (2 x per-rank
      batch) from the same task; run with 1 thread and with all cores, the faster counts;
  (b) server: hybridps on 2 gloo ranks (torchrun, OMP_NUM_THREADS=1 each) with a real
      shard server (`python -m ps --port 0`) at --staleness 1;
  (c) local: hybridps on 2 ranks with --local-optimizer at --staleness 1;
  (d) server-pipe-on|off: (b) with the config's --pipeline default flipped (off by
      default: server-pipe-on), to show what the pipeline gains;
  (e) local-one-rank: hybridps on ONE rank (no collectives) with --local-optimizer at
      --staleness 0 (the plain loop's synchronous math) on the same global batches.
Goal 3: samples/s server / plain >= 1.0. Goal 4: step time server / local <= 1.05.
Goal 8: samples/s (e) / plain >= 0.9: world size 1 costs (almost) nothing.
Goal 6: step time of (b) on `--task tables --dim 16 --batch-size 1024` with a table of 50M
rows over one of 1M rows < 1.10 (--quick: 10M rows). Both draw ids from the same Zipf law
over 1M popularity ranks, scattered over the whole table (`--zipf-rows`,
--growth-zipf-rows), so a step touches the same distinct rows at either size and only the
table grows; the distinct ids a step are printed for both (--growth-zipf-rows 0: the
Zipf law over each whole table, which touches more distinct rows at 50M).
Step times are wall time over all steps / steps (setup excluded, the same for every
variant); the hybridps breakdown (rank 0, ms per step) comes from the worker's results
JSON: apply (staleness window), data, forward, a2a (embedding all_to_alls on the
training thread), backward, optimizer (dense step + gradient pop), push. Extra worker
flags go after `--` (e.g. `-- --dense-parallel ddp`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import (  # bench/ is sys.path[0] when run as a script
    REPO,
    CpuSampler,
    Server,
    bench_parser,
    log,
    machine,
    median_of,
    run_worker,
    write_json,
)

if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import torch
import torch.nn.functional as F
from torch import nn

from hybridps.cli import parse_config
from worker.config.task_defaults import task_defaults
from worker.config.train_config import TrainConfig
from worker.embedding.rows import TableConfig, init_rows
from worker.tasks import build_task
from worker.tasks.base import HybridModel, build_dense_seeded

GOAL_VS_PLAIN = 1.0
GOAL_ASYNC = 1.05
GOAL_GROWTH = 1.10
GOAL_ONE_RANK = 0.9
WORLD = 2
CONFIGS: dict[str, list[str]] = {
    "default": [],
    "torchrec": ["--task", "tables", "--dim", "64", "--batch-size", "1024"],
}
GROWTH = ["--task", "tables", "--dim", "16", "--batch-size", "1024"]
DISTINCT_ID_BATCHES = 20
BREAKDOWN = ("apply", "data", "forward", "a2a", "backward", "optimizer", "push")


@dataclass
class Run:
    config: str
    variant: str  # plain | server | local | growth-<rows>
    steps: int
    global_batch: int
    samples_per_s: float
    step_ms: float
    breakdown_ms: dict[str, float] = field(default_factory=dict)
    eval_loss: float | None = None
    wall_s: float = 0.0
    repeats_step_ms: list[float] = field(default_factory=list)
    cpu_ms: float | None = None         # rank 0's process CPU a training step (all threads)
    server_cpu_ms: float | None = None  # the shard server's CPU a step, over the whole run
    ranks_cpu_ms: float | None = None   # every rank's CPU a training step, summed (/proc)


# -- (a) plain single-process PyTorch -------------------------------------------------------

class PlainEmbedding(nn.Module):
    """nn.EmbeddingBag(sparse=True) per table behind the lookups API the tasks call."""

    def __init__(self, tables: list[TableConfig], seed: int, init_std: float) -> None:
        super().__init__()
        self.bags = nn.ModuleDict({
            t.name: nn.EmbeddingBag(t.num_rows, t.dim, mode="sum", sparse=True,
                                    _weight=init_rows(t.num_rows, t.dim, 0, t.num_rows,
                                                      seed=seed, table_index=i,
                                                      init_std=init_std))
            for i, t in enumerate(tables)})

    def lookup(self, name: str, ids_N: torch.Tensor) -> torch.Tensor:
        flat = ids_N.reshape(-1)  # bags of one id: an embedding lookup
        rows = self.bags[name](flat, torch.arange(flat.numel()))
        return rows.reshape(*ids_N.shape, -1)

    def lookup_bag(self, name: str, ids_N: torch.Tensor, offsets_B: torch.Tensor,
                   mode: str = "sum") -> torch.Tensor:
        bag = self.bags[name]
        assert isinstance(bag, nn.EmbeddingBag)
        return F.embedding_bag(ids_N, bag.weight, offsets_B, mode=mode, sparse=True)

    def lookup_many(self, names: list[str], ids: list[torch.Tensor],
                    bags: list[tuple[torch.Tensor, str] | None] | None = None
                    ) -> list[torch.Tensor]:
        bags = bags if bags is not None else [None] * len(names)
        return [self.lookup(n, i) if b is None else self.lookup_bag(n, i, *b)
                for n, i, b in zip(names, ids, bags, strict=True)]


def worker_config(worker_args: list[str]) -> TrainConfig:
    return parse_config(TrainConfig, [*worker_args, "--local-optimizer"],
                        defaults=task_defaults)


def run_plain(name: str, worker_args: list[str], steps: int) -> Run:
    """The faster of 1 thread and all threads (tiny ops: extra threads often only cost).

    The all-threads run stops after 3x the 1-thread run's time: on a loaded machine OpenMP
    threads that spin for a core can make it many times slower, and it is then not the
    faster."""
    runs = [_plain_once(name, worker_args, steps, 1)]
    if (os.cpu_count() or 1) > 1:
        runs.append(_plain_once(name, worker_args, steps, os.cpu_count() or 1,
                                max_s=3 * runs[0].wall_s))
    best = min(runs, key=lambda r: r.step_ms)
    best.repeats_step_ms = [r.step_ms for r in runs]
    return best


def _plain_once(name: str, worker_args: list[str], steps: int, threads: int,
                max_s: float = float("inf")) -> Run:
    cfg = worker_config(worker_args)
    torch.set_num_threads(threads)
    task = build_task(cfg)
    emb = PlainEmbedding(task.tables(), cfg.run.seed, cfg.optim.init_std)
    dense = build_dense_seeded(task, cfg.run.seed)
    model = HybridModel(emb, dense)
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=cfg.optim.lr)
    dense_opt = torch.optim.Adam(dense.parameters(), lr=cfg.optim.dense_lr)
    times = dict.fromkeys(("data", "forward", "backward", "optimizer"), 0.0)
    start = time.perf_counter()
    done = 0
    for step in range(steps):
        if step >= 20 and time.perf_counter() - start > max_s:
            break
        done += 1
        t0 = time.perf_counter()
        batch = task.global_batch(step, WORLD)
        t1 = time.perf_counter()
        loss = task.loss(model, batch)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[key] += dt
    wall = time.perf_counter() - start
    with torch.no_grad():  # the held-out batch hybridps evaluates (--eval-batches 1)
        parts = [task.eval_batch(0, r, WORLD) for r in range(WORLD)]
        eval_loss = (sum(float(task.loss(model, b)) for b in parts if b is not None) / WORLD
                     if all(b is not None for b in parts) else None)
    b = WORLD * cfg.run.batch_size
    return Run(name, f"plain {threads}t", done, b, done * b / wall, wall / done * 1000,
               {k: v / done * 1000 for k, v in times.items()}, eval_loss, wall)


# -- (b), (c) hybridps on 2 ranks ----------------------------------------------------------

def run_hybridps(name: str, variant: str, worker_args: list[str], steps: int,
                 directory: Path, nproc: int = WORLD, staleness: int = 1) -> Run:
    directory.mkdir(parents=True, exist_ok=True)
    server = Server(directory) if not variant.startswith("local") else None
    sampler = None if server is None else CpuSampler(server.proc.pid)
    try:
        source = ["--local-optimizer"] if server is None else ["--ps", server.address]
        res = run_worker([*source, "--staleness", str(staleness), "--steps", str(steps),
                          "--eval-batches", "1", "--eval-every", "0", "--log-every", "50",
                          *worker_args],
                         directory / f"{name}-{variant}.json",
                         directory / f"{name}-{variant}.log", world=nproc, timeout=1800)
    finally:
        if sampler is not None:
            sampler.stop()
        if server is not None:
            server.close()
    # the server's CPU while rank 0 trained (not while the ranks registered and seeded)
    span = res.get("train_span_unix_s")
    server_cpu_s = (sampler.cpu_between(*span) if sampler is not None and span else None)
    step_s = res["train_time_s"] / res["steps"]
    b = res["world_size"] * res["config"]["batch_size"]
    cpu_s, ranks_cpu_s = res.get("train_cpu_s"), res.get("ranks_train_cpu_s")
    return Run(name, variant, res["steps"], b, res["samples_per_s"], step_s * 1000,
               {k: res["step_time_s"].get(k, 0.0) * 1000 for k in BREAKDOWN},
               res["eval"].get("loss"), res["process_wall_s"],
               cpu_ms=None if cpu_s is None else cpu_s / res["steps"] * 1000,
               server_cpu_ms=None if server_cpu_s is None else server_cpu_s / res["steps"] * 1000,
               ranks_cpu_ms=None if ranks_cpu_s is None else ranks_cpu_s / res["steps"] * 1000)


def distinct_ids_per_step(worker_args: list[str]) -> float:
    """Mean distinct ids of the task's first global batches (all tables together)."""
    cfg = worker_config(worker_args)
    task = build_task(cfg)
    counts = []
    for step in range(DISTINCT_ID_BATCHES):
        batch = task.global_batch(step, WORLD)
        ids = [*batch.ids.values(), *(ids_N for ids_N, _ in batch.bags.values())]
        counts.append(sum(int(t.unique().numel()) for t in ids))
    return sum(counts) / len(counts)


def best_of(runs: list[Run]) -> Run:
    """The median-step-time run of the repeats (all step times kept)."""
    pick = median_of(runs, "step_ms")
    pick.repeats_step_ms = [r.step_ms for r in runs]
    return pick


# -- report -----------------------------------------------------------------------------------

def table(runs: list[Run]) -> str:
    head = (f"{'config':<9} {'variant':<14} {'batch':>5} {'samples/s':>10} {'step ms':>8}  "
            + " ".join(f"{k[:7]:>7}" for k in BREAKDOWN) + f" {'eval':>6}")
    lines = [head, "-" * len(head)]
    for r in runs:
        cells = " ".join(f"{r.breakdown_ms[k]:>7.2f}" if k in r.breakdown_ms else f"{'':>7}"
                         for k in BREAKDOWN)
        ev = f"{r.eval_loss:>6.3f}" if r.eval_loss is not None else f"{'':>6}"
        lines.append(f"{r.config:<9} {r.variant:<14} {r.global_batch:>5} "
                     f"{r.samples_per_s:>10.0f} {r.step_ms:>8.2f}  {cells} {ev}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="fewer steps and growth to 10M rows instead of 50M")
    p.add_argument("--steps", type=int, default=0,
                   help="steps per run (default: 400 default job, 200 torchrec, 300 growth; "
                        "quick: 150/80/120)")
    p.add_argument("--configs", default="default,torchrec",
                   help=f"comma list of {','.join(CONFIGS)}")
    p.add_argument("--growth-rows", type=int, default=0,
                   help="rows of the big growth table (default 50M, quick 10M; 0 with "
                        "--no-growth skips)")
    p.add_argument("--no-growth", action="store_true", help="skip goal 6")
    p.add_argument("--growth-zipf-rows", type=int, default=1_000_000,
                   help="growth runs draw ids over this many popularity ranks at both table "
                        "sizes (--zipf-rows; 0: over each whole table)")
    p.add_argument("--no-pipeline-ab", action="store_true",
                   help="skip the server run with --pipeline flipped (what the pipeline gains)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per hybridps variant; the median step time is reported")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="worker results/logs (default: a temporary directory)")
    p.add_argument("worker_args", nargs="*", help="extra worker flags, after --")
    args = p.parse_args(argv)
    steps = {"default": 400, "torchrec": 200, "growth": 300}
    if args.quick:
        steps = {"default": 150, "torchrec": 80, "growth": 120}
    if args.steps:
        steps = dict.fromkeys(steps, args.steps)
    growth_rows = args.growth_rows or (10_000_000 if args.quick else 50_000_000)
    if growth_rows <= 1_000_000:
        p.error(f"--growth-rows {growth_rows} must be above the 1M-row table it is compared to")
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"--configs: {c!r} is not one of {', '.join(CONFIGS)}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_train-"))
    started = time.perf_counter()
    load_before = os.getloadavg()
    runs: list[Run] = []
    goals: list[dict[str, Any]] = []
    pipeline_gain: dict[str, float] = {}  # server step time --pipeline false / true
    distinct_ids: dict[int, float] = {}  # growth: table rows -> distinct ids a global batch
    paired: dict[str, list[float]] = {}  # server / local step time of each repeat's pair
    for name in configs:
        wargs = [*CONFIGS[name], *args.worker_args]
        log(f"[{name}] plain ({steps.get(name, 200)} steps)")
        plain = run_plain(name, wargs, steps.get(name, 200))
        # the A/B run flips the config's --pipeline default (task defaults included)
        piped = worker_config(wargs).run.pipeline
        flipped = f"server-pipe-{'off' if piped else 'on'}"
        variants = {"server": [], "local": [], flipped: ["--pipeline", str(not piped).lower()]}
        if args.no_pipeline_ab:
            del variants[flipped]
        # one rank, the whole global batch, synchronous: the plain loop's work exactly
        one_rank = ["--batch-size", str(WORLD * worker_config(wargs).run.batch_size),
                    "--staleness", "0"]
        variants["local-one-rank"] = one_rank
        # Repeats interleave the variants (server, local, ..., server, local, ...): a shared
        # machine's speed drifts over minutes, and a block of server runs then a block of
        # local ones would read that drift as a difference between them.
        tries: dict[str, list[Run]] = {v: [] for v in variants}
        for i in range(args.repeats):
            for variant, extra in variants.items():
                log(f"[{name}] hybridps {variant} ({i + 1}/{args.repeats})")
                tries[variant].append(run_hybridps(
                    name, variant, [*wargs, *extra], steps.get(name, 200), work / f"r{i}",
                    nproc=1 if variant == "local-one-rank" else WORLD))
        paired[name] = [s.step_ms / lo.step_ms
                        for s, lo in zip(tries["server"], tries["local"], strict=True)]
        hyb = {variant: best_of(r) for variant, r in tries.items()}
        runs += [plain, *hyb.values()]
        if flipped in hyb:
            on, off = (hyb["server"], hyb[flipped]) if piped else (hyb[flipped], hyb["server"])
            pipeline_gain[name] = off.step_ms / on.step_ms
        goals.append(_goal(3, f"{name}: samples/s hybridps K=1 / plain",
                           hyb["server"].samples_per_s / plain.samples_per_s,
                           GOAL_VS_PLAIN, ">="))
        goals.append(_goal(4, f"{name}: step time server K=1 / local-optimizer",
                           hyb["server"].step_ms / hyb["local"].step_ms, GOAL_ASYNC, "<="))
        goals.append(_goal(8, f"{name}: samples/s one rank (local, K=0) / plain",
                           hyb["local-one-rank"].samples_per_s / plain.samples_per_s,
                           GOAL_ONE_RANK, ">="))
    if not args.no_growth:
        sizes: dict[int, list[Run]] = {1_000_000: [], growth_rows: []}
        growth_args = {rows: [*GROWTH, "--num-rows", str(rows), "--zipf-rows",
                              str(args.growth_zipf_rows), *args.worker_args] for rows in sizes}
        for rows, gargs in growth_args.items():
            distinct_ids[rows] = distinct_ids_per_step(gargs)
        for i in range(args.repeats):  # interleaved, as above
            for rows, tried in sizes.items():
                log(f"[growth] hybridps server, {rows} rows ({i + 1}/{args.repeats})")
                tried.append(run_hybridps("growth", f"rows-{rows}", growth_args[rows],
                                          steps["growth"], work / f"g{i}"))
        small_big = [best_of(tried) for tried in sizes.values()]
        runs += small_big
        goals.append(_goal(6, f"growth: step time {growth_rows // 10**6}M / 1M rows",
                           small_big[1].step_ms / small_big[0].step_ms, GOAL_GROWTH, "<"))
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - started

    print("training throughput (2 gloo ranks, 1 thread each, vs one process); ms per step, "
          "hybridps breakdown from rank 0")
    print(table(runs))
    print(_goal_table(goals))
    if distinct_ids:
        print("growth: distinct ids a global batch (mean of "
              f"{DISTINCT_ID_BATCHES} batches, --zipf-rows {args.growth_zipf_rows}): "
              + ", ".join(f"{rows // 10**6}M rows {n:.1f}" for rows, n in distinct_ids.items()))
    for name, gain in pipeline_gain.items():
        print(f"pipeline: {name}: server step time --pipeline false / true = {gain:.3f}")
    for name, ratios in paired.items():
        if len(ratios) > 1:
            print(f"goal 4 per repeat: {name}: server / local = "
                  + ", ".join(f"{r:.3f}" for r in ratios))
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; {elapsed:.0f}s; "
          f"worker logs in {work}")
    write_json(args.json, {
        "goals": goals,
        "pipeline_gain": pipeline_gain,
        "growth_distinct_ids": distinct_ids,
        "growth_zipf_rows": args.growth_zipf_rows,
        "server_over_local_per_repeat": paired,
        "runs": [asdict(r) for r in runs],
        "configs": {**CONFIGS, "growth": GROWTH},
        "machine": machine(load_before),
        "elapsed_s": elapsed,
    }, args)
    return 0


def _goal(number: int, what: str, ratio: float, target: float, op: str) -> dict[str, Any]:
    ok = {">=": ratio >= target, "<=": ratio <= target, "<": ratio < target}[op]
    return {"goal": number, "what": what, "ratio": ratio, "target": f"{op} {target:g}",
            "met": ok}


def _goal_table(goals: list[dict[str, Any]]) -> str:
    return "\n".join(f"goal {g['goal']}: {g['what']:<48} {g['ratio']:>6.3f}  "
                     f"(goal {g['target']})  {'met' if g['met'] else 'NOT met'}" for g in goals)


if __name__ == "__main__":
    sys.exit(main())
