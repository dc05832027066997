"""hybridps against TorchRec on the same work, side by side in one run.

    python bench/bench_vs_torchrec.py                     # 3 jobs x 3 interleaved repeats
    python bench/bench_vs_torchrec.py --quick --json runs/bench/vs_torchrec.json
    python bench/bench_vs_torchrec.py --jobs ids20 --repeats 5
    python bench/bench_vs_torchrec.py --jobs dlrm --auto    # + the planner's placement

TorchRec is an optional benchmark extra, never a dependency of hybridps. What installs
next to torch 2.13 (fbgemm 1.9 does not load with it; check `pip show torch` after):

    pip install -e '.[bench]' && pip install --no-deps torchrec==1.8.0

Every job is `--task tables` (worker/tasks/tables.py), so both sides train on IDENTICAL
batches: the task's generator makes each rank's slice of the global batch of each step
(bounded Zipf 1.1 over popularity ranks, scattered over the table) inside the timed loop,
for TorchRec as for hybridps. 2 gloo ranks (torchrun, OMP_NUM_THREADS=1 each), batch 1024
per rank, the task's MLP on the concatenated (pooled) rows and 4 dense features, BCE:
  ids20  one 1,000,000 x 64 table, 20 ids a sample, mean-pooled
  ids1   the same table, 1 id a sample
  dlrm   26 tables of mixed sizes (3 to 1,000,000 rows) x 16, three of them multi-hot
         (3, 4 and 8 ids a sample, mean-pooled)
Variants, interleaved within each job (torchrec, hybridps, hybridps-ddp, hybridps-local,
hybridps-rwada, hybridps-rwada-local, torchrec, ...) so this machine's drift over minutes
falls on all alike:
  torchrec        DistributedModelParallel, row-wise sharding of every table (on CPU the
                  stock sharder offers row-wise only on CUDA: `RowWiseCpuSharder` adds
                  it), fbgemm's fused EXACT_ROWWISE_ADAGRAD (TorchRec's CPU kernels have no
                  Adam: SGD and the Adagrad family only), the MLP under DDP + torch Adam;
  hybridps        the headline: a shard server (`python -m ps`) at --staleness 1, no flag
                  but the job's: sparse Adam on the server (m and v per element: more
                  optimizer work than TorchRec's rowwise Adagrad, one value per row), the
                  MLP under the default --dense-parallel auto (the run's summary says
                  what it chose; --dense-parallel X here gives every variant X);
  hybridps-ddp    the same with --dense-parallel ddp, as TorchRec's DMP wraps its MLP;
  hybridps-local  the same with --local-optimizer (Adam in-process, no server) at
                  --staleness 0: synchronous, as TorchRec (nothing to overlap in-process);
  hybridps-rwada  like for like: `--optimizer rowwise_adagrad --dense-optimizer adam` on
                  the server at K=1 (FBGEMM's EXACT_ROWWISE_ADAGRAD, one value a row, and
                  torch Adam on the MLP, as TorchRec's side);
  hybridps-rwada-local  the same with --local-optimizer, at --staleness 0;
  hybridps-auto   (with --auto) hybridps with `--sharding auto`: the planner places small
                  tables whole on one rank and shards the large ones row-wise
                  (worker/embedding/sharding.py), against TorchRec and against row-wise.
samples/s = steps x global batch / the training loop's wall time (set-up excluded on
both sides). CPU s/M: the CPU seconds of every rank (all threads, read from /proc
during rank 0's training loop) plus, for hybridps, the shard server's, per million
samples: the fair figure where the server shares the ranks' cores. Goals, the median
of the per-repeat ratios, on every job (issue 49): hybridps (Adam, server, K=1)
and default flags >= 1.0x TorchRec, like for like rowwise Adagrad on the server
(hybridps-rwada, K=1) >= 1.2x and in-process (hybridps-rwada-local) >= 1.4x. A missed
goal prints how far short it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (  # bench/ is sys.path[0] when run as a script
    REPO,
    TORCHRUN,
    bench_parser,
    log,
    machine,
    run_sampled,
    write_json,
)

if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

import torch

DLRM_ROWS = [1_000_000, 800_000, 500_000, 300_000, 200_000, 100_000, 60_000, 30_000, 10_000,
             5_000, 3_000, 2_000, 1_000, 1_000, 500, 300, 200, 100, 100, 50, 30, 20, 10, 10,
             4, 3]
DLRM_POOL = {3: 8, 7: 4, 11: 3}  # table index -> ids a sample (mean-pooled)
DLRM_TABLES = ",".join(f"c{i}:{rows}" + (f":{DLRM_POOL[i]}" if i in DLRM_POOL else "")
                       for i, rows in enumerate(DLRM_ROWS))
JOBS: dict[str, list[str]] = {
    "ids20": ["--task", "tables", "--tables", "t0:1000000:20", "--dim", "64",
              "--batch-size", "1024"],
    "ids1": ["--task", "tables", "--tables", "t0:1000000", "--dim", "64", "--batch-size", "1024"],
    "dlrm": ["--task", "tables", "--tables", DLRM_TABLES, "--dim", "16", "--batch-size", "1024"],
}
# samples/s against torchrec, the median of the per-repeat ratios, on every job
GOALS = {"hybridps": 1.0, "hybridps-rwada": 1.2, "hybridps-rwada-local": 1.4}
STEPS = {"ids20": 200, "ids1": 300, "dlrm": 150}
QUICK_STEPS = {"ids20": 80, "ids1": 120, "dlrm": 60}
VARIANTS = ("torchrec", "hybridps", "hybridps-ddp", "hybridps-local", "hybridps-rwada",
            "hybridps-rwada-local")
# the hybridps variants: (--local-optimizer?, the optimizer flags). With the server, K=1
# (the push overlaps the next step); in-process, K=0: the update is applied before the
# next forward, as TorchRec's fused update in backward is, and nothing is left to overlap
# (K=1 there only adds the weight prediction's work).
LIKE_FOR_LIKE = ["--optimizer", "rowwise_adagrad", "--dense-optimizer", "adam"]
HYBRIDPS = {"hybridps": (False, []), "hybridps-ddp": (False, ["--dense-parallel", "ddp"]),
            "hybridps-local": (True, []),
            "hybridps-rwada": (False, LIKE_FOR_LIKE), "hybridps-rwada-local": (True, LIKE_FOR_LIKE),
            "hybridps-auto": (False, ["--sharding", "auto"])}
SERVER_STALENESS, LOCAL_STALENESS = 1, 0
WORLD = 2
INSTALL = "pip install -e '.[bench]' && pip install --no-deps torchrec==1.8.0"
GOAL_NUMBER = 7  # bench/run_all.py's summary: the comparison with TorchRec


def torchrec_available() -> bool:
    return importlib.util.find_spec("torchrec") is not None


# -- the TorchRec side (runs inside torchrun: `--torchrec-worker`) ----------------------------

def torchrec_worker(job_args: list[str], steps: int, out: Path) -> None:
    """One rank of the TorchRec run; rank 0 writes {samples_per_s, step_ms, ...} to `out`."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
    from torchrec.modules.embedding_configs import PoolingType
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from hybridps.cli import parse_config
    from worker.config.task_defaults import task_defaults
    from worker.config.train_config import TrainConfig
    from worker.tasks.base import Batch
    from worker.tasks.tables import TablesTask

    class RowWiseCpuSharder(EmbeddingBagCollectionSharder):
        """The stock sharder, offering row-wise sharding on the CPU too."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = list(super().sharding_types(compute_device_type))
            if ShardingType.ROW_WISE.value not in types:
                types.append(ShardingType.ROW_WISE.value)
            return types

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = parse_config(TrainConfig, [*job_args, "--local-optimizer"], defaults=task_defaults)
    task = TablesTask(cfg)
    names = [name for name, _, _ in task.specs]
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=name, embedding_dim=cfg.run.dim, num_embeddings=rows,
                           feature_names=[name], pooling=PoolingType.MEAN)
        for name, rows, _ in task.specs], device=torch.device("meta"))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = ebc
            self.dense = task.build_dense()

        def forward(self, kjt: KeyedJaggedTensor, dense_BF: torch.Tensor,
                    label_B: torch.Tensor) -> torch.Tensor:
            x_BF = torch.cat([self.ebc(kjt).values(), dense_BF], dim=1)
            return F.binary_cross_entropy_with_logits(self.dense(x_BF).squeeze(-1), label_B)

    torch.manual_seed(cfg.run.seed)
    model = Model()
    sharder = RowWiseCpuSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": cfg.optim.lr})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(
        ebc, {name: row_wise(compute_kernel="fused") for name in names}, sharder=sharder,
        local_size=world, world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_opt = torch.optim.Adam(
        [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())],
        lr=cfg.optim.dense_lr)

    def features(batch: Batch) -> KeyedJaggedTensor:
        values, lengths = [], []
        for name, _, pool in task.specs:
            if pool == 1:
                ids_B = batch.ids[name]
                values.append(ids_B)
                lengths.append(torch.ones_like(ids_B))
            else:
                ids_N, offsets_B = batch.bags[name]
                values.append(ids_N)
                lengths.append(torch.diff(offsets_B, append=offsets_B.new_tensor([ids_N.numel()])))
        return KeyedJaggedTensor(keys=names, values=torch.cat(values), lengths=torch.cat(lengths))

    dist.barrier()
    start, cpu_start, start_unix = time.perf_counter(), time.process_time(), time.time()
    loss = torch.zeros(())
    for step in range(steps):  # the data, as hybridps' loop makes it: inside the step
        batch = task.batch(step, rank, world)
        loss = dmp(features(batch), batch.values["dense"], batch.values["label"])
        loss.backward()  # the fused embedding optimizer steps inside backward
        dense_opt.step()
        dense_opt.zero_grad(set_to_none=True)
    dist.barrier()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if rank == 0:
        out.write_text(json.dumps({
            "samples_per_s": steps * cfg.run.batch_size * world / wall,
            "step_ms": wall / steps * 1000, "steps": steps, "final_loss": float(loss.detach()),
            "cpu_ms": cpu / steps * 1000, "train_span_unix_s": [start_unix, time.time()],
            "optimizer": "fbgemm EXACT_ROWWISE_ADAGRAD (fused, in backward)",
            "dense": "DDP + torch Adam"}) + "\n")
    dist.destroy_process_group()


def run_torchrec(job: str, steps: int, directory: Path) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"{job}-torchrec.json"
    out.unlink(missing_ok=True)
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node", str(WORLD),
           str(Path(__file__).resolve()), "--torchrec-worker", "--job", job, "--steps",
           str(steps), "--out", str(out)]
    code, stdout, stderr, sampler = run_sampled(cmd, timeout=1800)
    (directory / f"{job}-torchrec.log").write_text(stdout + stderr)
    if not out.exists():
        raise RuntimeError(f"{job}/torchrec failed ({code}):\n{stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    ranks_cpu_s = sampler.cpu_between(*result["train_span_unix_s"])
    result["ranks_cpu_ms"] = None if ranks_cpu_s is None else ranks_cpu_s / steps * 1000
    result["global_batch"] = WORLD * batch_size(job)
    if code != 0:
        # Rank 0 wrote its timing after the loop: a crash after that (TorchRec's processes
        # abort now and then while tearing down, "terminate called without an active
        # exception") does not touch the measurement. It is kept in the results.
        print(f"[{job}] torchrec exited {code} after writing its results "
              f"(see {directory / f'{job}-torchrec.log'})", flush=True)
        result["exit_code"] = code
    return result


def run_hybridps_variant(job: str, variant: str, steps: int, directory: Path,
                         dense_parallel: str) -> dict[str, Any]:
    from bench_train import run_hybridps  # the training benchmark's runner (bench/ is on path)

    local, flags = HYBRIDPS[variant]
    dense = ["--dense-parallel", dense_parallel] if dense_parallel and "--dense-parallel" \
        not in flags else []
    run = run_hybridps(f"{job}-{variant}", "local" if local else "server",
                       [*JOBS[job], *dense, *flags], steps,
                       directory, staleness=LOCAL_STALENESS if local else SERVER_STALENESS)
    return {"samples_per_s": run.samples_per_s, "step_ms": run.step_ms,
            "breakdown_ms": run.breakdown_ms, "cpu_ms": run.cpu_ms,
            "server_cpu_ms": run.server_cpu_ms, "ranks_cpu_ms": run.ranks_cpu_ms,
            "global_batch": run.global_batch}


# -- report -------------------------------------------------------------------------------------

def batch_size(job: str) -> int:
    args = JOBS[job]
    return int(args[args.index("--batch-size") + 1])


def cpu_per_m(run: dict[str, Any]) -> tuple[float, float] | None:
    """(ranks, server) CPU seconds per million samples of one run: every rank's CPU (all
    threads) and the shard server's during the training loop; None where /proc could not
    say. On a machine with fewer cores than processes, the CPU a sample needs bounds the
    throughput from below whatever the overlap."""
    ranks = run.get("ranks_cpu_ms")
    if ranks is None:
        return None
    per_m = 1000.0 / run["global_batch"]  # ms a step -> s per million samples
    return ranks * per_m, (run.get("server_cpu_ms") or 0.0) * per_m


def _cpu_text(tries: list[dict[str, Any]]) -> str:
    """Medians of the ranks' and the server's CPU s per million samples, and their sum."""
    pairs = [p for p in map(cpu_per_m, tries) if p is not None]
    if not pairs:
        return "-"
    ranks, server = (statistics.median(x) for x in zip(*pairs, strict=True))
    total = statistics.median(r + s for r, s in pairs)
    return f"{ranks:.1f}" + (f" + {server:.1f} = {total:.1f}" if server else "")


def _cpu_ratio(tries: list[dict[str, Any]], base: list[dict[str, Any]]) -> str:
    """Median over repeats of (ranks + server) CPU per sample / TorchRec's ranks'."""
    ratios = []
    for mine, theirs in zip(tries, base, strict=True):
        a, b = cpu_per_m(mine), cpu_per_m(theirs)
        if a is not None and b is not None and b[0] > 0:
            ratios.append(sum(a) / b[0])
    return f"  CPU a sample {statistics.median(ratios):.2f}x TorchRec's" if ratios else ""


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else f"NOT met: {target / ratio:.2f}x short of {target:g}x"


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> tuple[str, list[dict[str, Any]]]:
    lines = [f"{'job':<6} {'variant':<21} {'samples/s per repeat':<30} {'median':>8} "
             f"{'spread':>7}  step ms  CPU s/M samples: ranks (+ server = total)  (medians)"]
    goals = []
    for job, variants in runs.items():
        for variant, tries in variants.items():
            sps = [t["samples_per_s"] for t in tries]
            med = statistics.median(sps)
            spread = (max(sps) - min(sps)) / med if med else 0.0
            lines.append(f"{job:<6} {variant:<21} {' '.join(f'{s:>8.0f}' for s in sps):<30} "
                         f"{med:>8.0f} {spread:>6.0%}  "
                         f"{statistics.median(t['step_ms'] for t in tries):7.2f}  "
                         + _cpu_text(tries))
        base = [t["samples_per_s"] for t in variants["torchrec"]]
        if "hybridps-auto" in variants:
            ratios = [a["samples_per_s"] / r["samples_per_s"] for a, r in zip(
                variants["hybridps-auto"], variants["hybridps"], strict=True)]
            lines.append(f"{job:<6} hybridps-auto / hybridps (row-wise): median "
                         f"{statistics.median(ratios):.3f} (repeats "
                         + ", ".join(f"{r:.3f}" for r in ratios) + ")")
        for variant in HYBRIDPS:
            ratios = [h["samples_per_s"] / t for h, t in zip(
                [x for x in variants[variant]], base, strict=True)] if variant in variants else []
            if not ratios:
                continue
            ratio = statistics.median(ratios)
            target = GOALS.get(variant)
            checks = [target] if target is not None else []
            lines.append(f"{job:<6} {variant} / torchrec: median {ratio:.3f} (repeats "
                         + ", ".join(f"{r:.3f}" for r in ratios) + ")"
                         + _cpu_ratio(variants[variant], variants["torchrec"])
                         + "".join(f"  goal >= {t:g}: " + _verdict(ratio, t) for t in checks))
            if target is not None:
                what = {"hybridps": "hybridps K=1 / TorchRec",
                        "hybridps-rwada": "hybridps rowwise Adagrad, server K=1 / TorchRec "
                                          "(like for like)",
                        "hybridps-rwada-local": "hybridps rowwise Adagrad, in-process K=0 / "
                                                "TorchRec (like for like)"}[variant]
                goals.append({"goal": GOAL_NUMBER,
                              "what": f"{job}: samples/s {what} (median)",
                              "ratio": ratio, "target": f">= {target:g}",
                              "met": ratio >= target, "per_repeat": ratios})
    return "\n".join(lines), goals


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="fewer steps per run")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma list of {','.join(JOBS)}")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per variant")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default: per job)")
    p.add_argument("--dense-parallel", default="", choices=("", "auto", "ddp", "fsdp"),
                   help="hybridps' dense parallelism for every variant but hybridps-ddp "
                   "(default: none given, the worker's default)")
    p.add_argument("--no-ddp", action="store_true", help="skip hybridps-ddp")
    p.add_argument("--no-local", action="store_true", help="skip hybridps --local-optimizer")
    p.add_argument("--auto", action="store_true",
                   help="add hybridps-auto: hybridps with --sharding auto")
    p.add_argument("--no-like-for-like", action="store_true",
                   help="skip the rowwise Adagrad variants (hybridps-rwada*)")
    p.add_argument("--work-dir", type=Path, default=None, help="logs and results of every run")
    # internal: one rank of the TorchRec run, under torchrun
    p.add_argument("--torchrec-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torchrec_worker:
        torchrec_worker(JOBS[args.job], args.steps, args.out)
        return 0
    if not torchrec_available():
        print(f"TorchRec is not installed: nothing to compare ({INSTALL})")
        return 0
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    jobs = [j for j in args.jobs.split(",") if j]
    for job in jobs:
        if job not in JOBS:
            p.error(f"--jobs: {job!r} is not one of {', '.join(JOBS)}")
    variants = [v for v in VARIANTS if not (args.no_local and v.endswith("-local"))
                and not (args.no_like_for_like and v.startswith("hybridps-rwada"))
                and not (args.no_ddp and v == "hybridps-ddp")]
    if args.auto:
        variants.insert(variants.index("hybridps") + 1, "hybridps-auto")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_vs_torchrec-"))
    started = time.perf_counter()
    load_before = os.getloadavg()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for job in jobs:
        steps = args.steps or (QUICK_STEPS if args.quick else STEPS)[job]
        runs[job] = {v: [] for v in variants}
        for i in range(args.repeats):  # interleaved: torchrec, hybridps, local, torchrec, ...
            for variant in variants:
                log(f"[{job}] {variant} ({i + 1}/{args.repeats}, {steps} steps)")
                directory = work / f"r{i}"
                res = (run_torchrec(job, steps, directory) if variant == "torchrec" else
                       run_hybridps_variant(job, variant, steps, directory, args.dense_parallel))
                runs[job][variant].append(res)
    load_after = os.getloadavg()
    elapsed = time.perf_counter() - started
    text, goals = summarize(runs)
    print(f"hybridps vs TorchRec, {WORLD} gloo ranks x 1 thread, identical batches "
          f"(--task tables); TorchRec: row-wise, fused rowwise Adagrad (no Adam on its CPU "
          f"path), DDP + Adam; hybridps: sparse Adam (server K=1 / local K=0) and, like for "
          f"like, rowwise Adagrad + dense Adam (rwada), --dense-parallel "
          f"{args.dense_parallel or 'not given (the default)'}; hybridps-ddp: ddp")
    print(text)
    print(f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}; {elapsed:.0f}s; "
          f"logs in {work}")
    write_json(args.json, {
        "goals": goals, "runs": runs, "jobs": {j: JOBS[j] for j in jobs},
        "dense_parallel": args.dense_parallel or "default", "machine": machine(load_before),
        "elapsed_s": elapsed}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
