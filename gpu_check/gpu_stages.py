"""The stages of gpu_check/check.py, one per process:

    python gpu_check/gpu_stages.py STAGE --work DIR [--dry-run]

writes DIR/STAGE.json ({"ok", "error", "figures"}) as it goes. Stages: prepare (the python,
its packages, the native kernel built in place), pytest_gpu (tests/system/test_gpu.py),
default_job and table_budget (gpu_check/gpu_jobs.py), server_threads (gpu_check/gpu_server.py),
production_job (gpu_check/gpu_production.py),
nccl (a one-rank NCCL group through worker/runtime/dist.py's init_distributed, and the
default job through torchrun) and sync_debug (the loop under CUDA's sync debug mode).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpu_common import REPO, StageReport, Timer, clean_env, log, pick_device, sync

# module -> (distribution, required): the worker, the server and the tests' imports
MODULES = {
    "torch": ("torch", True), "numpy": ("numpy", True), "grpc": ("grpcio", True),
    "google.protobuf": ("protobuf", True), "grpc_health.v1.health": ("grpcio-health-checking",
                                                                     True),
    "grpc_reflection.v1alpha.reflection": ("grpcio-reflection", True),
    "uvloop": ("uvloop", True), "tqdm": ("tqdm", True),
    "prometheus_client": ("prometheus-client", True), "matplotlib": ("matplotlib", True),
    "pytest": ("pytest", True), "pytest_timeout": ("pytest-timeout", True),
    "pyarrow": ("pyarrow", False),  # production_job f only (--task files reads Parquet)
}
# what must import once the packages are there (the generated code checks its runtime)
PROJECT_IMPORTS = ("hybridps.v1.shard_pb2", "hybridps.v1.shard_pb2_grpc", "ps.edge.server",
                   "worker.train.trainer")
SYNC_MESSAGE = "synchronizing CUDA operation"
# the check's own frames and the benchmarks' server: not a sync site of the product
CHECK_FOLDERS = (str(REPO / "gpu_check") + "/", str(REPO / "bench") + "/")
DRY_RUN_TESTS = "staleness0 or bf16 or export"


# -- prepare ----------------------------------------------------------------------------

def stage_prepare(rep: StageReport, dry_run: bool) -> None:
    import torch

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "executable": sys.executable,
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": cuda}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=False)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    rep.set(machine=info)
    modules: dict[str, str] = {}
    missing = []
    for module, (dist, required) in MODULES.items():
        try:
            importlib.import_module(module)
            modules[dist] = importlib.metadata.version(dist)
        except Exception as exc:
            modules[dist] = f"MISSING: {type(exc).__name__}: {exc}"[:300]
            if required:
                missing.append(dist)
    rep.set(packages=modules)
    imports: dict[str, str] = {}
    for module in PROJECT_IMPORTS:
        try:
            importlib.import_module(module)
            imports[module] = "ok"
        except Exception as exc:
            imports[module] = f"FAILED: {type(exc).__name__}: {exc}"[:500]
    rep.set(project_imports=imports)
    rep.set(native=native_kernel())
    problems = [f"missing packages: {', '.join(missing)} (carry them as wheels: "
                "docs/gpu_check.md)"] if missing else []
    problems += [f"{m}: {v}" for m, v in imports.items() if v != "ok"]
    if not cuda and not dry_run:
        problems.append(f"torch {torch.__version__} sees no CUDA device")
    rep.finish(not problems, "; ".join(problems) or None)


def _kernel_in_use() -> tuple[str, str]:
    """(kernel name, its info) as a fresh python sees them."""
    proc = subprocess.run([sys.executable, "-c", "import hybridps.optim as o; "
                           "print(o.kernel_name()); print(o.kernel_info())"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return "unknown", proc.stderr[-500:]
    return lines[0], " ".join(lines[1:])


def native_kernel() -> dict[str, Any]:
    """The native row kernel built in place (setup.py build_ext --inplace, else the C
    compiler directly), or plainly the torch fallback with why."""
    kernel, detail = _kernel_in_use()
    if kernel == "native":
        return {"kernel": "native", "build": "already built", "info": detail}
    steps = []
    build = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=REPO,
                           env=clean_env(), capture_output=True, text=True, timeout=300,
                           check=False)
    steps.append(f"setup.py build_ext --inplace: exit {build.returncode} "
                 f"{(build.stderr or build.stdout)[-400:]}")
    kernel, detail = _kernel_in_use()
    if kernel != "native":
        steps.append(_compile_directly())
        kernel, detail = _kernel_in_use()
    if kernel == "native":
        return {"kernel": "native", "build": steps[-1][:200], "info": detail}
    return {"kernel": kernel, "build": "FAILED: the server runs the torch fallback kernels",
            "steps": steps, "info": detail}


def _compile_directly() -> str:
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        return f"no Python.h under {include}: cannot build the extension"
    compiler = (sysconfig.get_config_var("CC") or "cc").split()
    if not shutil.which(compiler[0]):
        compiler = ["cc"]
    target = REPO / "hybridps" / "native" / f"_fused_adam{sysconfig.get_config_var('EXT_SUFFIX')}"
    sources = sorted(str(c) for c in (REPO / "hybridps" / "native").glob("*.c"))
    cmd = [*compiler, "-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-pthread",
           "-fPIC", "-shared", f"-I{include}", *sources, "-o", str(target), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    return f"{' '.join(cmd[:2])} ... -o {target.name}: exit {proc.returncode} {proc.stderr[-400:]}"


# -- a. pytest -m gpu -------------------------------------------------------------------

def stage_pytest_gpu(rep: StageReport, dry_run: bool, work: Path) -> None:
    junit = work / "pytest_gpu.xml"
    env = clean_env(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # the image's plugins stay out
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/system/test_gpu.py", "-v",
           "-p", "no:cacheprovider", "-p", "pytest_timeout", "--junitxml", str(junit)]
    if dry_run:  # the stage's plumbing, with 3 of the tests on the CPU (the others each
        # start two more workers; `GPU_TESTS_DEVICE=cpu pytest -m gpu` runs all of them)
        env["GPU_TESTS_DEVICE"] = "cpu"
        cmd += ["-k", DRY_RUN_TESTS]
    # its output goes to this stage's log as it comes: a stage stopped at its limit still
    # shows which tests ran
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=sys.stderr, stderr=sys.stderr,
                          check=False)
    tests: dict[str, dict[str, Any]] = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome = {"failure": "failed"}.get(kind, kind)
                    message = (found.get("message") or "")[:300]
            tests[case.get("name", "?")] = {"outcome": outcome,
                                            "seconds": round(float(case.get("time", 0)), 1),
                                            "message": message}
    counts = {k: sum(t["outcome"] == k for t in tests.values())
              for k in ("passed", "failed", "error", "skipped")}
    rep.set(tests=tests, **counts, exit_code=proc.returncode)
    if proc.returncode != 0 or counts["passed"] == 0 or counts["skipped"]:
        failed = [f"{name}: {t['message']}" for name, t in tests.items()
                  if t["outcome"] != "passed"]
        rep.finish(False, f"pytest exit {proc.returncode}: {counts}; " + " | ".join(failed))
        return
    rep.finish(True)


# -- e. NCCL ------------------------------------------------------------------------------

NOT_CHECKED_HERE = [
    "several ranks: NCCL all_to_all between GPUs (the embedding exchange), P2P/NVLink paths",
    "FSDP2/HSDP/DDP sharding of the dense part across GPUs (one rank leaves it unwrapped)",
    "the sync points of world size > 1 (input_dist) and whether anything else in the "
    "step synchronises there",
    "two nodes: NCCL over the network, one shard server per node, HSDP across nodes",
    "a rank that dies mid-collective (NCCL timeouts, torchrun restarts on GPUs)",
]


def stage_nccl(rep: StageReport, dry_run: bool, work: Path) -> None:
    from harness import Server  # bench/ is on sys.path (gpu_common)

    rep.set(not_checked_here=NOT_CHECKED_HERE)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "1"]
    flags = ["--dry-run"] if dry_run else []
    subprocess.run([*run, str(Path(__file__)), "nccl_rank", "--work", str(work), *flags],
                   cwd=REPO, env=clean_env(), stdout=sys.stderr, stderr=sys.stderr,
                   timeout=120, check=False)
    rank = StageReport.load(work / "nccl_rank.json")
    rep.set(group=rank.get("figures", {}), group_ok=rank.get("ok"),
            group_error=rank.get("error"))
    device = "cpu" if dry_run else "cuda"
    steps = 12 if dry_run else 60
    with Server(work / "ps_nccl") as server:
        results = work / "nccl_job.json"
        job = subprocess.run([*run, str(REPO / "worker" / "main.py"), "--device", device,
                              "--ps", server.address, "--steps", str(steps), "--log-every",
                              "10", "--eval-batches", "1", "--progress", "false",
                              "--results", str(results), *(["--num-rows", "5000"]
                                                           if dry_run else [])],
                             cwd=REPO, env=clean_env(), stdout=sys.stderr,
                             stderr=sys.stderr, timeout=240, check=False)
    if job.returncode == 0 and results.exists():
        import json

        res = json.loads(results.read_text())
        rep.set(job={"backend": res["backend"], "device": res["device"],
                     "steps": res["steps"], "samples_per_s": round(res["samples_per_s"]),
                     "mode": res["mode"]})
    else:
        rep.set(job={"error": f"exit {job.returncode} (its output is in this stage's log)"})
    want = "gloo" if dry_run else "nccl"
    problems = []
    if not rank.get("ok"):
        problems.append(f"one-rank group: {rank.get('error')}")
    job_fig = rep.figures.get("job", {})
    if job_fig.get("backend") != want:
        problems.append(f"default job through torchrun: {job_fig}")
    rep.finish(not problems, "; ".join(map(str, problems)) or None)


def stage_nccl_rank(rep: StageReport, dry_run: bool, work: Path) -> None:
    """One torchrun rank: worker/runtime/dist.py's init_distributed, then each collective the
    worker uses, on the device."""
    import torch
    import torch.distributed as dist

    from worker.embedding.comm import BlockCap, exchange_blocks
    from worker.runtime.dist import destroy_distributed, init_distributed

    device = pick_device(dry_run)
    t = Timer()
    ctx = init_distributed(device.type, timeout_s=120)
    rep.set(backend=ctx.backend, dist_backend=str(dist.get_backend()), device=str(ctx.device),
            init_s=round(t(), 2), world_size=ctx.world_size,
            torchelastic_run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""))
    try:
        checks: dict[str, str] = {}
        x = torch.arange(4, dtype=torch.float32, device=ctx.device)
        dist.all_reduce(x)
        checks["all_reduce"] = "ok" if torch.equal(x.cpu(), torch.arange(4.0)) else f"{x}"
        out = torch.empty(5, device=ctx.device)
        dist.all_to_all_single(out, torch.arange(5.0, device=ctx.device), [5], [5])
        checks["all_to_all_single"] = ("ok" if torch.equal(out.cpu(), torch.arange(5.0))
                                       else f"{out}")
        header = torch.tensor([[3, 1]], device=ctx.device)
        block = torch.arange(7, device=ctx.device)
        got_header, data, lengths = exchange_blocks(header, [block], BlockCap(), None, None)
        checks["exchange_blocks"] = ("ok" if got_header == [[3, 1]] and lengths == [7]
                                     and torch.equal(data.cpu(), torch.arange(7))
                                     else f"{got_header} {lengths} {data}")
        box: list[Any] = [{"run": "x"}]
        dist.broadcast_object_list(box, src=0)
        gathered: list[Any] = [None]
        dist.all_gather_object(gathered, "rank0")
        checks["objects"] = "ok" if box[0] == {"run": "x"} and gathered == ["rank0"] else (
            f"{box} {gathered}")
        group = dist.new_group(backend=ctx.backend)
        y = torch.ones(3, device=ctx.device)
        dist.all_reduce(y, group=group)
        checks["new_group"] = "ok" if torch.equal(y.cpu(), torch.ones(3)) else f"{y}"
        dist.barrier()
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            dist.all_reduce(y)
            sync(ctx.device)
            times.append(time.perf_counter() - t0)
        times.sort()
        rep.set(checks=checks, all_reduce_median_us=round(times[len(times) // 2] * 1e6, 1))
        bad = {k: v for k, v in checks.items() if v != "ok"}
        want = "gloo" if dry_run else "nccl"
        if ctx.backend != want:
            bad["backend"] = f"{ctx.backend}, not {want}"
        rep.finish(not bad, str(bad) if bad else None)
    finally:
        destroy_distributed()


# -- sync_debug: the loop under CUDA's sync debug mode -----------------------------------

class SyncWatch:
    """CUDA's sync debug mode ("warn") around a block, every warning it gives kept with
    the place in this repository that asked for the synchronising call."""

    def __init__(self, mode: str = "warn") -> None:
        self.mode = mode
        self.sites: dict[str, dict[str, Any]] = {}
        self._catch = warnings.catch_warnings()

    def __enter__(self) -> SyncWatch:
        from worker.runtime.device_copy import sync_debug

        self._debug = sync_debug(self.mode)
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._previous = warnings.showwarning
        warnings.showwarning = self._seen  # type: ignore[assignment]
        self._debug.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._debug.__exit__(*exc)
        warnings.showwarning = self._previous  # type: ignore[assignment]
        self._catch.__exit__(*exc)

    def _seen(self, message: Any, category: Any, filename: str, lineno: int,
              file: Any = None, line: Any = None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._previous(message, category, filename, lineno, file, line)
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f.filename.startswith(str(REPO))
                  and not f.filename.startswith(CHECK_FOLDERS)]
        where = [f"{Path(f.filename).relative_to(REPO)}:{f.lineno} {f.name}" for f in frames]
        site = where[-1] if where else f"{filename}:{lineno}"
        entry = self.sites.setdefault(site, {"count": 0, "stack": where[-8:]})
        entry["count"] += 1


# dynamic tables (evictions, page-ins, refusals, expiry) with the rows on the device
DYNAMIC_JOB = ["--local-optimizer", "--staleness", "1", "--task", "tables", "--num-rows", "300",
               "--batch-size", "32",
               "--tables", "user:40:dynamic:lfu:expire=6,ad:30:3:dynamic:threshold=2,s:50"]


def stage_sync_debug(rep: StageReport, dry_run: bool, work: Path) -> None:
    import torch
    from gpu_jobs import train_in_process
    from harness import Server

    from hybridps import optim, pooled_bags
    from tests.testing.cpu_sync_debug import SyncingOps
    from worker.runtime.device_copy import SYNC_HITS, SYNC_POINTS
    from worker.runtime.dist import destroy_distributed, init_distributed

    device = pick_device(dry_run)
    on_cuda = device.type == "cuda"
    # On the CPU: the calls that would synchronise on CUDA
    # (tests/testing/cpu_sync_debug.py), on the torch kernels a CUDA device runs
    rep.set(named_sync_points=SYNC_POINTS, checked=on_cuda,
            watched_by="CUDA's sync debug mode" if on_cuda else "tests/testing/cpu_sync_debug.py")
    if not on_cuda:
        optim.set_kernel("torch")
        pooled_bags.set_pool_kernel("torch")
    steps = 10 if dry_run else 60
    size = ["--num-rows", "5000"] if dry_run else []
    ctx = init_distributed(device.type)
    unnamed_total = 0
    failed: list[str] = []
    try:
        with Server(work / "ps_sync") as server:
            ps = ["--ps", server.address]
            runs = {"server K=1": [*ps, "--staleness", "1"],
                    "server K=0": [*ps, "--staleness", "0"],
                    "server bf16 K=1": [*ps, "--staleness", "1", "--row-dtype", "bf16"],
                    "local-optimizer K=0": ["--local-optimizer", "--staleness", "0"],
                    "dynamic ids K=1": DYNAMIC_JOB}
            results: dict[str, Any] = {}
            for name, args in runs.items():  # the newest path last: a crash ends it alone
                SYNC_HITS.clear()
                watch = SyncWatch("warn") if on_cuda else SyncingOps()
                sized = args if args is DYNAMIC_JOB else [*args, *size]
                try:
                    res = train_in_process(ctx, sized, steps, around_train=watch)
                except Exception as exc:
                    failed.append(name)
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
                    rep.set(runs=results, failed_runs=failed)
                    continue
                unnamed_total += sum(s["count"] for s in watch.sites.values())
                results[name] = {
                    "steps": res["steps"],
                    "unnamed_syncs": watch.sites,
                    "named_per_step": {k: round(v / res["steps"], 2)
                                       for k, v in sorted(SYNC_HITS.items())}}
                rep.set(runs=results, unnamed_total=unnamed_total)
            if device.type == "cuda" and unnamed_total == 0 and "server K=1" not in failed:
                # nothing unnamed under "warn": the same loop under "error" must run through
                try:
                    train_in_process(ctx, [*ps, "--staleness", "1"], 30,
                                     around_train=SyncWatch("error"))
                    rep.set(error_mode="ran clean")
                except RuntimeError as exc:
                    rep.set(error_mode=f"FAILED: {exc}"[:500])
    finally:
        destroy_distributed()
    errors = [f"runs that failed: {', '.join(failed)} (figures.runs.*.error)"] if failed else []
    if unnamed_total:
        errors.append(f"{unnamed_total} synchronising calls outside the named sync points "
                      "(figures.runs.*.unnamed_syncs)")
    if on_cuda:
        torch.cuda.synchronize()
        if not unnamed_total and rep.figures.get("error_mode") != "ran clean":
            errors.append(f"error mode: {rep.figures.get('error_mode', 'not run')}")
    # on the CPU: the watcher of tests/testing/cpu_sync_debug.py (CUDA's "error" run needs a GPU)
    rep.finish(not errors, "; ".join(errors) or None)


# -- entry point --------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("stage")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--limit-s", type=float, default=0.0,
                   help="the stage's time limit (check.py's), for stages that budget within")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rep = StageReport(args.work / f"{args.stage}.json", args.dry_run)
    stages = {
        "prepare": lambda: stage_prepare(rep, args.dry_run),
        "pytest_gpu": lambda: stage_pytest_gpu(rep, args.dry_run, args.work),
        "nccl": lambda: stage_nccl(rep, args.dry_run, args.work),
        "nccl_rank": lambda: stage_nccl_rank(rep, args.dry_run, args.work),
        "sync_debug": lambda: stage_sync_debug(rep, args.dry_run, args.work),
        "default_job": lambda: _jobs().stage_default_job(rep, args.dry_run, args.work),
        "table_budget": lambda: _jobs().stage_table_budget(rep, args.dry_run),
        "server_threads": lambda: _server().stage_server_threads(rep, args.dry_run,
                                                                 args.work),
        "production_job": lambda: _production().stage_production_job(
            rep, args.dry_run, args.work, args.limit_s),
    }
    if args.stage not in stages:
        p.error(f"stage {args.stage!r} is not one of {', '.join(stages)}")
    from hybridps.logs import setup_logging

    setup_logging("INFO", sys.stderr, stage=args.stage)  # the in-process workers' log lines
    log(f"stage {args.stage}{' (dry run)' if args.dry_run else ''}")
    with rep.failing_on_error():
        stages[args.stage]()
    return 0 if rep.data["ok"] else 1


def _jobs() -> Any:
    import gpu_jobs

    return gpu_jobs


def _server() -> Any:
    import gpu_server

    return gpu_server


def _production() -> Any:
    import gpu_production

    return gpu_production


if __name__ == "__main__":
    from worker.runtime.lifecycle import exit_process

    exit_process(main())
