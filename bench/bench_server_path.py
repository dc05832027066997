"""The server path's cost on the ids20 job: CPU a step of rank 0 and of the shard server.

    python bench/bench_server_path.py --quick                  # this checkout, Adam + rwada
    python bench/bench_server_path.py --root . --root ../base --repeats 3
    python bench/bench_server_path.py --server-args "" --server-args "--kernel-threads 1"
    python bench/bench_server_path.py --prediction     # the K=1 prediction's kernel alone

`bench_vs_torchrec.py --jobs ids20`'s hybridps run (one 1M x 64 table, 20 ids a sample,
2 gloo ranks, batch 1024 a rank, --dense-parallel ddp) with the optimizer state on a
shard server at --staleness 1, for Adam and for rowwise Adagrad
(`--optimizer rowwise_adagrad --dense-optimizer adam`), and the same in-process
(--local-optimizer, K=1 too, so the difference is the server path alone). Every variant
(checkout x --server-args x optimizer x mode) runs once per repeat, interleaved, so the
machine's drift falls on all alike; a checkout's code runs alone in its processes
(cwd and PYTHONPATH). Reported, medians over the repeats: samples/s, rank 0's CPU a step
(every thread of its process), the server's CPU a step (/proc, over rank 0's training
span) and rank 0's step parts (the worker's phase timings).

--prediction: the weight prediction's per-step work at K=1 alone (hybridps/row_deltas.py
`pick_offsets`: the delta of each pending row, 0 where it has none), ids20's shapes (the
~6.3k rows a rank owns of a step, half of them in the previous step's update, dim 64),
thread CPU a call, native kernel against its torch path (the same results, bitwise),
interleaved rounds, medians.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (  # bench/ is sys.path[0] when run as a script
    REPO,
    TORCHRUN,
    CpuSampler,
    bench_parser,
    child_env,
    write_json,
)

if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

JOB = ["--task", "tables", "--tables", "t0:1000000:20", "--dim", "64", "--batch-size", "1024",
       "--dense-parallel", "ddp"]
OPTIMIZERS = {"adam": [], "rwada": ["--optimizer", "rowwise_adagrad", "--dense-optimizer",
                                    "adam"]}
PARTS = ("apply", "data", "forward", "a2a", "backward", "optimizer", "push")
STARTUP_TIMEOUT_S = 60.0


def start_server(root: Path, directory: Path, args: list[str]) -> tuple[subprocess.Popen[bytes],
                                                                         str]:
    port_file = directory / "ps.port"
    port_file.unlink(missing_ok=True)
    with open(directory / "ps.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ps", "--host", "127.0.0.1", "--port",
                                 "0", "--port-file", str(port_file), *args], cwd=root,
                                env=child_env(PYTHONPATH=str(root)), stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"shard server did not start; see {directory / 'ps.log'}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def run_one(root: Path, server_args: list[str], optimizer: str, mode: str, steps: int,
            directory: Path) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    server, sampler = None, None
    if mode == "server":
        server, address = start_server(root, directory, server_args)
        sampler = CpuSampler(server.pid)
        source = ["--ps", address]
    else:
        source = ["--local-optimizer"]
    results = directory / "results.json"
    try:
        proc = subprocess.run(
            [TORCHRUN, "--standalone", "--nproc_per_node", "2", str(root / "worker" / "main.py"),
             *source, "--staleness", "1", "--steps", str(steps), "--eval-batches", "1",
             "--eval-every", "0", "--log-every", "50", "--progress", "false", *JOB,
             *OPTIMIZERS[optimizer], "--results", str(results)],
            cwd=root, env=child_env(PYTHONPATH=str(root)), capture_output=True, text=True,
            check=False, timeout=1800)
        (directory / "worker.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed, see {directory / 'worker.log'}:\n"
                               f"{proc.stderr[-2000:]}")
    finally:
        if sampler is not None:
            sampler.stop()
        if server is not None:
            server.terminate()
            server.wait(30)
    res = json.loads(results.read_text())
    n = res["steps"]
    server_cpu = sampler.cpu_between(*res["train_span_unix_s"]) if sampler is not None else None
    return {"samples_per_s": res["samples_per_s"], "step_ms": res["train_time_s"] / n * 1e3,
            "rank0_cpu_ms": res["train_cpu_s"] / n * 1e3,
            "server_cpu_ms": None if server_cpu is None else server_cpu / n * 1e3,
            "parts_ms": {k: res["step_time_s"].get(k, 0.0) * 1e3 for k in PARTS}}


def prediction_cpu_us(rounds: int = 7, calls: int = 200) -> dict[str, float]:
    """Thread CPU µs of one `pick_offsets` call, native and torch, interleaved rounds."""
    import torch

    from hybridps import optim
    from hybridps.row_deltas import pick_offsets

    torch.set_num_threads(1)  # like a torchrun rank (OMP_NUM_THREADS=1)
    gen = torch.Generator().manual_seed(0)
    rows, shard = 6300, 500_000
    perm = torch.randperm(shard, generator=gen)
    keys_L = perm[:rows].sort().values  # the previous update's rows
    pending_N = torch.cat([perm[: rows // 2], perm[rows: rows + rows - rows // 2]]).sort().values
    delta_LD = torch.randn(rows, 64, generator=gen)
    times: dict[str, list[float]] = {"native": [], "torch": []}
    before = optim.kernel_info()["requested"]
    try:
        for _ in range(rounds):
            for kernel in times:
                optim.set_kernel(kernel)
                start = time.thread_time()
                for _ in range(calls):
                    pick_offsets(keys_L, delta_LD, pending_N)
                times[kernel].append((time.thread_time() - start) / calls * 1e6)
    finally:
        optim.set_kernel(before)
    return {k: statistics.median(v) for k, v in times.items()}


def median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="150 steps a run instead of 400")
    p.add_argument("--root", type=Path, action="append",
                   help="a checkout to measure (default: this one); repeat to compare")
    p.add_argument("--server-args", action="append",
                   help="the shard server's flags, one variant each (default: none)")
    p.add_argument("--optimizers", default="adam,rwada", help="comma list of adam, rwada")
    p.add_argument("--no-local", action="store_true", help="skip the in-process runs")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--prediction", action="store_true",
                   help="only the K=1 prediction's kernel, native against torch")
    args = p.parse_args(argv)
    if args.prediction:
        got = prediction_cpu_us()
        print(f"pick_offsets, 6300 pending rows x 64 (thread CPU a call, medians of 7 "
              f"interleaved rounds): native {got['native']:.0f} us, torch {got['torch']:.0f} "
              f"us; load " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
        write_json(args.json, {"bench": "server_path_prediction", **got})
        return 0
    steps = args.steps or (150 if args.quick else 400)
    roots = [r.resolve() for r in (args.root or [REPO])]
    server_args = args.server_args or [""]
    optimizers = [o for o in args.optimizers.split(",") if o]
    for o in optimizers:
        if o not in OPTIMIZERS:
            p.error(f"--optimizers: {o!r} is not one of {', '.join(OPTIMIZERS)}")
    variants = [(root, sargs, opt, "server") for opt in optimizers for root in roots
                for sargs in server_args]
    if not args.no_local:
        variants += [(root, "", opt, "local") for opt in optimizers for root in roots]
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(variants))}
    tmp = Path(tempfile.mkdtemp(prefix="bench_server_path-"))
    for rep in range(args.repeats):
        for i, (root, sargs, opt, mode) in enumerate(variants):
            r = run_one(root, shlex.split(sargs), opt, mode, steps, tmp / f"r{rep}-v{i}")
            runs[i].append(r)
            print(f"repeat {rep} {root.name} [{sargs}] {opt} {mode}: "
                  f"{r['samples_per_s']:.0f} samples/s, rank 0 {r['rank0_cpu_ms']:.2f} CPU ms"
                  + ("" if r["server_cpu_ms"] is None else
                     f", server {r['server_cpu_ms']:.2f} CPU ms") + " a step",
                  file=sys.stderr, flush=True)
    head = (f"{'checkout':<14} {'server args':<20} {'opt':<6} {'mode':<7} {'samples/s':>9} "
            f"{'step':>6} {'rank0':>6} {'server':>6}  " + " ".join(f"{k[:7]:>7}" for k in PARTS))
    lines = [f"ids20, {steps} steps a run, {args.repeats} interleaved repeat(s), medians; "
             "ms a step (rank 0 and server: CPU ms)", head, "-" * len(head)]
    summary = []
    for i, (root, sargs, opt, mode) in enumerate(variants):
        rs = runs[i]
        row = {"root": str(root), "server_args": sargs, "optimizer": opt, "mode": mode,
               "samples_per_s": median([r["samples_per_s"] for r in rs]),
               "step_ms": median([r["step_ms"] for r in rs]),
               "rank0_cpu_ms": median([r["rank0_cpu_ms"] for r in rs]),
               "server_cpu_ms": median([r["server_cpu_ms"] for r in rs]),
               "parts_ms": {k: median([r["parts_ms"][k] for r in rs]) for k in PARTS},
               "runs": rs}
        summary.append(row)
        server = "-" if row["server_cpu_ms"] is None else f"{row['server_cpu_ms']:.2f}"
        lines.append(f"{root.name[-14:]:<14} {sargs[:20]:<20} {opt:<6} {mode:<7} "
                     f"{row['samples_per_s']:>9.0f} {row['step_ms']:>6.2f} "
                     f"{row['rank0_cpu_ms']:>6.2f} {server:>6}  "
                     + " ".join(f"{row['parts_ms'][k]:>7.2f}" for k in PARTS))
    lines.append("load: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("\n".join(lines))
    if args.json:
        write_json(args.json, {"bench": "server_path", "steps": steps, "repeats": args.repeats,
                               "variants": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
